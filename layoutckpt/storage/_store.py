"""TensorStore: the context, the spec that opens a stored array, and its errors as layoutckpt's.

Array data is read through TensorStore (many reads in flight, byte-range reads of inner
chunks), on whichever key-value store the checkpoint's location names (``_location``), except a
local checkpoint's shard files (``_shardread``); shards are encoded by ``_shardfile`` and
stored as files or as values of those key-value stores (``_writers``). The commit is ``_commit``'s, and every operating-system call ``_os``'s.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import tensorstore as ts

from ..base._errors import IntegrityError
from ..format._format import ArrayMeta, CheckpointMeta, parse_root_document

if TYPE_CHECKING:
    from ._location import Location

DEFAULT_CONCURRENCY = 32
# Object stores: how often a failed request is retried (with exponential back-off) before the
# save or load fails; LAYOUTCKPT_MAX_RETRIES overrides it.
DEFAULT_RETRIES = 16


def context(concurrency: int = DEFAULT_CONCURRENCY, retries: int | None = None) -> ts.Context:
    """A TensorStore context with no chunk cache: every byte goes straight to or from storage,
    so host memory stays near the bytes of the local shards.

    ``concurrency`` bounds the requests in flight on every store: file operations, and S3 or
    GCS requests. Its parent is the process-wide context, which holds ``memory://`` data.
    """
    from ._location import shared_context

    if retries is None:
        retries = int(os.environ.get("LAYOUTCKPT_MAX_RETRIES", DEFAULT_RETRIES))
    retry = {"max_retries": retries}
    return ts.Context(
        {
            "cache_pool": {"total_bytes_limit": 0},
            "file_io_concurrency": {"limit": concurrency},
            "s3_request_concurrency": {"limit": concurrency},
            "gcs_request_concurrency": {"limit": concurrency},
            "s3_request_retries": retry,
            "gcs_request_retries": retry,
            "data_copy_concurrency": {"limit": max(1, os.cpu_count() or 1)},
            # No fsync per file: a save makes its whole tree durable at once (fsync_tree)
            # before it reports success, and only then is the commit marker written.
            "file_io_sync": False,
        },
        parent=shared_context(),
    )


def array_spec(root: Location, meta: ArrayMeta, *, all_chunks_stored: bool = True) -> dict[str, Any]:
    """Open with ``assume_metadata``: the root document already says everything, so opening an
    array costs no read of its own ``zarr.json``."""
    metadata = {k: v for k, v in meta.zarr_metadata().items() if k not in ("zarr_format", "node_type", "attributes")}
    spec: dict[str, Any] = {
        "driver": "zarr3",
        "kvstore": root.kvstore(meta.path),
        "metadata": metadata,
    }
    # Writers too: rank 0 writes each zarr.json as a plain file, so no rank races to create it.
    spec.update(open=True, assume_metadata=True)
    # Writers store every box, zeros included. In checkpoints that say so, a missing shard or
    # inner chunk is damage (a deleted file), not a block of zeros, and reading it raises
    # instead of inventing data; older ones omitted all-zero chunks, which then read as zeros.
    spec.update(store_data_equal_to_fill_value=True, fill_missing_data_reads=not all_chunks_stored)
    return spec


def open_array(
    ctx: ts.Context, root: Location, meta: ArrayMeta, *, all_chunks_stored: bool = True
) -> ts.Future[ts.TensorStore]:
    return ts.open(array_spec(root, meta, all_chunks_stored=all_chunks_stored), context=ctx)


# TensorStore's status codes for stored bytes that cannot be trusted: a checksum or an index
# that fails (``DATA_LOSS``), a chunk that is gone (``NOT_FOUND``), and bytes that fail to decode
# (``FAILED_PRECONDITION``: a zstd or blosc stream that is corrupt, cut short, or inflates past
# its inner chunk, as a decompression bomb does; TensorStore stops decoding at the chunk's size),
# and bytes cut short under what an index says they hold (``OUT_OF_RANGE``: a truncated file).
# A committed checkpoint is never rewritten, so no read of it fails a precondition otherwise.
# Other codes (an object store that is unreachable, a permission) are no damage and pass through.
_DAMAGE_CODES = ("DATA_LOSS", "NOT_FOUND", "FAILED_PRECONDITION", "OUT_OF_RANGE")
# A packed checkpoint's manifest or B-tree node whose zstd frame is corrupt fails before its
# crc32c is checked, as ``INVALID_ARGUMENT``, whose message TensorStore gives without its code
# ("Error reading ... of local file ...: Error decoding b-tree node: ZSTD_decompressStream() ...").
_UNDECODABLE = "Error decoding "


def read_result(future: Any, name: str, where: str) -> Any:
    """A TensorStore read's result; damaged, undecodable or missing stored bytes become an
    ``IntegrityError`` naming the array (never TensorStore's bare ``ValueError``)."""
    try:
        return future.result()
    except ValueError as err:
        raise as_damage(err, name, where) from None


def as_damage(err: ValueError, name: str, where: str) -> Exception:
    """TensorStore's error ``err`` of reading ``name``: an ``IntegrityError`` where it says that the
    stored bytes are damaged, undecodable or missing, else ``err`` itself."""
    text = str(err)
    code = text.partition(":")[0]
    if code not in _DAMAGE_CODES and _UNDECODABLE not in text:
        return err
    return damaged(name, where, missing=code == "NOT_FOUND", undecodable=code != "DATA_LOSS", detail=text)


def damaged(name: str, where: str, *, missing: bool, detail: str, undecodable: bool = False) -> IntegrityError:
    if missing:
        problem = "a chunk it was saved with is missing from storage"
    elif undecodable:
        problem = "a stored chunk fails to decode (its bytes are corrupt, cut short, or inflate past its size)"
    else:
        problem = "its stored bytes fail their integrity check (crc32c or shard index)"
    return IntegrityError(
        f"array {name!r} of checkpoint {where!r} is damaged: {problem} ({detail}); the other "
        "arrays are unaffected; restore this one from another checkpoint or replica"
    )


def read_meta(path: str | os.PathLike[str] | Location) -> CheckpointMeta:
    from ._location import locate, read_marker

    loc = locate(path)
    return parse_root_document(read_marker(loc), loc.url)


def explain_replaced(err: IntegrityError, root: Location, save_id: str) -> IntegrityError:
    """``err``, or where the checkpoint at ``root`` is no longer the save ``save_id`` (replaced
    by an overwrite, or deleted, while it was read), an error that says so: its files are then
    another save's, not damaged."""
    try:
        replaced = read_meta(root).save_id != save_id
    except (OSError, ValueError):  # deleted (CheckpointNotFoundError), or in the middle of a rename
        replaced = True
    if not replaced:
        return err
    return IntegrityError(
        f"checkpoint {root.url!r} was replaced or deleted while it was read, so its files are no "
        f"longer the ones it opened; open (or load) it again ({err})"
    )


def is_committed(path: str | os.PathLike[str] | Location) -> bool:
    from ._location import locate

    return locate(path).committed()
