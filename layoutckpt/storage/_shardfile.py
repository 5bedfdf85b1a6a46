"""Shard files (``docs/format.md`` section 5.4) written on a local file system, without TensorStore.

``write_shard`` (or ``ShardFiles.write``, for many shards with one ``IOConfig``) writes one shard
as a stream, a few inner chunks at a time; ``DataFile`` appends many shards to one file (a
packed checkpoint's). Two writers use it:

- ``save``, with the shard in memory: TensorStore would copy each inner chunk into a fresh
  buffer, assemble the shard in memory and write it through a lock file and a rename. Here a
  chunk that is contiguous in the source goes from the tensor's own memory to the file, and the
  others are gathered, a few at a time, by one NumPy copy into a small reused buffer; each group
  goes out in one ``writev`` with the chunks' checksums between them. A large shard goes past
  the page cache instead (``_Direct``): its chunks are copied (gathered, where they cut the
  last dimension) straight into reused aligned buffers, each checksum taken there, and each
  buffer is written by a thread while the next fills.
- ``import_safetensors``, which reads its source piece by piece: TensorStore stores a shard as
  one value, so every partial write would re-read and rewrite the whole shard.

Either way chunks are read, encoded, appended and dropped, and the index follows (after the
binding block of a bound array), so memory stays at one group of chunks whatever the shard size.

The buffer pools here (``_scratch``, ``_aligned``) are process-wide caches, not settings: any
size works, and a reused buffer is one whose pages are already mapped, where a fresh one of this
size faults on every page at first touch.
"""

from __future__ import annotations

import itertools
import math
import os
import struct
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

import crc32c
import numpy as np

from ..base._options import DEFAULT_IO, IOConfig
from ..format._shard import ABSENT, binding, codec_for, inner_boxes, inner_count
from ..layout._plan import Box, box_view
from . import _os

if TYPE_CHECKING:
    from ..format._format import ArrayMeta

# What a shard is written from: its part of the array (clipped at the array's edge), or a
# function ``read(box)`` that gives the elements of any box of the array.
ShardSource = np.ndarray | Callable[[Box], np.ndarray]


class ShardFiles:
    """Writes shard files under the local directory ``root`` as ``io`` says; the threads that
    wait on its ``O_DIRECT`` writes are made on first need and stop at ``close``."""

    def __init__(self, root: Path, io: IOConfig = DEFAULT_IO) -> None:
        self.root = root
        self.io = io
        self._lock = threading.Lock()
        self._direct_threads: ThreadPoolExecutor | None = None

    def __enter__(self) -> ShardFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            threads, self._direct_threads = self._direct_threads, None
        if threads is not None:
            threads.shutdown(wait=True)

    def _threads(self) -> ThreadPoolExecutor:
        # Two per shard writer: each writer's next buffer is written while it fills the other.
        # They wait on the device, not the CPU.
        with self._lock:
            if self._direct_threads is None:
                self._direct_threads = ThreadPoolExecutor(2 * self.io.threads, thread_name_prefix="layoutckpt-direct")
            return self._direct_threads

    def write(
        self,
        meta: ArrayMeta,
        cell: Sequence[int],
        dtype: np.dtype,
        source: ShardSource,
        *,
        start_writeback: bool = False,
    ) -> int:
        """Write the shard at grid ``cell`` of the array ``meta`` from ``source`` (as ``dtype``);
        returns the bytes written.

        A chunk that reaches past the array's edge is stored whole, padded with the fill value
        (zero bits, ``False`` for bool); chunks wholly outside the array are absent from the
        index. With ``start_writeback`` the kernel is asked to start writing the file to storage
        as soon as it is closed (``_os.start_writeback``). With ``io.direct_io`` an uncompressed
        shard of at least ``io.direct_bytes`` held in memory bypasses the page cache
        (``_Direct``), where the file system allows it.
        """
        held = isinstance(source, np.ndarray)
        # Only a shard whose every byte is at hand goes past the page cache; the others never
        # ask the kernel (no fcntl per small file).
        direct = self.io.direct_io and held and source.nbytes >= self.io.direct_bytes and meta.compression is None
        fd = _os.create_file(self.root / meta.path / meta.chunk_key(cell), direct=direct)
        sink: _Sink = _Buffered(fd)
        try:
            if direct and _os.is_direct(fd):
                sink = _Direct(fd, self._threads(), self.io.direct_bytes)
            written = encode(sink, meta, cell, dtype, source, self.io.group_bytes)
            sink.finish()
            if start_writeback and isinstance(sink, _Buffered):
                _os.start_writeback(fd)
        finally:
            sink.release()
            os.close(fd)
        return written


class DataFile:
    """One file that whole shards and other values are appended to, one after another (a packed
    checkpoint's data file). On a local disk (``on_disk``) a stream of ``io.direct_bytes``
    blocks past the page cache where the file system allows it (``_Direct``), through it where
    not; elsewhere collected in memory (``in_memory``) for one object. Not thread-safe: a writer
    thread appends to a file of its own, so the values need no alignment between them."""

    def __init__(self, rel: str, sink: _Sink, fd: int, group_bytes: int) -> None:
        self.rel = rel
        self.size = 0
        self._sink = sink
        self._fd = fd
        self._group_bytes = group_bytes

    @classmethod
    def on_disk(cls, files: ShardFiles, rel: str) -> DataFile:
        fd = _os.create_file(files.root / rel, direct=files.io.direct_io)
        direct = _os.is_direct(fd)
        sink = _Direct(fd, files._threads(), files.io.direct_bytes) if direct else _Buffered(fd)
        return cls(rel, sink, fd, files.io.group_bytes)

    @classmethod
    def in_memory(cls, rel: str, io: IOConfig) -> DataFile:
        return cls(rel, _Collect(), -1, io.group_bytes)

    def shard(self, meta: ArrayMeta, cell: Sequence[int], dtype: np.dtype, source: ShardSource) -> tuple[int, int]:
        """Append the shard at ``cell`` as ``ShardFiles.write`` writes it; its offset and length."""
        at = self.size
        self.size += encode(self._sink, meta, cell, dtype, source, self._group_bytes)
        return at, self.size - at

    def value(self, data: bytes) -> int:
        """Append ``data``; its offset."""
        at = self.size
        self._sink.write([data], len(data))
        self.size += len(data)
        return at

    def close(self, *, finish: bool = True) -> bytearray | None:
        """Complete the file (with ``finish``) and close it: on disk the kernel starts writing
        what went through the page cache at once; in memory, the bytes, to be stored."""
        sink, self._sink = self._sink, _Sink()
        try:
            if finish:
                sink.finish()
                if isinstance(sink, _Buffered):
                    _os.start_writeback(self._fd)
        finally:
            sink.release()
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
        return sink.value if finish and isinstance(sink, _Collect) else None


def encode(
    sink: _Sink, meta: ArrayMeta, cell: Sequence[int], dtype: np.dtype, source: ShardSource, group_bytes: int
) -> int:
    """Append the shard at grid ``cell`` of the array ``meta`` to ``sink``: its inner chunks,
    each followed by its crc32c, the binding block where ``meta`` is bound to a save, then the
    index; returns the bytes appended."""
    inner = tuple(meta.inner_chunk_shape)
    if (
        isinstance(source, np.ndarray)
        and source.shape == tuple(meta.shard_shape)
        and source.size > 0
        and meta.compression is None
    ):
        index = _write_blocks(sink, source, inner, group_bytes)
    else:
        read = source if callable(source) else _reader(source, meta.shard_shape, cell)
        index = _write_chunks(sink, meta, cell, dtype, read)
    table = index.tobytes()
    # After the chunks, so that their offsets are the same bound or not; before the index, which
    # Zarr readers find at the end: they never look at the block.
    block = binding(meta.bound_to, meta.path, cell) if meta.bound_to is not None else b""
    sink.write([block, table, crc32c.crc32c(table).to_bytes(4, "little")])
    return int(index[:, 1][index[:, 1] != ABSENT].sum()) + len(block) + len(table) + 4


def shard_value(
    meta: ArrayMeta, cell: Sequence[int], dtype: np.dtype, source: ShardSource, group_bytes: int
) -> bytearray:
    """The bytes of the shard at grid ``cell`` of the array ``meta``, as ``ShardFiles`` writes
    them to a file: one object's value for a key-value store."""
    sink = _Collect()
    encode(sink, meta, cell, dtype, source, group_bytes)
    return sink.value


def write_shard(
    root: Path,
    meta: ArrayMeta,
    cell: Sequence[int],
    dtype: np.dtype,
    source: ShardSource,
    *,
    io: IOConfig = DEFAULT_IO,
    start_writeback: bool = False,
) -> int:
    """``ShardFiles(root, io).write(...)`` of one shard; the bytes written."""
    with ShardFiles(root, io) as files:
        return files.write(meta, cell, dtype, source, start_writeback=start_writeback)


def _reader(data: np.ndarray, shard_shape: Sequence[int], cell: Sequence[int]) -> Callable[[Box], np.ndarray]:
    """``read(box)`` over a shard held as an array (``data[0, ...]`` at the shard's origin)."""
    origin = [c * s for c, s in zip(cell, shard_shape)]
    return lambda box: box_view(data, box, origin)


def _write_chunks(
    sink: _Sink, meta: ArrayMeta, cell: Sequence[int], dtype: np.dtype, read: Callable[[Box], np.ndarray]
) -> np.ndarray:
    """Append the inner chunks of shard ``cell`` to ``sink`` one at a time, encoded and padded at
    the array's edge as need be; returns the shard index."""
    codec = codec_for(meta.compression, dtype.itemsize)
    inner = tuple(meta.inner_chunk_shape)
    index = np.full((inner_count(meta.shard_shape, inner), 2), ABSENT, dtype="<u8")
    scratch: np.ndarray | None = None  # one gather buffer per shard, not one per chunk
    offset = 0
    for i, box in enumerate(inner_boxes(meta.shape, meta.shard_shape, inner, cell)):
        if box is None:
            continue
        data = read(box)
        if data.shape == inner and data.flags.c_contiguous:
            chunk = data  # written from the source's own memory
        else:
            if scratch is None:
                scratch = np.empty(inner, dtype)
            if data.shape != inner:
                scratch.fill(0)
            scratch[tuple(slice(0, n) for n in data.shape)] = data
            chunk = scratch
        raw = chunk.reshape(-1).view(np.uint8)
        encoded = raw if codec is None else codec.encode(raw)
        sink.write([encoded, crc32c.crc32c(encoded).to_bytes(4, "little")])
        nbytes = len(encoded) + 4
        index[i] = (offset, nbytes)
        offset += nbytes
    return index


# A writev takes at most 1024 buffers (IOV_MAX), two per chunk.
_MAX_GROUP = 511

_scratch_lock = threading.Lock()
_scratch: list[np.ndarray] = []  # gather buffers of a group's bytes, reused across shards and saves


def _write_blocks(sink: _Sink, data: np.ndarray, inner: tuple[int, ...], group_bytes: int) -> np.ndarray:
    """Append every inner chunk of the uncompressed shard ``data`` (the whole shard, inside the
    array) to ``sink`` in C order, each followed by its crc32c; returns the shard index.

    Chunks that are contiguous in ``data`` are written from its memory. The others are
    gathered along the last dimension of the chunk grid, up to ``group_bytes`` at a time, by one
    NumPy copy from a view that puts each chunk's elements together."""
    itemsize = data.dtype.itemsize
    chunk_bytes = itemsize * math.prod(inner)
    grid = [s // c for s, c in zip(data.shape, inner)]
    count = math.prod(grid)
    index = np.empty((count, 2), dtype="<u8")
    index[:, 0] = np.arange(count, dtype="<u8") * (chunk_bytes + 4)
    index[:, 1] = chunk_bytes + 4
    # A chunk is contiguous in a C-ordered shard when the dimensions after the last one the
    # grid cuts are whole and those before it are one element thick.
    cut = [d for d, g in enumerate(grid) if g > 1]
    if data.flags.c_contiguous and (not cut or all(inner[d] == 1 for d in range(cut[-1]))):
        flat = data.reshape(-1).view(np.uint8)
        per = max(1, min(_MAX_GROUP, (4 * group_bytes) // max(chunk_bytes, 1)))
        chunks = flat.reshape(count, chunk_bytes)
        _append(
            sink,
            chunks,
            chunk_bytes,
            per,
            lambda first, n: _write_group(sink, flat, first * chunk_bytes, n, chunk_bytes),
        )
        return index
    per = max(1, min(grid[-1], _MAX_GROUP, group_bytes // chunk_bytes))
    # (g0*c0, ..., gk*ck) -> (g0, ..., gk, c0, ..., ck): one view in which chunk (i0, ..., ik) is
    # blocks[i0, ..., ik], so a group is one slice of it and one copy.
    rank = len(inner)
    split = data.reshape([n for g, c in zip(grid, inner) for n in (g, c)])
    blocks = split.transpose([*range(0, 2 * rank, 2), *range(1, 2 * rank, 2)])
    scratch = _take_scratch(per * chunk_bytes, group_bytes)
    try:
        dst_all = scratch[: per * chunk_bytes].view(data.dtype).reshape(per, *inner)
        for at in itertools.product(*(range(g) for g in grid[:-1])):
            row = blocks[at]

            def gathered(first: int, n: int, row: np.ndarray = row) -> None:
                np.copyto(dst_all[:n], row[first : first + n])
                _write_group(sink, scratch, 0, n, chunk_bytes)

            _append(sink, row, chunk_bytes, per, gathered)
    finally:
        _give_scratch(scratch, group_bytes)
    return index


def _append(sink: _Sink, chunks: np.ndarray, chunk_bytes: int, per: int, through: Callable[[int, int], None]) -> None:
    """Append ``chunks`` (chunk-major: ``chunks[i]`` is one chunk), each followed by its crc32c:
    copied straight into the sink's ``O_DIRECT`` block where they fit (``_place``); otherwise
    ``per`` at a time, or the one chunk that straddles two blocks, by ``through(first, n)``."""
    first = 0
    while first < len(chunks):
        n = min(per, len(chunks) - first)
        placed = _place(sink, chunks[first : first + n], chunk_bytes)
        if not placed:
            n = 1 if isinstance(sink, _Direct) else n
            through(first, n)
        first += placed or n


def _place(sink: _Sink, chunks: np.ndarray, chunk_bytes: int) -> int:
    """Copy as many of ``chunks`` as fit into the sink's current block, each followed by its
    crc32c taken there; how many it placed (none where the sink is no ``O_DIRECT`` one).

    An ``O_DIRECT`` block is a copy of the bytes anyway: a chunk that cuts the last dimension
    is gathered straight into it, not through the scratch buffer first (one pass less over
    every byte of such a save), and the checksum reads the bytes while they are in cache.
    """
    if not isinstance(sink, _Direct):
        return 0
    stride = chunk_bytes + 4
    n = min(len(chunks), sink.room() // stride)
    if n == 0:
        return 0
    chunks, region = chunks[:n], sink.claim(n * stride)
    # Each chunk in C order at its place in the block; the block's offset and the 4-byte
    # checksums leave the elements unaligned for wider types, which NumPy copies all the same.
    strides = (stride, *_c_strides(chunks.shape[1:], chunks.itemsize))
    np.copyto(np.ndarray(chunks.shape, chunks.dtype, region, 0, strides), chunks)
    for at in range(0, n * stride, stride):
        struct.pack_into("<I", region, at + chunk_bytes, crc32c.crc32c(region[at : at + chunk_bytes]))
    sink.advance(n * stride)
    return n


def _c_strides(shape: Sequence[int], itemsize: int) -> tuple[int, ...]:
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _write_group(sink: _Sink, buffer: np.ndarray, start: int, n: int, chunk_bytes: int) -> None:
    """One ``writev`` of the ``n`` chunks of ``chunk_bytes`` from byte ``start`` of ``buffer``
    (a byte array), each followed by its crc32c."""
    parts: list[Any] = []
    for at in range(start, start + n * chunk_bytes, chunk_bytes):
        chunk = buffer[at : at + chunk_bytes]
        parts += (chunk, crc32c.crc32c(chunk).to_bytes(4, "little"))
    sink.write(parts, n * (chunk_bytes + 4))


def _take_scratch(nbytes: int, group_bytes: int) -> np.ndarray:
    """A gather buffer of at least ``nbytes``, reused where one is free."""
    with _scratch_lock:
        if _scratch and len(_scratch[-1]) >= nbytes:
            return _scratch.pop()
    return np.empty(max(nbytes, group_bytes), np.uint8)


def _give_scratch(buffer: np.ndarray, group_bytes: int) -> None:
    """Keep ``buffer`` for the next shard, unless it was made for one chunk larger than a group."""
    if len(buffer) == group_bytes:
        with _scratch_lock:
            _scratch.append(buffer)


class _Sink:
    """Where ``write_shard`` appends a shard's bytes: ``write`` takes byte buffers (``total``,
    their byte count where the caller knows it), ``finish`` completes the file, ``release``
    gives back what the sink holds, whether or not the file was finished."""

    def write(self, parts: list[Any], total: int | None = None) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        pass

    def release(self) -> None:
        pass


class _Buffered(_Sink):
    """Through the page cache: each ``write`` is one ``writev``."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def write(self, parts: list[Any], total: int | None = None) -> None:
        _os.write_all(self.fd, parts, total)


class _Collect(_Sink):
    """Into memory: each part is copied at once (a group's gather buffer is reused for the next)."""

    def __init__(self) -> None:
        self.value = bytearray()

    def write(self, parts: list[Any], total: int | None = None) -> None:
        for part in parts:
            self.value += memoryview(part)  # as bytes, whatever the part's element type


_aligned_lock = threading.Lock()
_aligned: list[np.ndarray] = []  # page-aligned buffers for O_DIRECT writes, reused across shards


class _Direct(_Sink):
    """Past the page cache (a file opened with ``O_DIRECT``): bytes are gathered into
    page-aligned buffers of ``block_bytes``, and each full one is written by one of ``threads``
    while the caller fills the other; the last block is padded with zeros and the file cut back
    to its length.

    Through the page cache every written page is a page the kernel allocates, tracks while
    dirty and writes back later; where it has to get those pages from a VM's host first, that
    costs more than the device's write (docs/performance.md). The copy into the buffer replaces
    the kernel's copy into the page cache, so the bytes are copied as often as before, and a
    checkpoint no one reads soon does not push out of the page cache what training reads.
    """

    def __init__(self, fd: int, threads: ThreadPoolExecutor, block_bytes: int) -> None:
        self.fd = fd
        self.threads = threads
        # Whole aligned blocks, whatever ``IOConfig.direct_bytes`` says: every write but the
        # last then starts and ends on the alignment O_DIRECT asks for.
        block_bytes = -(-block_bytes // _os.DIRECT_ALIGN) * _os.DIRECT_ALIGN
        self.buffers = [_take_aligned(block_bytes), _take_aligned(block_bytes)]
        self.pending: list[Future[None] | None] = [None, None]
        self.current = 0
        self.fill = 0
        self.offset = 0
        self.written = 0  # the end of the last write, its padding included

    def write(self, parts: list[Any], total: int | None = None) -> None:
        for part in parts:
            src = np.frombuffer(part, np.uint8)
            at = 0
            while at < len(src):
                buffer = self.buffers[self.current]
                n = min(len(src) - at, len(buffer) - self.fill)
                buffer[self.fill : self.fill + n] = src[at : at + n]
                self.fill += n
                at += n
                if self.fill == len(buffer):
                    self._submit()

    def room(self) -> int:
        """Bytes left in the block being filled."""
        return len(self.buffers[self.current]) - self.fill

    def claim(self, nbytes: int) -> np.ndarray:
        """The next ``nbytes`` (at most ``room()``) of the block, for the caller to fill before
        ``advance(nbytes)``."""
        return self.buffers[self.current][self.fill : self.fill + nbytes]

    def advance(self, nbytes: int) -> None:
        """Count ``nbytes`` filled in place after ``claim``; a full block goes out."""
        self.fill += nbytes
        if self.fill == len(self.buffers[self.current]):
            self._submit()

    def _submit(self) -> None:
        buffer = self.buffers[self.current]
        whole = -(-self.fill // _os.DIRECT_ALIGN) * _os.DIRECT_ALIGN
        buffer[self.fill : whole] = 0
        self.pending[self.current] = self.threads.submit(_os.write_direct, self.fd, buffer[:whole], self.offset)
        self.written = self.offset + whole
        self.offset += self.fill
        self.fill = 0
        self.current ^= 1
        waiting = self.pending[self.current]
        if waiting is not None:  # the next buffer is free once its write is done
            self.pending[self.current] = None
            waiting.result()

    def finish(self) -> None:
        if self.fill:
            self._submit()
        for i, waiting in enumerate(self.pending):
            if waiting is not None:
                self.pending[i] = None
                waiting.result()
        if self.written > self.offset:  # the last block's padding
            os.ftruncate(self.fd, self.offset)

    def release(self) -> None:
        for waiting in self.pending:
            if waiting is not None:
                futures_wait([waiting])  # its error, if any, is already being raised
        with _aligned_lock:
            _aligned.extend(self.buffers)
        self.buffers = []


def _take_aligned(nbytes: int) -> np.ndarray:
    """A page-aligned buffer of ``nbytes``, reused when one of that size is free."""
    with _aligned_lock:
        for i in range(len(_aligned) - 1, -1, -1):
            if len(_aligned[i]) == nbytes:
                return _aligned.pop(i)
    return _os.aligned_buffer(nbytes)
