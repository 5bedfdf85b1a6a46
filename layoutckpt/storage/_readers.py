"""The two ways a box of a stored array comes back, behind one interface (``BoxReader``).

A local checkpoint's shard files, or a local packed one's data files, are read by layoutckpt
itself (``_shardread.read_box``): only the index and the inner chunks a box touches, each checked
and copied straight into the destination, one copy fewer than TensorStore's path. Every other
store (object stores, ``memory://``) is read through TensorStore, which copies each decoded chunk
into the destination.
A location says which reader it needs (``Location.box_reader``); the read engine
(``engine._read``) schedules both alike, asking only whether a reader's reads block.
"""

from __future__ import annotations

import abc
import itertools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import tensorstore as ts

from ..base._errors import IntegrityError
from ..base._options import IOConfig
from ..format._dtypes import numpy_dtype
from ..format._ocdbt import Unsupported
from ..format._shard import BINDING_BYTES, index_bytes
from ..layout._plan import Box, box_size, row_pieces, shard_pieces
from . import _os, _packindex, _shardread, _store

if TYPE_CHECKING:
    from ..format._format import ArrayMeta
    from ..layout._spec import Mesh


class Pending(abc.ABC):
    """A read under way; ``result()`` waits for it and raises its failure."""

    @abc.abstractmethod
    def result(self) -> Any: ...

    def cancel(self) -> None:  # noqa: B027 - most reads cannot be stopped: doing nothing is right
        """Stop the read if it has not started; a started one runs to its end."""


@attrs.frozen(eq=False)
class Lease:
    """A box a reader lends (``BoxReader.lend``): ``data`` may be copied from until ``check()``,
    called once every copy from it is done, which raises ``IntegrityError`` if the reader's
    memory was reused meanwhile (what was copied cannot be trusted then)."""

    data: np.ndarray
    check: Any  # () -> None


class BoxReader(abc.ABC):
    """Reads boxes of one checkpoint's arrays into destination arrays.

    ``where`` names the checkpoint in errors; ``complete`` says that every chunk was stored, so
    a missing one is damage rather than a block of fill values (checkpoints of format 2 on).
    """

    def __init__(self, where: str, complete: bool, io: IOConfig) -> None:
        self.where = where
        self.complete = complete
        self.io = io

    # Whether ``read`` blocks its thread until the bytes are in place: the engine then runs
    # such reads on threads of its own; otherwise ``start`` returns at once.
    blocking: bool = True

    @abc.abstractmethod
    def pieces(self, meta: ArrayMeta, box: Box, *, stream: bool) -> list[tuple[Box, bool]]:
        """The reads that fill ``box`` (``(piece, prefetch)`` each), so that no inner chunk is
        read twice. With ``stream``, a large box is read as one stream per file where the
        reader can."""

    @abc.abstractmethod
    def read(self, name: str, meta: ArrayMeta, box: Box, out: np.ndarray, *, prefetch: bool = False) -> int:
        """Fill ``out`` with ``box`` of array ``meta`` (stored as ``name``); return the bytes read
        from storage. Damage raises ``IntegrityError`` naming the array."""

    def lend(self, name: str, meta: ArrayMeta, box: Box) -> Lease | None:
        """``box`` as host memory this reader already holds, for a caller that copies it
        elsewhere (to a GPU) with no read into a buffer of its own; None where it holds none."""
        return None

    def expect(self, boxes: Sequence[tuple[ArrayMeta, Box]]) -> None:  # noqa: B027 - most readers plan nothing
        """Learn the boxes about to be read, before any is: a reader may plan its lookups."""

    def start(self, name: str, meta: ArrayMeta, box: Box, out: np.ndarray, *, prefetch: bool = False) -> Pending:
        """``read`` put in flight; only for readers that do not block."""
        raise NotImplementedError(f"{type(self).__name__} reads block; run read() on a thread")

    def close(self) -> None:  # noqa: B027 - most readers keep nothing open
        """Drop what the reader keeps open; a later read opens it again."""


class ShardFileReader(BoxReader):
    """A local checkpoint, read from its shard files (where ``locate`` puts them)."""

    blocking = True

    def __init__(
        self, root: Path, where: str, complete: bool, io: IOConfig, locate: _shardread.Locate = _shardread.Extent
    ) -> None:
        super().__init__(where, complete, io)
        self.root = root
        self.locate = locate
        self.files = _shardread.Files(root)

    def pieces(self, meta: ArrayMeta, box: Box, *, stream: bool) -> list[tuple[Box, bool]]:
        nbytes = box_size(box) * _itemsize(meta)
        if not stream or nbytes < self.io.large_read_bytes:
            return [(box, False)]
        # One sequential read-ahead stream per shard file: a cold disk serves one stream per
        # file faster than several threads reading parts of one file at once.
        return [(piece, True) for piece in shard_pieces(box, meta.shard_shape)]

    def read(self, name: str, meta: ArrayMeta, box: Box, out: np.ndarray, *, prefetch: bool = False) -> int:
        try:
            return _shardread.read_box(
                self.root,
                meta,
                box,
                out,
                all_chunks_stored=self.complete,
                prefetch=prefetch,
                io=self.io,
                locate=self.locate,
                files=self.files,
            )
        except _shardread.Damaged as err:
            raise _store.damaged(name, self.where, missing=err.missing, detail=str(err)) from None

    def close(self) -> None:
        self.files.close()


class PackedFileReader(ShardFileReader):
    """A local packed checkpoint, read from its data files as a plain one is from its shard
    files: the shards' byte ranges come from the database's B+tree (``_packindex``). A shard
    stored inside its leaf (packs written by earlier releases) or a database in a form
    ``_packindex`` does not read goes through ``fallback``. ``writers`` and ``mesh``: the
    checkpoint's writer rules by array path, and its mesh (``_packindex.Router``)."""

    def __init__(
        self,
        root: Path,
        where: str,
        complete: bool,
        io: IOConfig,
        fallback: BoxReader,
        writers: Mapping[str, tuple[int, int]] | None = None,
        mesh: Mesh | None = None,
    ) -> None:
        super().__init__(root, where, complete, io)
        self.index = _packindex.Router(root, self.files, writers or {}, mesh)
        self.locate = self.index.locate
        self.fallback = fallback

    def expect(self, boxes: Sequence[tuple[ArrayMeta, Box]]) -> None:
        self.index.expect(boxes)

    def read(self, name: str, meta: ArrayMeta, box: Box, out: np.ndarray, *, prefetch: bool = False) -> int:
        try:
            return super().read(name, meta, box, out, prefetch=prefetch)
        except (_packindex.Inline, Unsupported):
            return self.fallback.read(name, meta, box, out)

    def close(self) -> None:
        super().close()
        self.fallback.close()


class TensorStoreReader(BoxReader):
    """Any TensorStore key-value store: object stores, ``memory://``."""

    blocking = False

    def __init__(self, location: Any, where: str, complete: bool, io: IOConfig) -> None:
        super().__init__(where, complete, io)
        self.location = location
        self._ctx = _store.context(io.concurrency, io.retries)
        self._stores: dict[str, ts.TensorStore] = {}
        self._settled = 0
        self._indexed: set[tuple[str, tuple[int, ...]]] = set()  # shards whose index was checked

    def pieces(self, meta: ArrayMeta, box: Box, *, stream: bool) -> list[tuple[Box, bool]]:
        # TensorStore reads a request that covers a whole shard as one value, its bytes held
        # next to the decoded result: pieces of whole inner-chunk rows bound that.
        rows = meta.inner_chunk_shape[0] if meta.inner_chunk_shape else 1
        return [(piece, False) for piece in row_pieces(box, rows, _itemsize(meta), self.io.piece_bytes)]

    def store(self, meta: ArrayMeta) -> ts.TensorStore:
        """The array, opened from its metadata alone (no read of its ``zarr.json``)."""
        store = self._stores.get(meta.path)
        if store is None:
            opened = _store.open_array(self._ctx, self.location, meta, all_chunks_stored=self.complete)
            store = self._stores[meta.path] = opened.result()
        return store

    def start(self, name: str, meta: ArrayMeta, box: Box, out: np.ndarray, *, prefetch: bool = False) -> Pending:
        source = self.store(meta)
        indexes = self.index_reads(meta, source, box)
        if box:
            source = source[tuple(slice(a, b) for a, b in box)]
        target = ts.array(out, copy=False, write=True)
        return _TensorStoreRead(target.write(source), name, self, out.nbytes, indexes)

    def index_reads(self, meta: ArrayMeta, store: ts.TensorStore, box: Box) -> list[IndexRead]:
        """Reads of the indexes of the shards ``box`` overlaps that no read checked yet, each with
        the binding block before it where the array is bound to its save. TensorStore checks an
        index's crc32c and that its entries lie in the shard, not that they overlap (a crafted
        index could make two cells read the same valid bytes), nor where the shard belongs."""
        bound = meta.bound_to is not None
        if not meta.inner_chunk_shape and not bound:
            return []  # one inner chunk: nothing to overlap, and no binding to check
        table_bytes = index_bytes(meta.shard_shape, meta.inner_chunk_shape)
        tail = table_bytes + (BINDING_BYTES if bound else 0)
        reads = []
        for cell in cells_of(box, meta.shard_shape):
            if (meta.path, cell) not in self._indexed:
                self._indexed.add((meta.path, cell))
                key = meta.chunk_key(cell)
                read = store.kvstore.read(key, byte_range=slice(-tail, None))
                reads.append(IndexRead(meta, key, cell, table_bytes, read))
        return reads

    def settled(self, nbytes: int) -> None:
        """Count a finished read. TensorStore decodes into buffers of its own, which the C
        allocator keeps in per-thread arenas once freed: handed back every ``trim_bytes``, a
        load peaks at its bytes rather than above them."""
        self._settled += nbytes
        if self._settled >= self.io.trim_bytes:
            self._settled = 0
            _os.release_free_memory()

    def read(self, name: str, meta: ArrayMeta, box: Box, out: np.ndarray, *, prefetch: bool = False) -> int:
        return self.start(name, meta, box, out).result()

    def close(self) -> None:
        self._stores.clear()


@attrs.frozen
class IndexRead:
    """A read of the last bytes of the shard ``key`` at grid ``cell`` of the array ``meta``: its
    binding block where bound, then its index of ``table_bytes``."""

    meta: ArrayMeta
    key: str
    cell: tuple[int, ...]
    table_bytes: int
    future: Any

    def check(self, name: str, where: str) -> None:
        """Check what was read; ``IntegrityError`` naming the array ``name`` if it fails."""
        try:
            got = _store.read_result(self.future, name, where)
        except IntegrityError:
            if self.meta.bound_to is None or not _out_of_range(self.future):
                raise
            detail = _shardread.misplaced(self.key, "too short to hold its binding block")
            raise _store.damaged(name, where, missing=False, detail=detail) from None
        if got.state != "value":  # the data read found a missing shard already
            return
        raw = bytes(got.value)
        try:
            _shardread.check_binding(self.meta, self.key, self.cell, raw)
            table = raw[len(raw) - self.table_bytes :]
            _shardread.checked_index(table, self.table_bytes, self.key, 2**63)
        except _shardread.Damaged as err:
            raise _store.damaged(name, where, missing=False, detail=str(err)) from None


def _out_of_range(future: Any) -> bool:
    try:
        future.result()
    except ValueError as err:
        return str(err).startswith("OUT_OF_RANGE")
    return False


class _TensorStoreRead(Pending):
    def __init__(
        self, future: Any, name: str, reader: TensorStoreReader, nbytes: int, indexes: list[IndexRead]
    ) -> None:
        self.future, self.name, self.reader, self.nbytes, self.indexes = future, name, reader, nbytes, indexes

    def result(self) -> int:
        # Every future settles before this returns or raises: one left to settle later would call
        # back into Python from a TensorStore thread after the caller has moved on.
        for index in self.indexes:
            _quietly(index.future)
        _store.read_result(self.future, self.name, self.reader.where)
        for index in self.indexes:
            index.check(self.name, self.reader.where)
        self.reader.settled(self.nbytes)
        return self.nbytes

    # No ``cancel``: a cancelled TensorStore future reports at once, while the read it stands for
    # may still be writing into the destination, which the caller frees once it has stopped. The
    # engine waits for it instead (``result``), so nothing writes into freed memory.


def _quietly(future: Any) -> None:
    try:
        future.result()
    except Exception:  # noqa: BLE001 - read again by read_result, which names the array
        pass


def cells_of(box: Box, shard_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The grid cells of the shards that ``box`` overlaps."""
    if any(a >= b for a, b in box):
        return []
    spans = [range(a // s, (b - 1) // s + 1) for (a, b), s in zip(box, shard_shape)]
    return list(itertools.product(*spans))


def _itemsize(meta: ArrayMeta) -> int:
    return numpy_dtype(meta.dtype).itemsize
