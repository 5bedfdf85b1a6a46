"""Reading a box of an array from a local checkpoint's shard files (``docs/format.md`` 5.4).

``read_box`` reads the index of each shard the box touches, then only the inner chunks it needs.
Runs of adjacent wanted chunks are fetched with one ``preadv`` into one reused buffer; each
chunk's crc32c is checked and its part of the box copied straight into the destination: one
copy fewer than TensorStore's read path, which decodes every chunk into a fresh array. Where
the box cuts a shard only between chunks (a whole shard, or the columns of chunks another
layout wants), stored in order, the chunks are read in slabs with no Python per chunk but its
checksum: the common case of a load, where per-chunk work would bound a warm read.

With ``prefetch`` a thread of its own reads a shard's runs in file order, up to
``IOConfig.prefetch_depth`` ahead, while the caller's thread checks and copies: one sequential
stream per file, which a cold disk serves faster than several threads reading parts of one file.
A shard whose first page the page cache already holds is read on the caller's thread alone,
since reading ahead would only add a hand-off per run.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import attrs
import crc32c
import numpy as np

from ..base._options import DEFAULT_IO, IOConfig
from ..format._shard import ABSENT, BINDING_BYTES, BINDING_MAGIC, binding, codec_for, declared_size
from ..layout._plan import Box
from . import _os

if TYPE_CHECKING:
    from ..format._format import ArrayMeta

# An inner chunk to read: its position in the shard index, its cell in the shard's inner grid,
# and its offset and length in the file.
Chunk = tuple[int, tuple[int, ...], int, int]

# Adjacent runs that the page cache holds are read with one call up to this many bytes: a warm
# read is bound by the calls and copies per run, where a cold one is better served by small runs
# the disk can stream (``IOConfig.read_run_bytes``; docs/design/tried-and-dropped.md).
CACHED_RUN_BYTES = 2 << 20
# A large read of a shard asks the page cache for this much of it first: where it has it, the
# file is taken as warm and read on the caller's thread (a read-ahead thread only adds hand-offs).
PROBE_BYTES = 4096
# A shard a box wants whole is read with one call up to this size (its chunks, binding block and
# index): the buffer stays in the cache, and the per-shard calls are fewer.
WHOLE_SHARD_BYTES = 4 << 20

_read_lock = threading.Lock()
_bytes_read = 0  # every byte read_box has read in this process: a counter tests and demos show


class Damaged(Exception):
    """A shard file is missing or fails its checks; the caller names the array."""

    def __init__(self, missing: bool, detail: str) -> None:
        super().__init__(detail)
        self.missing = missing


@attrs.frozen
class Extent:
    """Where a shard's bytes lie under the checkpoint's root: the whole file ``path`` (a plain
    checkpoint), or ``length`` bytes at ``offset`` of it (a packed one's data file)."""

    path: str
    offset: int = 0
    length: int | None = None


# Where the shard at a key (``<array path>/<chunk key>``) lies; None where it is not stored.
Locate = Callable[[str], Extent | None]

# A reader keeps at most this many data files open; past it, each shard opens its file again.
KEPT_FILES = 64


class Files:
    """The files one reader opens under a checkpoint's root: the root opened once, and the data
    files of a packed checkpoint, which many shards share, kept open until ``close`` (or until
    the reader is dropped). A plain checkpoint's shard files are opened for each read: each is
    read once by a load, and there are thousands of them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._lock = threading.Lock()
        self._open: dict[str | None, tuple[int, int]] = {}  # path -> (fd, size); None: the root
        self._finalizer = weakref.finalize(self, _close_all, self._open)

    def open(self, extent: Extent) -> tuple[int, int, bool]:
        """The file of ``extent`` opened as ``_os.open_regular`` opens it, its size, and whether
        the caller closes it."""
        shared = extent.length is not None
        kept = self._open.get(extent.path) if shared else None
        if kept is not None:
            return (*kept, False)
        fd, size = _os.open_regular_at(self._root(), extent.path)
        if not shared:
            return fd, size, True
        with self._lock:
            kept = self._open.get(extent.path)
            if kept is None and len(self._open) <= KEPT_FILES:
                self._open[extent.path] = (fd, size)
                return fd, size, False
        if kept is None:
            return fd, size, True
        os.close(fd)  # another thread opened it meanwhile
        return (*kept, False)

    def _root(self) -> int:
        with self._lock:
            kept = self._open.get(None)
            if kept is None:
                kept = self._open[None] = (_os.open_dir(self.root), 0)
            return kept[0]

    def close(self) -> None:
        with self._lock:
            _close_all(self._open)


def _close_all(files: dict[str | None, tuple[int, int]]) -> None:
    for fd, _ in files.values():
        os.close(fd)
    files.clear()


def bytes_read() -> int:
    """Bytes this process has read from shard files through ``read_box`` (index and chunks,
    checksums included): the counterpart of TensorStore's ``/tensorstore/kvstore/file/bytes_read``."""
    return _bytes_read


def read_box(
    root: Path,
    meta: ArrayMeta,
    box: Box,
    out: np.ndarray,
    *,
    all_chunks_stored: bool = True,
    prefetch: bool = False,
    io: IOConfig = DEFAULT_IO,
    locate: Locate = Extent,
    files: Files | None = None,
) -> int:
    """Fill ``out`` with ``box`` of the array ``meta`` stored under the local directory ``root``,
    reading only the shard indexes and inner chunks the box touches. Returns the bytes read.
    ``locate`` says where each shard lies: by default, the file of its key. ``files`` opens
    them (a reader's, kept from call to call; by default, one for this call alone).

    A missing file or chunk, a failed checksum, an index that points outside its file or, for
    an array bound to its save (``meta.bound_to``), a shard whose binding block names another
    save, array or cell raise ``Damaged``; where the checkpoint predates ``all_chunks_stored``, missing chunks read as
    zeros (the fill value).
    """
    global _bytes_read
    fill = _BoxFill(meta, box, out, all_chunks_stored, io)
    own = files is None
    files = Files(root) if files is None else files
    nread = 0
    try:
        shard = meta.shard_shape
        for cell in itertools.product(*(range(a // s, (b - 1) // s + 1) for (a, b), s in zip(box, shard))):
            key = meta.chunk_key(cell)
            nread += fill.shard(files, key, locate(f"{meta.path}/{key}"), cell, prefetch)
    finally:
        if own:
            files.close()
        with _read_lock:
            _bytes_read += nread
    return nread


class _BoxFill:
    """One ``read_box`` call: the geometry of the array, worked out once, and the reused buffer."""

    def __init__(self, meta: ArrayMeta, box: Box, out: np.ndarray, complete: bool, io: IOConfig) -> None:
        self.meta, self.box, self.out, self.complete, self.io = meta, box, out, complete, io
        itemsize = out.dtype.itemsize
        self.codec = None if meta.compression is None else codec_for(meta.compression, itemsize)
        shape = _shard_geometry(tuple(meta.shard_shape), tuple(meta.inner_chunk_shape), itemsize)
        self.inner, self.grid, self.steps, self.count, self.chunk_bytes, self.chunk_strides, self.span = shape
        self.stride = self.chunk_bytes + 4  # an uncompressed chunk as stored: its items, then its crc32c
        self.table_bytes = 16 * self.count + 4
        # A bound array's shards hold their binding block just before the index: read with it.
        self.tail_bytes = self.table_bytes + (BINDING_BYTES if meta.bound_to is not None else 0)
        self.buffer = self.decoded = _EMPTY  # the run buffer and a chunk's decoded bytes, made when needed
        # Uncompressed chunks of a run that lie side by side along the last dimension, whole
        # inside the box, are placed with one strided copy (``place_block``).
        self.blocks = self.codec is None and len(self.inner) > 0 and itemsize > 0
        # Blocks are copied as plain items of the same size: strided views of dtypes NumPy only
        # knows through an extension (float8, bfloat16) cannot be made.
        self.items = out.view(_void(itemsize)) if self.blocks else out
        # A shard is read whole (``whole``) where its chunks are uncompressed and only its last
        # two dimensions hold more than one chunk, so that one strided copy places them all.
        self.whole_ok = self.blocks and all(g == 1 for g in self.grid[:-2])

    def shard(self, files: Files, key: str, extent: Extent | None, cell: Sequence[int], prefetch: bool) -> int:
        """Read this box's part of one shard, stored at ``extent``; return the bytes read."""
        origin = [c * s for c, s in zip(cell, self.meta.shard_shape)]
        try:
            if extent is None:
                raise FileNotFoundError(key)
            # A regular file inside the checkpoint only: a shard linked to another checkpoint's,
            # or made a FIFO, would otherwise be read as this one (or block the read).
            fd, size, owned = files.open(extent)
        except _os.NotRegularFile as err:
            raise Damaged(False, f"shard {key} is not a regular file inside the checkpoint ({err.strerror})") from None
        except (FileNotFoundError, NotADirectoryError):
            if self.complete:
                held = "" if extent is None or extent.length is None else f": its data file {extent.path} is missing"
                raise Damaged(True, f"shard {key} does not exist{held}") from None
            for at in itertools.product(*self.ranges(origin)):
                self.place(origin, at, None)
            return 0
        try:
            if extent.length is not None:
                if extent.offset + extent.length > size:
                    raise Damaged(False, f"shard {key} is cut short: its data file {extent.path} ends at byte {size}")
                size = extent.length
            inside = None if prefetch else self.wants_all(origin, size)
            if inside is not None and self.whole(fd, key, cell, origin, size, extent.offset, inside):
                return size
            ranges = self.ranges(origin)
            tail = self.tail(fd, key, cell, size, extent.offset)
            ordered = self.in_order(tail, size)
            # Read ahead (a large read, ``prefetch``) goes run by run: it is what a cold file needs.
            if not prefetch and ordered:
                return self.tail_bytes + self.fetch_grid(fd, key, origin, ranges, extent.offset)
            if ordered:
                offsets, lengths = self.ordered_index(extent.offset)
            else:
                offsets, lengths = self.index(key, tail, size, extent.offset)
            runs = self.runs(key, origin, ranges, offsets.tolist(), lengths.tolist(), size)
            return self.tail_bytes + (self.fetch(fd, key, origin, runs, prefetch) if runs else 0)
        finally:
            if owned:
                os.close(fd)

    def ranges(self, origin: Sequence[int]) -> list[range]:
        """The inner chunks of the shard at ``origin`` that the box overlaps, along each dimension."""
        return [
            range((max(a, o) - o) // c, (min(b, o + s) - 1 - o) // c + 1)
            for (a, b), o, s, c in zip(self.box, origin, self.meta.shard_shape, self.inner)
        ]

    def wants_all(self, origin: Sequence[int], size: int) -> bool | None:
        """Whether the shard at ``origin`` lies inside the box and the array, its last chunks'
        padding included, where it is a candidate for ``whole``: small, uncompressed, and every
        inner chunk of it overlaps the box inside the array, so that one call reads no byte the
        chunk-by-chunk path would not. None where it is not a candidate."""
        if not self.whole_ok or size > WHOLE_SHARD_BYTES:
            return None
        inside = True
        for (a, b), o, s, c, n in zip(self.box, origin, self.span, self.inner, self.meta.shape):
            end = o + s
            if a <= o and end <= b and end <= n:
                continue
            if a >= o + c or end - c >= min(b, n):
                return None
            inside = False
        return inside

    def whole(
        self, fd: int, key: str, cell: Sequence[int], origin: Sequence[int], size: int, base: int, inside: bool
    ) -> bool:
        """Read a shard the box wants every chunk of (``wants_all``) with one call, chunks and
        index together: the common case of a load, where the work per shard bounds a warm read.
        A shard ``inside`` the box is placed with one strided copy, one the box cuts (a small
        array resharded) chunk by chunk. Returns False, having placed nothing, where the shard
        is not laid out as layoutckpt writes it (its chunks in C order from its first byte, then
        the binding block and the index): the caller then reads it chunk by chunk. An index
        equal to the one of that layout, its checksum included, needs no other check."""
        if size != self.count * self.stride + self.tail_bytes:
            return False
        if len(self.buffer) < size:
            self.buffer = _scratch(size)
        data = self.buffer[:size]
        if os.preadv(fd, [data], base) != size:
            raise Damaged(False, f"shard {key} is cut short")
        tail = data[size - self.tail_bytes :]
        check_binding(self.meta, key, cell, tail)
        if not self.own_index(tail):
            return False
        first, rows = (0,) * len(self.grid), self.grid[-2] if len(self.grid) > 1 else 1
        place = self.place_slab if inside else self.place_cut
        place(key, origin, first, rows, self.grid[-1], data)
        return True

    def tail(self, fd: int, key: str, cell: Sequence[int], size: int, base: int) -> bytes:
        """The last bytes of the shard of ``size`` bytes at ``base`` in its file, read with one
        call: the binding block, checked (it must bind the shard to this array's save, path and
        ``cell``), where the array is bound, and the index."""
        if size < self.table_bytes:
            raise Damaged(False, f"shard {key} is {size} bytes, too short for its index")
        if size < self.tail_bytes:
            raise Damaged(False, misplaced(key, "too short to hold its binding block"))
        tail = os.pread(fd, self.tail_bytes, base + size - self.tail_bytes)
        check_binding(self.meta, key, cell, tail)
        return tail

    def in_order(self, tail: bytes, size: int) -> bool:
        """Whether the shard's index is the one layoutckpt writes: its uncompressed chunks one
        after the other in C order from its first byte, before the tail, checksum included. Its
        entries are then known (``ordered_index``) and need no parsing or checking entry by
        entry: a resharded load reads a part of many shards, where that would cost more than
        the chunks' copy. Where every chunk the box wants of it lies whole inside the box,
        ``fetch_grid`` reads them in slabs."""
        return self.blocks and self.count * self.stride <= size - self.tail_bytes and self.own_index(tail)

    def ordered_index(self, base: int) -> tuple[np.ndarray, np.ndarray]:
        """``index`` of a shard stored at ``base`` in its file and laid out in order (``in_order``)."""
        offsets = np.arange(base, base + self.count * self.stride, self.stride, dtype=np.uint64)
        return offsets, np.full(self.count, self.stride, np.uint64)

    def own_index(self, tail: bytes | np.ndarray) -> bool:
        """Whether the index at the end of a shard's ``tail`` is byte for byte the one layoutckpt
        writes (its chunks one after the other in C order from the shard's first byte),
        checksum included."""
        return bytes(tail[self.tail_bytes - self.table_bytes :]) == _in_order_table(self.count, self.stride)

    def index(self, key: str, tail: bytes, size: int, base: int) -> tuple[np.ndarray, np.ndarray]:
        """The index of the shard of ``size`` bytes at ``base`` in its file, from its ``tail``:
        (offsets in the file, lengths) of its inner chunks, checked: its crc32c, and every
        stored chunk inside the shard before the index (and the binding block), overlapping no
        other."""
        end = size - self.tail_bytes
        offsets, lengths = checked_index(tail[self.tail_bytes - self.table_bytes :], self.table_bytes, key, end)
        if base:
            offsets = np.where(offsets == ABSENT, offsets, offsets + np.uint64(base))
        return offsets, lengths

    def runs(
        self,
        key: str,
        origin: Sequence[int],
        ranges: list[range],
        offsets: list[int],
        lengths: list[int],
        size: int,
    ) -> list[list[Chunk]]:
        """The wanted chunks of a shard grouped into runs that lie next to each other in its file,
        each at most ``read_run_bytes`` long; absent chunks are placed as fill values (or raise)."""
        runs: list[list[Chunk]] = []
        for at in itertools.product(*ranges):
            i = sum(x * step for x, step in zip(at, self.steps))
            offset, nbytes = offsets[i], lengths[i]
            if offset == ABSENT and nbytes == ABSENT:
                if self.complete:
                    raise Damaged(True, f"inner chunk {_cell(at)} of shard {key} is not stored")
                self.place(origin, at, None)
                continue
            run = runs[-1] if runs else None
            if run is None or offset != run[-1][2] + run[-1][3] or offset + nbytes - run[0][2] > self.io.read_run_bytes:
                runs.append([])
            runs[-1].append((i, at, offset, nbytes))
        return runs

    def fetch_grid(self, fd: int, key: str, origin: Sequence[int], ranges: list[range], start: int) -> int:
        """``fetch`` of the wanted chunks of a shard stored in order (``in_order``): in
        slabs of whole chunks of up to ``CACHED_RUN_BYTES``, each read with one ``preadv`` per
        row of chunks (one in all where the rows are whole and so follow one another in the
        file) and checked with one call. A slab whole inside the box is placed with one strided
        copy; one with chunks the box cuts (at its edges) in blocks and cut chunks. Returns the
        bytes read."""
        stride = self.stride
        full = len(ranges[-1]) == self.grid[-1]
        lo, hi = self.whole_span(origin)
        total = 0
        for at, rows, cols in self.slabs(ranges):
            nbytes = rows * cols * stride
            if len(self.buffer) < nbytes:
                self.buffer = _scratch(nbytes)
            data = self.buffer[:nbytes]
            first = sum(x * step for x, step in zip(at, self.steps))
            row_step = self.steps[-2] if len(at) > 1 else 0
            row_bytes = nbytes if full else cols * stride
            for i in range(nbytes // row_bytes):
                row = data[i * row_bytes : (i + 1) * row_bytes]
                if os.preadv(fd, [row], start + (first + i * row_step) * stride) != len(row):
                    raise Damaged(False, f"inner chunk {_cell(at)} of shard {key} is cut short")
            ends = (*at[:-2], at[-2] + rows - 1, at[-1] + cols - 1) if len(at) > 1 else (at[0] + cols - 1,)
            inside = all(a <= x and y < b for x, y, a, b in zip(at, ends, lo, hi))
            (self.place_slab if inside else self.place_cut)(key, origin, at, rows, cols, data)
            total += nbytes
        return total

    def place_slab(
        self, key: str, origin: Sequence[int], at: Sequence[int], rows: int, cols: int, data: np.ndarray
    ) -> None:
        """Check the ``rows`` x ``cols`` whole chunks from ``at`` on, stored one after the other at
        the start of ``data``, and place them with one strided copy; damage names its chunk."""
        self.check_slab(key, at, rows, cols, data)
        self.place_block(origin, at, rows, cols, data)

    def place_cut(
        self, key: str, origin: Sequence[int], at: Sequence[int], rows: int, cols: int, data: np.ndarray
    ) -> None:
        """``place_slab`` of a slab the box cuts: its chunks whole inside the box placed in
        blocks, the others one by one."""
        if rows * cols == 1:
            self.check_slab(key, at, 1, 1, data)
            self.place(origin, at, data[: self.chunk_bytes].view(self.out.dtype))
        else:
            self.check_blocks(key, origin, [(0, cell, 0, self.stride) for cell in _slab_cells(at, rows, cols)], data)

    def check_slab(self, key: str, at: Sequence[int], rows: int, cols: int, data: np.ndarray) -> None:
        """Check the ``rows`` x ``cols`` whole chunks from ``at`` on, stored one after the other at
        the start of ``data``; damage names its chunk."""
        bad = self.failing(data, rows * cols)
        if bad is not None:
            cell = _slab_cells(at, rows, cols)[bad]
            raise Damaged(False, f"inner chunk {_cell(cell)} of shard {key} fails its crc32c")

    def slabs(self, ranges: list[range]) -> list[tuple[tuple[int, ...], int, int]]:
        """The wanted chunks ``ranges`` of a shard cut into ``(at, rows, cols)`` blocks of at
        most ``CACHED_RUN_BYTES`` (or one chunk): whole rows of chunks along the last dimension
        where they fit, parts of a row where they do not."""
        per = max(1, CACHED_RUN_BYTES // self.stride)
        line = ranges[-1]
        cols = min(len(line), per)
        span = ranges[-2] if len(ranges) > 1 else range(1)
        rows = min(len(span), per // len(line)) if cols == len(line) else 1
        out = []
        for lead in itertools.product(*ranges[:-2]):
            for r in range(span.start, span.stop, rows):
                for c in range(line.start, line.stop, cols):
                    at = (*lead, r, c) if len(ranges) > 1 else (c,)
                    out.append((at, min(rows, span.stop - r), min(cols, line.stop - c)))
        return out

    def failing(self, data: np.ndarray, count: int) -> int | None:
        """The first of ``count`` whole uncompressed chunks stored one after the other in
        ``data`` (each followed by its crc32c) whose checksum fails, or None."""
        stride = self.stride
        # One call over them all, where all are intact, rather than one per chunk: each call
        # hands the GIL to the other reading threads and back.
        if crc32c.crc32c(data[: count * stride]) == _intact_crc(stride, count):
            return None
        view = memoryview(data)
        found = [crc32c.crc32c(view[k * stride : k * stride + self.chunk_bytes]) for k in range(count)]
        stored = np.ndarray((count,), "<u4", data, self.chunk_bytes, (stride,)).tolist()
        if found == stored:
            return None
        return next(k for k, (a, b) in enumerate(zip(found, stored)) if a != b)

    def fetch(self, fd: int, key: str, origin: Sequence[int], runs: list[list[Chunk]], prefetch: bool) -> int:
        """Read each run with one call, check its chunks and copy them out; return the bytes
        read. With ``prefetch``, the reads go ahead on a thread of their own unless the page
        cache holds the file's first page."""
        sizes = [sum(c[3] for c in run) for run in runs]
        if len(self.buffer) < max(sizes):
            # Room for a whole run, but not a full run's bytes for a small array's one tiny chunk.
            self.buffer = _scratch(max(max(sizes), min(self.io.read_run_bytes, 16 * self.stride)))
        have = 0
        if prefetch and len(runs) > 1:
            probe = min(sizes[0], PROBE_BYTES)
            have = _os.read_cached(fd, self.buffer[:probe], runs[0][0][2])
            if have < probe:  # a cold file: read ahead (the probe's bytes read again)
                read_ahead(
                    fd, key, runs, sizes, self.io.prefetch_depth, lambda run, data: self.check(key, origin, run, data)
                )
                return sum(sizes) + have
        self.read_runs(fd, key, origin, runs, sizes, have)
        return sum(sizes)

    def read_runs(
        self, fd: int, key: str, origin: Sequence[int], runs: list[list[Chunk]], sizes: list[int], have: int
    ) -> None:
        """``fetch`` on this thread: runs the page cache holds one after the other are read with
        one call, checked and placed as one; the others one by one. ``have`` bytes of the first
        run are in the buffer already. No byte is read twice: what a read from the cache gave
        beyond the runs it holds whole is the start of the next run."""
        i = 0
        while i < len(runs):
            j, total = _adjacent(runs, sizes, i, CACHED_RUN_BYTES)
            if j > i + 1:
                if len(self.buffer) < total:
                    kept, self.buffer = self.buffer[:have], _scratch(total)
                    self.buffer[:have] = kept
                got = have + _os.read_cached(fd, self.buffer[have:total], runs[i][0][2] + have)
                k, whole = i, 0
                while k < j and whole + sizes[k] <= got:
                    whole += sizes[k]
                    k += 1
                if k > i:
                    self.check(key, origin, [c for run in runs[i:k] for c in run], self.buffer[:whole])
                    have = got - whole
                    self.buffer[:have] = self.buffer[whole:got]  # NumPy copies overlapping parts safely
                    i = k
                    continue
                have = got
            run, total = runs[i], sizes[i]
            if os.preadv(fd, [self.buffer[have:total]], run[0][2] + have) != total - have:
                raise Damaged(False, f"inner chunk {_cell(run[0][1])} of shard {key} is cut short")
            self.check(key, origin, run, self.buffer[:total])
            have = 0
            i += 1

    def check(self, key: str, origin: Sequence[int], run: list[Chunk], data: np.ndarray) -> None:
        """Check each chunk of ``run``, read into ``data``, and copy it out."""
        if self.blocks and len(run) > 1 and all(c[3] == self.stride for c in run):
            self.check_blocks(key, origin, run, data)
            return
        pos = 0
        for _, at, _, nbytes in run:
            view = data[pos : pos + nbytes]
            pos += nbytes
            payload = view[:-4]
            if crc32c.crc32c(payload) != int.from_bytes(view[-4:], "little"):
                raise Damaged(False, f"inner chunk {_cell(at)} of shard {key} fails its crc32c")
            raw = payload if self.codec is None else self.decode(key, at, payload)
            if len(raw) != self.chunk_bytes:
                raise Damaged(
                    False, f"inner chunk {_cell(at)} of shard {key} holds {len(raw)} bytes, not {self.chunk_bytes}"
                )
            self.place(origin, at, raw.view(self.out.dtype))

    def decode(self, key: str, at: Sequence[int], payload: np.ndarray) -> np.ndarray:
        """Decompress one inner chunk into the reused buffer, after its header says it decodes
        to exactly the inner chunk's bytes: a chunk that would inflate further is refused
        before any memory is taken for it."""
        declared = declared_size(self.meta.compression, payload)
        if declared != self.chunk_bytes:
            raise Damaged(
                False,
                f"inner chunk {_cell(at)} of shard {key} declares {declared} decoded bytes, not {self.chunk_bytes}",
            )
        if len(self.decoded) != self.chunk_bytes:
            self.decoded = np.empty(self.chunk_bytes, np.uint8)
        try:
            self.codec.decode(payload, out=self.decoded)
        except (RuntimeError, ValueError) as err:  # numcodecs reports corrupt input so
            raise Damaged(False, f"inner chunk {_cell(at)} of shard {key} fails to decode ({err})") from None
        return self.decoded

    def check_blocks(self, key: str, origin: Sequence[int], run: list[Chunk], data: np.ndarray) -> None:
        """``check`` of a run of uncompressed, whole-sized chunks: every checksum first, then each
        block of chunks whole inside the box (whole rows of chunks, several rows where they follow
        one another) placed with one strided copy; the others one by one. One NumPy call per
        block instead of one per chunk: a warm load is bound by these calls, not by the bytes."""
        stride = self.stride
        bad = self.failing(data, len(run))
        if bad is not None:
            raise Damaged(False, f"inner chunk {_cell(run[bad][1])} of shard {key} fails its crc32c")
        lo, hi = self.whole_span(origin)
        k = 0
        while k < len(run):
            rows, cols = _block(run, k, lo, hi)
            if rows * cols == 1:
                chunk = data[k * stride : k * stride + self.chunk_bytes].view(self.out.dtype)
                self.place(origin, run[k][1], chunk)
            else:
                self.place_block(origin, run[k][1], rows, cols, data[k * stride :])
            k += rows * cols

    def whole_span(self, origin: Sequence[int]) -> tuple[list[int], list[int]]:
        """Per dimension, the inner chunk positions ``[lo, hi)`` of the shard at ``origin`` whose
        chunks lie whole inside the box (and the array)."""
        lo, hi = [], []
        for (a, b), o, c, n in zip(self.box, origin, self.inner, self.meta.shape):
            lo.append(max(0, -(-(a - o) // c)))
            hi.append((min(b, n) - o) // c)
        return lo, hi

    def place_block(self, origin: Sequence[int], at: Sequence[int], rows: int, cols: int, data: np.ndarray) -> None:
        """Copy ``rows`` x ``cols`` whole chunks, from ``at`` on along the last two dimensions
        (along the last alone for a 1-D array), stored one after the other in ``data`` in C order
        (each followed by its 4-byte checksum), into the box."""
        inner = self.inner
        nd = len(inner)
        stride = self.stride
        # (rows, cols, *inner) over the chunks' payloads, skipping each checksum (unaligned where
        # the checksums shift the items: NumPy copies those too)
        src = np.ndarray((rows, cols, *inner), self.items.dtype, data, 0, (cols * stride, stride, *self.chunk_strides))
        dst = []
        for (a, _), o, i, c in zip(self.box, origin, at, inner):
            start = o + i * c - a
            dst.append(slice(start, start + c))
        dst[-1] = slice(dst[-1].start, dst[-1].start + cols * inner[-1])
        if nd > 1:
            dst[-2] = slice(dst[-2].start, dst[-2].start + rows * inner[-2])
        target = self.items[tuple(dst)]
        # The destination cut into the chunks: (*inner[:-2], rows, inner[-2], cols, inner[-1]),
        # a view, since it only splits axes; a 1-D destination is (1, cols, inner[0]).
        if nd == 1:
            shape, order = (1, cols, inner[0]), (0, 1, 2)
        else:
            shape = (*inner[:-2], rows, inner[-2], cols, inner[-1])
            order = (*range(2, nd), 0, nd, 1, nd + 1)
        target.reshape(shape, copy=False)[...] = src.transpose(order)

    def place(self, origin: Sequence[int], at: Sequence[int], chunk: np.ndarray | None) -> None:
        """Copy the part of inner chunk ``at`` (of the shard at ``origin``) inside the box to the
        destination; ``None`` places the fill value (zero)."""
        dst, src = [], []
        for (a, b), o, i, c, n in zip(self.box, origin, at, self.inner, self.meta.shape):
            start = o + i * c
            lo, hi = max(start, a), min(start + c, n, b)
            dst.append(slice(lo - a, hi - a))
            src.append(slice(lo - start, hi - start))
        self.out[tuple(dst)] = 0 if chunk is None else chunk.reshape(self.inner)[tuple(src)]


def _adjacent(runs: list[list[Chunk]], sizes: list[int], i: int, limit: int) -> tuple[int, int]:
    """``(j, total)``: runs ``i`` to ``j - 1`` lie one after the other in the file and hold
    ``total`` bytes, at most ``limit`` unless run ``i`` alone is larger."""
    j, total = i + 1, sizes[i]
    while j < len(runs) and total + sizes[j] <= limit and runs[j][0][2] == runs[j - 1][-1][2] + runs[j - 1][-1][3]:
        total += sizes[j]
        j += 1
    return j, total


def _slab_cells(at: Sequence[int], rows: int, cols: int) -> list[tuple[int, ...]]:
    """The cells of the ``rows`` x ``cols`` chunks from ``at`` on, in C order (``cols`` alone
    for a 1-D array)."""
    if len(at) == 1:
        return [(at[0] + c,) for c in range(cols)]
    lead = tuple(at[:-2])
    return [(*lead, at[-2] + r, at[-1] + c) for r in range(rows) for c in range(cols)]


def _block(run: list[Chunk], k: int, lo: list[int], hi: list[int]) -> tuple[int, int]:
    """``(rows, cols)``: the chunks of ``run`` from ``k`` on that form one block whole inside the
    box: ``cols`` side by side along the last dimension, then as many rows of them along the one
    before as follow in ``run`` (C order). ``(1, 1)`` where chunk ``k`` is not whole."""
    at = run[k][1]
    if any(not lo[d] <= at[d] < hi[d] for d in range(len(at))):
        return 1, 1
    lead, last = at[:-1], at[-1]
    cols = 1
    while k + cols < len(run) and last + cols < hi[-1] and run[k + cols][1] == (*lead, last + cols):
        cols += 1
    rows = 1
    if len(at) > 1:
        head, row = at[:-2], at[-2]
        while row + rows < hi[-2]:
            first = k + rows * cols
            if first + cols > len(run) or run[first][1] != (*head, row + rows, last):
                break
            if run[first + cols - 1][1] != (*head, row + rows, last + cols - 1):
                break
            rows += 1
    return rows, cols


_scratch_local = threading.local()
# A reader thread keeps its run buffer from one ``read_box`` to the next up to this size: a
# buffer made afresh for every box pays page faults on every run it reads into.
_SCRATCH_KEEP = 8 << 20


_EMPTY = np.empty(0, np.uint8)


class _Geometry(NamedTuple):
    """A shard of shape ``shard`` cut into inner chunks of shape ``inner``, of items of one size."""

    inner: tuple[int, ...]
    grid: tuple[int, ...]  # the shard's inner grid
    steps: tuple[int, ...]  # a chunk's index step along each dimension (C order)
    count: int  # its chunks
    chunk_bytes: int
    chunk_strides: tuple[int, ...]  # the byte strides of a chunk's items (C order)
    span: tuple[int, ...]  # the shard's extent padded to whole chunks


# The layers of a model repeat a few shapes, so a load works each out once.
@functools.lru_cache(maxsize=1024)
def _shard_geometry(shard: tuple[int, ...], inner: tuple[int, ...], itemsize: int) -> _Geometry:
    grid = tuple(-(-s // c) for s, c in zip(shard, inner))
    steps = tuple(math.prod(grid[d + 1 :]) for d in range(len(grid)))
    strides = tuple(itemsize * math.prod(inner[d + 1 :]) for d in range(len(inner)))
    span = tuple(g * c for g, c in zip(grid, inner))
    return _Geometry(inner, grid, steps, math.prod(grid), itemsize * math.prod(inner), strides, span)


@functools.lru_cache(maxsize=64)
def _void(itemsize: int) -> np.dtype:
    return np.dtype(f"V{itemsize}")


@functools.lru_cache(maxsize=256)
def _in_order_table(count: int, stride: int) -> bytes:
    """The index (with its crc32c) of a shard whose ``count`` uncompressed chunks of ``stride``
    bytes each (checksum included) lie one after the other from its first byte."""
    entries = np.empty(2 * count, "<u8")
    entries[0::2] = stride * np.arange(count, dtype=np.uint64)
    entries[1::2] = stride
    raw = entries.tobytes()
    return raw + crc32c.crc32c(raw).to_bytes(4, "little")


_intact_lock = threading.Lock()
_intact: dict[int, list[int]] = {}  # stride -> the crc32c of 0, 1, 2, ... intact chunks


def _intact_crc(stride: int, count: int) -> int:
    """The crc32c of ``count`` uncompressed chunks of ``stride`` bytes laid end to end, each
    followed by its own crc32c, all intact: the same whatever they hold. A chunk followed by
    its crc32c has the CRC's constant residue as its crc32c, and the crc32c of a concatenation
    depends only on the crc32c and the length of each part. An error confined to one chunk
    changes the crc32c of the whole exactly when it changes that chunk's; a read that finds
    another value checks the chunks one by one to name the damaged one
    (docs/design/inplace-direct-reads.md)."""
    known = _intact.setdefault(stride, [0])
    if len(known) <= count:
        with _intact_lock:
            payload = bytes(stride - 4)
            piece = payload + crc32c.crc32c(payload).to_bytes(4, "little")
            while len(known) <= count:
                known.append(crc32c.crc32c(piece, known[-1]))
    return known[count]


def _scratch(nbytes: int) -> np.ndarray:
    """A byte buffer of at least ``nbytes``, this thread's own, reused across calls."""
    buf = getattr(_scratch_local, "buffer", None)
    if buf is not None and len(buf) >= nbytes:
        return buf
    buf = np.empty(nbytes, np.uint8)
    if nbytes <= _SCRATCH_KEEP:
        _scratch_local.buffer = buf
    return buf


def check_binding(meta: ArrayMeta, key: str, cell: Sequence[int], tail: bytes) -> None:
    """Where ``meta`` is bound to a save, the shard's ``tail`` (its last bytes: the binding block,
    then the index) must begin with the block that binds it to that save, the array's path and
    ``cell``."""
    if meta.bound_to is None:
        return
    found = bytes(tail[:BINDING_BYTES])
    if found != binding(meta.bound_to, meta.path, cell):
        table = tail[BINDING_BYTES:]
        if crc32c.crc32c(table[:-4]) != int.from_bytes(table[-4:], "little"):
            # The end of the file is not a shard's: cut short or overwritten, not moved.
            raise Damaged(False, f"shard {key} is cut short or damaged: its index fails its crc32c")
        named = found.startswith(BINDING_MAGIC)
        why = "its binding block names another save, array or cell" if named else "it holds no binding block"
        raise Damaged(False, misplaced(key, why))


def misplaced(key: str, why: str) -> str:
    """What ``Damaged`` says of a shard that is not bound to where it is read."""
    return f"shard {key} belongs to another place: {why} (moved, or copied from another checkpoint)"


def checked_index(table: bytes, table_bytes: int, key: str, end: int) -> tuple[np.ndarray, np.ndarray]:
    """The (offsets, lengths) of a shard's index ``table``, checked: its crc32c, and every stored
    chunk in bytes ``[0, end)`` of the shard, overlapping no other; ``Damaged`` if not."""
    if len(table) != table_bytes or crc32c.crc32c(table[:-4]) != int.from_bytes(table[-4:], "little"):
        raise Damaged(False, f"the index of shard {key} fails its crc32c")
    entries = np.frombuffer(table, "<u8", count=(table_bytes - 4) // 8)
    offsets, lengths = entries[0::2], entries[1::2]
    problem = _index_problem(offsets, lengths, end)
    if problem:
        raise Damaged(False, f"the index of shard {key} is invalid: {problem}")
    return offsets, lengths


def _index_problem(offsets: np.ndarray, lengths: np.ndarray, end: int) -> str | None:
    """What is wrong with a shard index whose chunks must lie in bytes ``[0, end)`` of the file,
    or None: an entry half absent, a chunk shorter than its checksum, past ``end``, or overlapping
    another (a crafted index could otherwise make two cells read the same bytes)."""
    if len(offsets) <= 16:  # a few entries: checked in Python, without NumPy's per-call cost
        return _small_index_problem(offsets.tolist(), lengths.tolist(), end)
    absent = offsets == ABSENT
    if not np.array_equal(absent, lengths == ABSENT):
        return "an entry has only one of its offset and length marked absent"
    if absent.all():
        return None
    o, n = offsets[~absent], lengths[~absent]
    # ``o <= end`` first, so that ``end - o`` cannot wrap around.
    if (n < 4).any() or (o > end).any() or (n > end - np.minimum(o, end)).any():
        return "an inner chunk lies outside the file's data or is shorter than its checksum"
    if len(o) > 1:
        order = np.argsort(o, kind="stable")
        if (o[order[:-1]] + n[order[:-1]] > o[order[1:]]).any():
            return "two inner chunks overlap"
    return None


def _small_index_problem(offsets: list[int], lengths: list[int], end: int) -> str | None:
    """``_index_problem`` of a short index."""
    spans = []
    for o, n in zip(offsets, lengths):
        if (o == ABSENT) != (n == ABSENT):
            return "an entry has only one of its offset and length marked absent"
        if o == ABSENT:
            continue
        if n < 4 or o + n > end:
            return "an inner chunk lies outside the file's data or is shorter than its checksum"
        spans.append((o, n))
    spans.sort()
    if any(a + n > b for (a, n), (b, _) in itertools.pairwise(spans)):
        return "two inner chunks overlap"
    return None


def _cell(at: Sequence[int]) -> str:
    """An inner chunk's position in its shard's grid, written as TensorStore writes it."""
    return "{" + ", ".join(map(str, at)) + "}"


def read_ahead(
    fd: int,
    key: str,
    runs: list[list[Chunk]],
    sizes: list[int],
    depth: int,
    check: Callable[[list[Chunk], np.ndarray], None],
) -> None:
    """Read one shard's ``runs`` (of ``sizes`` bytes) in file order on a thread that keeps up to
    ``depth`` runs ahead of ``check``, which runs on this one."""
    free: queue.SimpleQueue[np.ndarray | None] = queue.SimpleQueue()
    done: queue.SimpleQueue[tuple[list[Chunk], np.ndarray, int] | BaseException] = queue.SimpleQueue()
    for _ in range(min(depth, len(runs))):
        free.put(np.empty(max(sizes), np.uint8))
    stop = threading.Event()

    def reads() -> None:
        try:
            for run, total in zip(runs, sizes):
                buffer = free.get()
                if buffer is None or stop.is_set():  # the checks failed
                    return
                if os.preadv(fd, [buffer[:total]], run[0][2]) != total:
                    raise Damaged(False, f"inner chunk {_cell(run[0][1])} of shard {key} is cut short")
                done.put((run, buffer, total))
        except BaseException as err:  # noqa: BLE001 - raised on the checking thread
            done.put(err)

    reader = threading.Thread(target=reads, name="layoutckpt-read-ahead", daemon=True)
    reader.start()
    try:
        for _ in runs:
            item = done.get()
            if isinstance(item, BaseException):
                raise item
            run, buffer, total = item
            check(run, buffer[:total])
            free.put(buffer)
    finally:
        stop.set()
        free.put(None)
        reader.join()  # before the caller closes ``fd``
