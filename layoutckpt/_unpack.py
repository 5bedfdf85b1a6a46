"""``export_zarr``: a packed checkpoint copied out as a plain one, which plain zarr-python reads.

A packed checkpoint (``packing="ocdbt"``, ``storage._packs``) keeps its shards and documents in
one OCDBT database: few files, but only TensorStore opens them. Sharing a checkpoint with tools
that read Zarr v3 through plain files (zarr-python, anything without TensorStore) needs the
plain layout, one object per shard and document. The two hold the same keys with the same bytes,
so unpacking is a copy of every key of the database to an object of its own: nothing is decoded,
and the crc32c checksums inside the shards keep matching. The per-rank documents are plain
objects in both and are copied as they are; the root document is the source's metadata with
``packing="files"`` (its ``save_id`` kept: the copied shards stay bound to it, and to their arrays
and cells, which are the same), written last by the destination's commit, as a save's is: until
then the destination is no checkpoint (``Location.commit``), and a failure removes what was written.

The copy runs in batches of about ``BATCH_BYTES``: one batch is read while the one before is
written, each with many requests in flight, so memory stays within a few batches whatever the
checkpoint's size (the batch read, the one written, TensorStore's copies of them); a shard
larger than a batch is held whole, as its save held it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import attrs
import tensorstore as ts

from . import _rankstate
from .base._errors import FormatError, IntegrityError
from .format._format import CheckpointMeta, root_document
from .format._hierarchy import RANK_STATE_DIR
from .format._shard import grid_cells
from .layout._plan import box_shape
from .storage import _store
from .storage._commit import new_token
from .storage._location import Location, locate
from .storage._packs import database, packed_value

# About how many bytes of values a batch holds (two batches are held at once).
BATCH_BYTES = 64 << 20
# What a batch counts for a key that is no shard: a group or array document, a few hundred bytes.
DOCUMENT_BYTES = 4 << 10

Progress = Callable[[int, int], None]
Where = str | os.PathLike[str] | Location


def export_zarr(src: Where, dst: Where, *, overwrite: bool = False, progress: Progress | None = None) -> int:
    """Write the packed checkpoint at ``src`` as a plain one (``packing="files"``) at ``dst``: one
    object per shard and per document, the same bytes, so plain ``zarr.open_group`` reads every
    array and ``load``/``verify`` see the same checkpoint. Returns the bytes copied (every
    object but the new commit marker).

    ``src`` and ``dst`` are any locations (a local path, ``memory://``, ``s3://``, ``gs://``, a
    kvstore spec). The export commits as a save does, the root document last: a failure leaves
    no checkpoint at ``dst``. A committed checkpoint at ``dst`` raises ``CheckpointExistsError``
    unless ``overwrite`` (a local directory only; an object store's is never replaced). A source
    that is already plain raises ``ValueError`` (copy it as any directory instead).
    ``progress(done, total)`` is called after each batch, in bytes of the arrays' data as
    ``verify`` counts them (decoded), so ``total`` is the checkpoint's size.
    """
    source, final = locate(src), locate(dst)
    meta = _store.read_meta(source)
    _check_source(source, final, meta)
    final.check_destination(overwrite)
    final.prepare()
    staging = final.staging(new_token())
    try:
        final.claim(staging, meta.save_id)
        copied = _copy_database(source, staging, meta, progress)
        copied += _copy_plain(source, staging, meta)
        staging.make_durable()
        final.commit(
            staging,
            root_document(attrs.evolve(meta, packing="files", writers={})),
            overwrite=overwrite,
            save_id=meta.save_id,
        )
    except BaseException:
        staging.discard()
        raise
    return copied


def _check_source(source: Location, final: Location, meta: CheckpointMeta) -> None:
    if not meta.packed:
        raise ValueError(
            f"checkpoint {source.url!r} is already plain (packing 'files'): plain zarr reads it as it is; "
            "copy it as a directory (or prefix) to put it elsewhere"
        )
    src, dst = (os.path.realpath(x.url) if x.is_local else x.url.rstrip("/") for x in (source, final))
    if src == dst:
        raise ValueError(f"export_zarr: the destination {final.url!r} is the source itself; name a new path")
    inner, outer = sorted((src, dst), key=len, reverse=True)
    if inner.startswith(outer + "/"):
        raise ValueError(
            f"export_zarr: the destination {final.url!r} and the source {source.url!r} are one inside the other, "
            "so the export would change the source or overwrite it; name a path outside the source"
        )


def shard_bytes(meta: CheckpointMeta) -> dict[str, int]:
    """Each shard's key in the checkpoint and the bytes of the box it holds, decoded."""
    sizes = {}
    for a in meta.arrays.values():
        for cell in grid_cells(a.shape, a.shard_shape):
            box = tuple((c * s, min((c + 1) * s, n)) for c, s, n in zip(cell, a.shard_shape, a.shape))
            sizes[f"{a.path}/{a.chunk_key(cell)}"] = a.itemsize * math.prod(box_shape(box))
    return sizes


def batches(keys: Iterable[str], sizes: dict[str, int], limit: int | None = None) -> Iterator[list[str]]:
    """``keys`` in order, cut into runs of about ``limit`` bytes (``BATCH_BYTES``) by ``sizes`` (a
    key alone may be more); a key not in ``sizes`` counts as a document."""
    limit = BATCH_BYTES if limit is None else limit
    batch: list[str] = []
    held = 0
    for key in keys:
        size = sizes.get(key, DOCUMENT_BYTES)
        if batch and held + size > limit:
            yield batch
            batch, held = [], 0
        batch.append(key)
        held += size
    if batch:
        yield batch


def _copy_database(source: Location, staging: Location, meta: CheckpointMeta, progress: Progress | None) -> int:
    """Every key of the source's database to a plain object of ``staging``; the bytes copied.
    Batch ``i + 1`` is read while batch ``i`` is written."""
    ctx = _store.context()
    packed = ts.KvStore.open(database(source), context=ctx).result()
    plain = ts.KvStore.open(staging.kvstore(), context=ctx).result()
    sizes = shard_bytes(meta)
    total, done, copied = sum(sizes.values()), 0, 0
    writing: list[Any] = []
    for batch in batches((k.decode() for k in packed.list().result()), sizes):
        reads = [(key, packed.read(key)) for key in batch]
        _wait(writing)
        writing, nbytes = _write(plain, reads, source)
        copied += nbytes
        done += sum(sizes.get(key, 0) for key in batch)
        if progress is not None:
            progress(done, total)
    _wait(writing)
    return copied


def _write(plain: ts.KvStore, reads: list[tuple[str, Any]], source: Location) -> tuple[list[Any], int]:
    """Each read value written as it arrives (TensorStore takes a copy: the value goes at once);
    the writes in flight and their bytes."""
    writing, nbytes = [], 0
    while reads:
        key, read = reads.pop(0)
        value = _value(key, read.result(), source)
        writing.append(plain.write(key, value))
        nbytes += len(value)
    return writing, nbytes


def _wait(futures: list[Any]) -> None:
    for f in futures:
        f.result()


def _value(key: str, got: Any, source: Location) -> bytes:
    if got.state != "value":
        raise IntegrityError(f"checkpoint {source.url!r}: {key!r} is listed in its database but cannot be read")
    return packed_value(key, got.value, source.url)


def hidden_keys(meta: CheckpointMeta) -> list[str]:
    """The plain objects beside the database besides the marker: the per-rank documents and
    their group's document (``_rankstate``)."""
    if meta.rank_state_world is None:
        return []
    return [f"{RANK_STATE_DIR}/zarr.json", *(_rankstate.file_name(r) for r in range(meta.rank_state_world))]


def _copy_plain(source: Location, staging: Location, meta: CheckpointMeta) -> int:
    items = []
    for key in hidden_keys(meta):
        data = source.read(key)
        if data is None:
            raise FormatError(f"checkpoint {source.url!r} lacks its per-rank document {key!r}; it is damaged")
        items.append((key, data))
    staging.write_many(items)
    return sum(len(d) for _, d in items)
