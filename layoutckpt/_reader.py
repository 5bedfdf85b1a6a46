"""``open``: a lazy reader for one process, no ``torch.distributed`` needed.

Opening reads one small document (the root metadata). ``read`` opens the array from that
metadata alone and fetches only the inner chunks the requested slice overlaps.
"""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs
import numpy as np
import tensorstore as ts

from .base._errors import TemplateMismatchError

# _shardfile is not used here, only imported: the order in which the C extensions load decides
# the order of their teardown at exit, and without this import gloo ranks aborted now and then
# as they exited (``_format._parse_helpers``).
from . import _rankstate
from .format._dtypes import numpy_dtype
from .format._format import ArrayMeta, CheckpointMeta
from .layout._plan import Box
from .layout._spec import Mesh, P
from .layout._tree import decode_value, leaf_nodes
from .storage import _shardfile, _store  # noqa: F401
from .storage._location import LocalDir, locate
from .torch._tensors import to_numpy
from .torch._torch import is_tensor


@attrs.frozen
class ArrayInfo:
    """How one array is stored: global shape and dtype, chunking, and the spec it was saved with.

    ``name`` is the global name asked for (a name tied to another at save time describes the
    array stored under the first name). ``shape`` is the global shape and ``dtype`` the NumPy
    dtype (``ml_dtypes`` types for bfloat16 and float8). ``shard_shape`` is the shape of one
    stored shard (the Zarr chunk, one writer's box) and ``inner_chunk_shape`` that of an inner
    chunk, the smallest unit a read fetches. ``spec`` and ``saved_mesh`` are the partition spec
    and mesh it was saved with; loading may use any other. ``kind`` is what was saved:
    ``"torch"``, ``"numpy"`` or ``"numpy_scalar"``. ``compression`` is ``"zstd"``, ``"blosc"``
    or ``None``.
    """

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    shard_shape: tuple[int, ...]
    inner_chunk_shape: tuple[int, ...]
    spec: P
    saved_mesh: Mesh
    kind: str
    compression: str | None

    @property
    def nbytes(self) -> int:
        """Bytes of the whole array, uncompressed: the number of elements times the item size."""
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


class Reader:
    """Read arrays (or slices) and values of a committed checkpoint; ``open`` makes one.

    ``aliases`` maps each name tied to another at save time (shared weights) to the name its
    array is stored under; ``read`` and ``info`` accept either name.

    >>> rd = open(path)                         # doctest: +SKIP
    >>> rd.read("model.embed.weight", np.s_[0:8, :])  # doctest: +SKIP
    """

    # concurrency: _store.DEFAULT_CONCURRENCY, spelled out for the docs; a test checks.
    def __init__(self, path: str | os.PathLike[str], *, concurrency: int = 32) -> None:
        self._root = locate(path)
        self.path = self._root.url if isinstance(path, Mapping) else os.fspath(path)
        """The path the reader was opened with (a kvstore dict's URL)."""
        self.meta: CheckpointMeta = _store.read_meta(self._root)
        """The parsed root metadata of the checkpoint."""
        self._ctx = _store.context(concurrency)
        self._stores: dict[str, ts.TensorStore] = {}
        nodes = list(leaf_nodes(self.meta.tree))
        self._values = {name: node for name, node in nodes if "array" not in node}
        # Names tied at save time (shared weights) read the array stored under the first name.
        self.aliases: dict[str, str] = {n: node["array"] for n, node in nodes if node.get("array", n) != n}
        """``{name: stored name}`` for the names tied to another at save time (shared weights)."""

    def __repr__(self) -> str:
        return f"Reader({self.path!r}, step={self.step}, arrays={len(self.meta.arrays)})"

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Drop the arrays opened so far; ``with`` calls it. A later read opens them again."""
        self._stores.clear()

    @property
    def step(self) -> int | None:
        """The ``step=`` the checkpoint was saved with, or None."""
        return self.meta.step

    @property
    def metadata(self) -> dict[str, Any]:
        """The user metadata saved with the checkpoint."""
        return dict(self.meta.user_metadata)

    def rank_states(self) -> list[Any]:
        """Every saved rank's ``rank_state=`` document (index = saved rank); empty if none."""
        world = self.meta.rank_state_world
        if world is None:
            return []
        return _rankstate.read_all(self._root, world)

    def keys(self) -> list[str]:
        """Global names of the stored arrays, in tree order."""
        return list(self.meta.arrays)

    def value_keys(self) -> list[str]:
        """Global names of the non-array (JSON) leaves."""
        return list(self._values)

    def __contains__(self, name: object) -> bool:
        return name in self.meta.arrays or name in self._values or name in self.aliases

    def _array(self, name: str) -> ArrayMeta:
        try:
            return self.meta.arrays[self.aliases.get(name, name)]
        except KeyError:
            close = [k for k in self.meta.arrays if name in k or k in name][:5]
            hint = f"; similar names: {close}" if close else ""
            raise KeyError(f"no array {name!r} in checkpoint {self.path!r}{hint}; rd.keys() lists them") from None

    def info(self, name: str) -> ArrayInfo:
        """How array ``name`` is stored (an ``ArrayInfo``), from the metadata: no data is read.

        Raises ``KeyError``, with similar names, if the checkpoint holds no such array (a JSON
        leaf is not an array: ``value_keys()`` lists those).
        """
        a = self._array(name)
        return ArrayInfo(
            name=name,
            shape=a.shape,
            dtype=numpy_dtype(a.dtype),
            shard_shape=a.shard_shape,
            inner_chunk_shape=a.inner_chunk_shape,
            spec=a.spec,
            saved_mesh=a.mesh or self.meta.mesh,
            kind=a.kind,
            compression=a.compression,
        )

    def tensorstore(self, name: str) -> ts.TensorStore:
        """The array as a TensorStore, for reads this API does not cover."""
        name = self.aliases.get(name, name)
        store = self._stores.get(name)
        if store is None:
            meta = self._array(name)
            store = _store.open_array(
                self._ctx, self._root, meta, all_chunks_stored=self.meta.all_chunks_stored
            ).result()
            self._stores[name] = store
        return store

    def read_async(self, name: str, index: Any = None) -> ts.Future[np.ndarray]:
        """A future of ``read(name, index)``."""
        store = self.tensorstore(name)
        return (store if index is None else store[_numpy_index(index, store.shape, name)]).read()

    def read(self, name: str, index: Any = None, *, out: Any = None) -> Any:
        """The array ``name`` (or ``index`` of it, e.g. ``np.s_[0:8, :]``) as NumPy; a JSON leaf's value.

        Only the inner chunks the index overlaps are read from storage. ``out``, a writable NumPy
        array or CPU tensor of the result's shape and dtype, receives the result instead of a new
        array and is returned: a loop reading tensors of one shape into one buffer pays for
        fresh memory once (first touches cost as much as a third of a cold 65 MB read on a
        virtual machine that hands freed memory back to its host, docs/performance.md).
        """
        if name in self._values:
            if out is not None:
                raise TemplateMismatchError(f"{name!r} is a JSON value, not an array; read it without out=")
            return decode_value(self._values[name])
        store = self.tensorstore(name)
        if index is not None:
            index = _numpy_index(index, store.shape, name)
        box = _box_of(store, index)
        meta = self._array(self.aliases.get(name, name))
        dtype = numpy_dtype(meta.dtype)
        view = store[index] if box is None else None  # the index, already NumPy's, as TensorStore reads it
        shape = view.shape if view is not None else tuple(b - a for a, b in box)
        result = _out_array(out, name, shape, dtype) if out is not None else None
        if view is not None:
            value = _store.read_result(view.read(), name, self.path)
            if result is None:
                return value
            np.copyto(result, value)
            return out
        if result is None:
            result = np.empty(shape, dtype=dtype)
            out = result
        if isinstance(self._root, LocalDir):
            self._read_local(name, meta, box, result)
            return out
        target = ts.array(result, copy=False, write=True)
        if result.nbytes < PIECEWISE_BYTES:
            _store.read_result(target.write(store[tuple(slice(a, b) for a, b in box)]), name, self.path)
            return out
        # A large box goes in row pieces on the inner chunk grid, all in flight at once, each
        # copied by TensorStore straight into the result: on a cold disk a 65 MB tensor took
        # 0.06-0.13 s where one whole read took 0.11-0.17 s (a raw read of its file: 0.06 s),
        # and warm 0.03-0.045 s against 0.065-0.075 s. No chunk is read twice.
        start = box[0][0]
        copies = []
        for piece in _row_pieces(box, meta.inner_chunk_shape[0]):
            (a, b), view = piece[0], store[tuple(slice(lo, hi) for lo, hi in piece)]
            copies.append(target[a - start : b - start].write(view))
        for c in copies:
            _store.read_result(c, name, self.path)
        return out

    def _read_local(self, name: str, meta: ArrayMeta, box: Box, out: np.ndarray) -> None:
        """A box of a local checkpoint, read from its shard files (``_shardfile.read_box``)
        straight into ``out``. A large box is read shard by shard with ``prefetch``: one
        sequential stream through each file, checked as it arrives, the shards on up to
        ``READ_THREADS`` threads at once. The 65 MB embedding in one shard, cold, medians of 40
        reads: 0.036-0.042 s, against 0.048-0.056 s in row pieces on 4 threads, which read one
        file at 4 places at once. In 2 or 4 shards, 16-20 reads of each alternated: 0.030-0.034 s,
        against 0.039-0.046 s in row pieces. A shard the page cache holds is read on its thread
        with no read-ahead (``read_box``), as fast warm as row pieces (docs/performance.md)."""
        assert isinstance(self._root, LocalDir)
        read = functools.partial(_store.read_box, self._root.root, meta, name, self.path, self.meta.all_chunks_stored)
        if out.nbytes < PIECEWISE_BYTES:
            read(box, out)
            return
        pieces = _shard_pieces(box, meta.shard_shape)
        if len(pieces) == 1:
            read(box, out, prefetch=True)
            return
        origin = [a for a, _ in box]
        with ThreadPoolExecutor(min(len(pieces), READ_THREADS), thread_name_prefix="layoutckpt-read") as threads:
            done = [
                threads.submit(
                    read, piece, out[tuple(slice(a - o, b - o) for (a, b), o in zip(piece, origin))], prefetch=True
                )
                for piece in pieces
            ]
            for f in done:
                f.result()


def _shard_pieces(box: Box, shard_shape: Sequence[int]) -> list[Box]:
    """``box`` cut along the shard grid: one piece per shard file it overlaps, in grid order."""
    per_dim = [
        [(max(a, c * s), min(b, (c + 1) * s)) for c in range(a // s, (b - 1) // s + 1)]
        for (a, b), s in zip(box, shard_shape)
    ]
    return [tuple(piece) for piece in itertools.product(*per_dim)]


def _out_array(out: Any, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """``out`` of ``Reader.read`` as the NumPy array to fill (a view of a tensor's memory),
    after checking it can hold the result."""
    if is_tensor(out):
        if out.device.type != "cpu":
            raise TemplateMismatchError(
                f"out= for {name!r} is on {out.device}; read into a CPU tensor (pinned or not) and copy it over"
            )
        out = to_numpy(out)
    if not isinstance(out, np.ndarray):
        raise TemplateMismatchError(f"out= for {name!r} is a {type(out).__name__}; pass a NumPy array or a CPU tensor")
    if out.shape != shape or out.dtype != dtype:
        raise TemplateMismatchError(
            f"out= for {name!r} is {out.dtype}{list(out.shape)}, the read gives {dtype}{list(shape)}; "
            f"pass a buffer of that shape and dtype, or read without out="
        )
    if not out.flags.writeable:
        raise TemplateMismatchError(f"out= for {name!r} is read-only; pass a writable buffer")
    return out


def _row_pieces(box: Box, rows: int) -> list[Box]:
    """``box`` cut into about ``PIECES`` pieces along its first dimension, at multiples of the
    inner chunk's ``rows``, so no chunk is read by two pieces."""
    (start, stop), rest = box[0], box[1:]
    step = max(rows, -(-(stop - start) // PIECES) // rows * rows)
    cuts = [start, *range(-(-start // rows) * rows + step, stop, step), stop]
    return [((a, b), *rest) for a, b in itertools.pairwise(cuts)]


# Reads of at least this many bytes go in pieces read at once (``Reader.read``): about PIECES
# of them through TensorStore, one per shard file from a local checkpoint.
PIECEWISE_BYTES = 8 << 20
PIECES = 8
# Shard files of one large box of a local checkpoint read at once, whatever the core count:
# their threads mostly wait for the disk, and a cold disk serves more streams in flight faster.
# A cold read of a 65 MB tensor in 4 shards, on 2 cores: 0.031-0.033 s with 4 at once, 0.034 s
# with 2 (the number of shard writers, ``_shardfile.THREADS``), 16 reads of each alternated.
READ_THREADS = 4


def _numpy_index(index: Any, shape: tuple[int, ...], name: str) -> Any:
    """``index`` with NumPy's meaning where TensorStore's differs: a negative position counts
    from the end, and a slice past the end stops there. TensorStore reads both as coordinates
    (its domains may start below zero) and refuses them. Indexes with ``None``, arrays or
    lists go to TensorStore as they are."""
    terms = index if isinstance(index, tuple) else (index,)
    plain = all(t is Ellipsis or (isinstance(t, (slice, int, np.integer)) and not isinstance(t, bool)) for t in terms)
    if not plain or terms.count(Ellipsis) > 1:
        return index
    if Ellipsis in terms:
        at = terms.index(Ellipsis)
        terms = terms[:at] + (slice(None),) * (len(shape) - len(terms) + 1) + terms[at + 1 :]
    if len(terms) > len(shape):
        raise IndexError(f"{len(terms)} indices for {name!r}, which has {len(shape)} dimensions {list(shape)}")
    out: list[Any] = []
    for dim, (t, n) in enumerate(zip(terms, shape)):
        if isinstance(t, slice):
            start, stop, step = t.indices(n)
            if step > 0:
                out.append(slice(start, max(start, stop), step))
            elif start < 0:  # nothing to take going down
                out.append(slice(0, 0))
            else:  # down to and including 0: no stop TensorStore could take as a coordinate
                out.append(slice(start, None if stop < 0 else stop, step))
        elif -n <= t < n:
            out.append(int(t) % n)
        else:
            raise IndexError(f"index {t} is out of range for dimension {dim} of {name!r}, of size {n}")
    return tuple(out)


def _box_of(store: ts.TensorStore, index: Any) -> tuple[tuple[int, int], ...] | None:
    """The box that ``store[index]`` reads when the index is plain slices (unit steps, every
    dimension kept); ``None`` for any other index, which then goes to TensorStore as it is."""
    if index is None:
        view = store
    else:
        terms = index if isinstance(index, tuple) else (index,)
        if not all(isinstance(t, slice) and t.step in (None, 1) for t in terms) or len(terms) > store.rank:
            return None
        view = store[index]
    if view.rank != store.rank:
        return None
    return tuple(zip(view.domain.inclusive_min, view.domain.exclusive_max))


def open(path: str | os.PathLike[str], *, concurrency: int = 32) -> Reader:  # noqa: A001 - the verb of the API
    """Open a committed checkpoint for lazy reading in a single process.

    ``path`` takes every form ``save`` does: a local directory, ``file://``,
    ``s3://bucket/prefix``, ``gs://``, ``memory://``, or a TensorStore kvstore dict. Only the
    root metadata is read here; arrays are fetched by ``read``, inner chunk by inner chunk.
    ``concurrency`` bounds the storage requests in flight (file operations, or S3/GCS requests).
    Raises ``CheckpointNotFoundError`` if no committed checkpoint is at ``path``, and
    ``FormatError`` if its metadata is corrupt or of a newer format.
    """
    return Reader(path, concurrency=concurrency)
