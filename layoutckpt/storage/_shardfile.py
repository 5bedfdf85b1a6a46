"""Shard files (``docs/format.md`` section 5.4) on a local file system, without TensorStore.

``read_box`` reads a box of an array: the index of each shard it touches, then only the inner
chunks it needs, each checked and copied into the result (loads on local disks use it).

``write_shard`` writes one shard as a stream, a few inner chunks at a time. Two writers use it:

- ``save``, with the shard in memory: TensorStore would copy each inner chunk into a fresh
  buffer, assemble the shard in memory and write it through a lock file and a rename. Here a
  chunk that is contiguous in the source goes from the tensor's own memory to the file, and the
  others are gathered, a few at a time, by one NumPy copy into a small reused buffer; each group
  goes out in one ``writev`` with the chunks' checksums between them. A large shard goes past
  the page cache instead (``_Direct``): copied into reused aligned buffers, written by a thread
  while the next fills.
- ``import_safetensors``, which reads its source piece by piece: TensorStore stores a shard as
  one value, so every partial write re-reads and rewrites the whole shard (measured: a 200 MB
  shard written in 25 MB blocks took 3.5x as long and peaked at 280 MB).

Either way chunks are read, encoded, appended and dropped, and the index follows, so memory
stays at one group of chunks whatever the shard size.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import math
import os
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

import crc32c
import numpy as np

from ..layout._plan import Box

if TYPE_CHECKING:
    from ..format._format import ArrayMeta

_ABSENT = 2**64 - 1


def grid_cells(shape: Sequence[int], chunk: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Every cell of the regular grid of ``chunk`` over ``shape`` that holds an element; a 0-d
    array has one cell, an array with an empty dimension none."""
    return itertools.product(*(range(-(-n // c)) for n, c in zip(shape, chunk)))


def inner_boxes(
    shape: Sequence[int], shard_shape: Sequence[int], inner_shape: Sequence[int], cell: Sequence[int]
) -> Iterator[Box | None]:
    """For each inner chunk of shard ``cell``, in C order, the box of the array it covers (clipped
    at the array's edge), or None where it lies wholly outside the array; ``inner_count`` of them.

    Made one at a time: a list of a shard's thousands of boxes, held while the shard is written,
    would count towards the garbage collector's next collections (``_workers.Workers``)."""
    per_dim = []
    for n, s, c, i in zip(shape, shard_shape, inner_shape, cell):
        starts = range(i * s, (i + 1) * s, c)
        per_dim.append([(start, min(start + c, n)) for start in starts])
    return (box if all(a < b for a, b in box) else None for box in itertools.product(*per_dim))


def inner_count(shard_shape: Sequence[int], inner_shape: Sequence[int]) -> int:
    """The number of inner chunks of a shard, those past the array's edge included."""
    return math.prod(-(-s // c) for s, c in zip(shard_shape, inner_shape))


def _codec(compression: str | None, itemsize: int) -> Any:
    """The numcodecs codec of the compression the array document names (``_format``): its
    ``encode`` writes what TensorStore would, its ``decode`` reads any such chunk."""
    if compression is None:
        return None
    from numcodecs import Blosc, Zstd

    if compression == "zstd":
        return Zstd(level=3, checksum=False)
    if compression == "blosc":
        shuffle = Blosc.SHUFFLE if itemsize > 1 else Blosc.BITSHUFFLE
        return Blosc(cname="zstd", clevel=3, shuffle=shuffle, blocksize=0, typesize=itemsize)
    raise ValueError(f"compression must be None, 'zstd' or 'blosc', got {compression!r}")


def write_shard(
    root: Path,
    meta: ArrayMeta,
    cell: Sequence[int],
    dtype: np.dtype,
    source: np.ndarray | Callable[[Box], np.ndarray],
    *,
    start_writeback: bool = False,
    direct: bool = False,
) -> int:
    """Write the shard at grid ``cell`` of the array ``meta`` under the local directory
    ``root``. ``source`` is the shard's part of the array (clipped at the array's edge), or a
    function ``read(box)`` that gives the elements of a box of the array; either as ``dtype``.
    Returns the bytes written.

    A chunk that reaches past the array's edge is stored whole, padded with the fill value
    (zero bits, ``False`` for bool); chunks wholly outside the array are absent from the index.
    With ``start_writeback`` the kernel is asked to start writing the file to storage as soon
    as it is closed (``_store.start_writeback``). With ``direct`` an uncompressed shard of at
    least ``DIRECT_BYTES`` held in memory bypasses the page cache (``_Direct``), where the file
    system allows it.
    """
    from . import _store  # lazily: it imports TensorStore

    inner = tuple(meta.inner_chunk_shape)
    whole = (
        isinstance(source, np.ndarray)
        and source.shape == tuple(meta.shard_shape)
        and source.size > 0
        and meta.compression is None
    )
    # Only a shard whose every byte is at hand goes past the page cache; the others never ask
    # the kernel (no fcntl per small file).
    direct = direct and isinstance(source, np.ndarray) and source.nbytes >= DIRECT_BYTES and meta.compression is None
    fd = _store.create_file(root / meta.path / meta.chunk_key(cell), direct=direct)
    sink: _Sink = _Direct(fd) if direct and _store.is_direct(fd) else _Buffered(fd)
    try:
        if whole:
            assert isinstance(source, np.ndarray)
            index = _write_blocks(sink, source, inner)
        else:
            read = source if callable(source) else _reader(source, meta.shard_shape, cell)
            index = _write_chunks(sink, meta, cell, dtype, read)
        table = index.tobytes()
        sink.write([table, crc32c.crc32c(table).to_bytes(4, "little")])
        sink.finish()
        if start_writeback and isinstance(sink, _Buffered):
            _store.start_writeback(fd)
    finally:
        sink.release()
        os.close(fd)
    return int(index[:, 1][index[:, 1] != _ABSENT].sum()) + len(table) + 4


def _reader(data: np.ndarray, shard_shape: Sequence[int], cell: Sequence[int]) -> Callable[[Box], np.ndarray]:
    """``read(box)`` over a shard held as an array (``data[0, ...]`` at the shard's origin)."""
    origin = [c * s for c, s in zip(cell, shard_shape)]
    return lambda box: data[tuple(slice(a - o, b - o) for (a, b), o in zip(box, origin))]


def _write_chunks(
    sink: _Sink, meta: ArrayMeta, cell: Sequence[int], dtype: np.dtype, read: Callable[[Box], np.ndarray]
) -> np.ndarray:
    """Append the inner chunks of shard ``cell`` to ``sink`` one at a time, encoded and padded at
    the array's edge as need be; returns the shard index."""
    codec = _codec(meta.compression, dtype.itemsize)
    inner = tuple(meta.inner_chunk_shape)
    index = np.full((inner_count(meta.shard_shape, inner), 2), _ABSENT, dtype="<u8")
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


# Bytes of inner chunks gathered per ``writev``. Small enough that the gather copy, the
# checksum and the kernel's copy into the page cache all find the bytes in the core's L2 cache;
# large enough that the Python work per group is spread over a few chunks. 4 MiB groups took
# 5% less CPU time but 13% more wall time (4 ranks, 2 GB; docs/performance.md).
GROUP_BYTES = 256 << 10
# A writev takes at most 1024 buffers (IOV_MAX), two per chunk.
_MAX_GROUP = 511

_scratch_lock = threading.Lock()
_scratch: list[np.ndarray] = []  # gather buffers of GROUP_BYTES, reused across shards and saves


def _write_blocks(sink: _Sink, data: np.ndarray, inner: tuple[int, ...]) -> np.ndarray:
    """Append every inner chunk of the uncompressed shard ``data`` (the whole shard, inside the
    array) to ``sink`` in C order, each followed by its crc32c; returns the shard index.

    Chunks that are contiguous in ``data`` are written from its memory. The others are
    gathered along the last dimension of the chunk grid, up to ``GROUP_BYTES`` at a time, by one
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
        per = max(1, min(_MAX_GROUP, (4 * GROUP_BYTES) // max(chunk_bytes, 1)))
        for first in range(0, count, per):
            _write_group(sink, flat, first * chunk_bytes, min(per, count - first), chunk_bytes)
        return index
    per = max(1, min(grid[-1], _MAX_GROUP, GROUP_BYTES // chunk_bytes))
    # (g0*c0, ..., gk*ck) -> (g0, ..., gk, c0, ..., ck): one view in which chunk (i0, ..., ik) is
    # blocks[i0, ..., ik], so a group is one slice of it and one copy.
    rank = len(inner)
    split = data.reshape([n for g, c in zip(grid, inner) for n in (g, c)])
    blocks = split.transpose([*range(0, 2 * rank, 2), *range(1, 2 * rank, 2)])
    scratch = _take_scratch(per * chunk_bytes)
    try:
        dst_all = scratch[: per * chunk_bytes].view(data.dtype).reshape(per, *inner)
        for at in itertools.product(*(range(g) for g in grid[:-1])):
            row = blocks[at]
            for first in range(0, grid[-1], per):
                n = min(per, grid[-1] - first)
                np.copyto(dst_all[:n], row[first : first + n])
                _write_group(sink, scratch, 0, n, chunk_bytes)
    finally:
        _give_scratch(scratch)
    return index


def _write_group(sink: _Sink, buffer: np.ndarray, start: int, n: int, chunk_bytes: int) -> None:
    """One ``writev`` of the ``n`` chunks of ``chunk_bytes`` from byte ``start`` of ``buffer``
    (a byte array), each followed by its crc32c."""
    parts: list[Any] = []
    for at in range(start, start + n * chunk_bytes, chunk_bytes):
        chunk = buffer[at : at + chunk_bytes]
        parts += (chunk, crc32c.crc32c(chunk).to_bytes(4, "little"))
    sink.write(parts, n * (chunk_bytes + 4))


def _take_scratch(nbytes: int) -> np.ndarray:
    """A gather buffer of at least ``nbytes``: reused ones are already in memory, where a fresh
    allocation of this size is a fresh mapping whose every page faults on first touch."""
    with _scratch_lock:
        if _scratch and len(_scratch[-1]) >= nbytes:
            return _scratch.pop()
    return np.empty(max(nbytes, GROUP_BYTES), np.uint8)


def _give_scratch(buffer: np.ndarray) -> None:
    """Keep ``buffer`` for the next shard, unless it was made for one chunk larger than a group."""
    if len(buffer) == GROUP_BYTES:
        with _scratch_lock:
            _scratch.append(buffer)


def _write_all(fd: int, parts: list[Any], total: int | None = None) -> None:
    """``writev`` until every byte of ``parts`` (byte buffers) is written: a regular file may
    take fewer. ``total``, their byte count where the caller knows it, spares the common case
    of one complete ``writev`` any work per part."""
    done = os.writev(fd, parts)
    if done == total:
        return
    views = [memoryview(p).cast("B") for p in parts]
    while True:
        while views and done >= len(views[0]):
            done -= len(views.pop(0))
        if not views:
            return
        views[0] = views[0][done:]
        done = os.writev(fd, views)


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
        _write_all(self.fd, parts, total)


# Bytes an O_DIRECT write moves at once: a few MiB keep the device busy (1 GB from one thread:
# 4 MiB writes ran at the disk's peak, as 32 MiB ones did), and a shard smaller than this is
# written through the page cache, where its padded last block and truncation cost more than the
# page cache does.
DIRECT_BYTES = 8 << 20
# Buffer addresses, file offsets and lengths of O_DIRECT writes are multiples of this: the
# logical block size is 512 or 4096 bytes on the devices Linux supports.
_ALIGN = 4096

_aligned_lock = threading.Lock()
_aligned: list[np.ndarray] = []  # page-aligned buffers of DIRECT_BYTES, reused across shards


class _Direct(_Sink):
    """Past the page cache (a file opened with ``O_DIRECT``): bytes are gathered into
    page-aligned buffers of ``DIRECT_BYTES``, and each full one is written by a thread of
    ``_direct_io`` while the caller fills the other; the last block is padded with zeros and
    the file cut back to its length.

    Through the page cache every written page is a page the kernel allocates, tracks while
    dirty and writes back later. Where it has to get those pages from a VM's host first, one
    stream wrote 0.3-0.6 GB/s against 1.7-2.1 GB/s with O_DIRECT; where it has them at hand the
    two are as fast, and this one takes less CPU (docs/performance.md). The copy into the buffer
    replaces the kernel's copy into the page cache, so the bytes are copied as often as before,
    and a checkpoint no one reads soon does not push out of the page cache what training reads.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buffers = [_take_aligned(), _take_aligned()]
        self.pending: list[Future[None] | None] = [None, None]
        self.current = 0
        self.fill = 0
        self.offset = 0

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

    def _submit(self) -> None:
        buffer = self.buffers[self.current]
        whole = -(-self.fill // _ALIGN) * _ALIGN
        buffer[self.fill : whole] = 0
        self.pending[self.current] = _direct_io().submit(_write_direct, self.fd, buffer[:whole], self.offset)
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
        if self.offset % _ALIGN:
            os.ftruncate(self.fd, self.offset)

    def release(self) -> None:
        for waiting in self.pending:
            if waiting is not None:
                futures_wait([waiting])  # its error, if any, is already being raised
        with _aligned_lock:
            _aligned.extend(self.buffers)
        self.buffers = []


def _write_direct(fd: int, buffer: np.ndarray, offset: int) -> None:
    """Write all of ``buffer`` at ``offset`` of the O_DIRECT file ``fd``."""
    try:
        done = os.pwrite(fd, buffer, offset)
    except OSError as err:
        if err.errno != errno.EINVAL:
            raise
        # The file system took O_DIRECT at open but not these writes (its blocks are larger,
        # or it wants no O_DIRECT at all): go on through the page cache.
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        done = os.pwrite(fd, buffer, offset)
    while done < len(buffer):
        more = os.pwrite(fd, buffer[done:], offset + done)
        if more == 0:
            raise OSError(errno.EIO, f"a write at byte {offset + done} of a shard file wrote nothing")
        done += more


_direct_lock = threading.Lock()
_direct_pool: ThreadPoolExecutor | None = None


def _direct_io() -> ThreadPoolExecutor:
    """The threads that wait on O_DIRECT writes: two per shard writer, so each writer's next
    buffer is written while it fills the other. They wait on the device, not the CPU."""
    global _direct_pool
    with _direct_lock:
        if _direct_pool is None:
            _direct_pool = ThreadPoolExecutor(2 * THREADS, thread_name_prefix="layoutckpt-direct")
        return _direct_pool


def _take_aligned() -> np.ndarray:
    """A page-aligned buffer of ``DIRECT_BYTES``, reused when one is free."""
    with _aligned_lock:
        if _aligned:
            return _aligned.pop()
    raw = np.empty(DIRECT_BYTES + _ALIGN, np.uint8)
    skip = -raw.ctypes.data % _ALIGN
    return raw[skip : skip + DIRECT_BYTES]


# Threads that read or write shard files for one save or load: the work is copies, checksums
# and system calls, all outside the GIL, so about one per core; more only contend for them.
THREADS = max(2, min(4, os.cpu_count() or 1))

_read_lock = threading.Lock()
_bytes_read = 0


def _prefetched(
    fd: int,
    key: str,
    runs: list[list[_Chunk]],
    sizes: list[int],
    check: Callable[[list[_Chunk], np.ndarray], None],
) -> None:
    """``read_box``'s reads of one shard's ``runs`` (of ``sizes`` bytes) on a thread that keeps
    up to ``PREFETCH_DEPTH`` runs ahead of ``check``, which runs on this one."""
    free: queue.SimpleQueue[np.ndarray | None] = queue.SimpleQueue()
    done: queue.SimpleQueue[tuple[list[_Chunk], np.ndarray, int] | BaseException] = queue.SimpleQueue()
    for _ in range(min(PREFETCH_DEPTH, len(runs))):
        free.put(np.empty(max(sizes), np.uint8))
    stop = threading.Event()

    def read_ahead() -> None:
        try:
            for run, total in zip(runs, sizes):
                buffer = free.get()
                if buffer is None or stop.is_set():  # the checks failed
                    return
                if os.preadv(fd, [buffer[:total]], run[0][2]) != total:
                    raise Damaged(False, f"inner chunk {run[0][0]} of shard {key} is cut short")
                done.put((run, buffer, total))
        except BaseException as err:  # noqa: BLE001 - raised on the checking thread
            done.put(err)

    reader = threading.Thread(target=read_ahead, name="layoutckpt-read-ahead", daemon=True)
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


def _read_cached(fd: int, view: np.ndarray, offset: int) -> bool:
    """Read ``view``'s length at ``offset`` into it only if the page cache holds all of it
    (``RWF_NOWAIT``: no wait for the device); False where it does not, or the system cannot tell."""
    if not _RWF_NOWAIT:
        return False
    try:
        return os.preadv(fd, [view], offset, _RWF_NOWAIT) == len(view)
    except OSError as err:
        if err.errno in (errno.EAGAIN, errno.EOPNOTSUPP, errno.EINVAL):  # not cached; not supported here
            return False
        raise


_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)  # Linux 4.14 and later


def bytes_read() -> int:
    """Bytes this process has read from shard files through ``read_box`` (index and chunks,
    checksums included): the counterpart of TensorStore's ``/tensorstore/kvstore/file/bytes_read``."""
    return _bytes_read


class Damaged(Exception):
    """A shard file is missing or fails its checks; the caller names the array (``_store``)."""

    def __init__(self, missing: bool, detail: str) -> None:
        super().__init__(detail)
        self.missing = missing


# Inner chunks that lie next to each other in a shard file, all wanted, are fetched by one
# ``preadv`` of up to this many bytes, then checked and copied out one by one: an eighth of the
# system calls for the 32 KiB chunks of a model's small shards, in a buffer that stays in the
# core's L2 cache. Longer runs read a cold file slower, the kernel's readahead no longer running
# ahead of the checks: a cold 65 MB tensor of 256 KiB chunks took 0.058-0.059 s in runs of
# 256 KiB, 0.062-0.064 s in runs of 1 MiB and 0.075 s in runs of 4 MiB (30 reads of each,
# alternated).
READ_RUN_BYTES = 256 << 10


# An inner chunk to read: its position in the shard index, its cell in the shard's inner grid,
# and its offset and length in the file.
_Chunk = tuple[int, tuple[int, ...], int, int]

# Runs read ahead of the checks by ``read_box(prefetch=True)``: enough for the disk never to
# wait on the checks, few enough to stay in the cores' caches.
PREFETCH_DEPTH = 4


def read_box(
    root: Path,
    meta: ArrayMeta,
    box: Box,
    out: np.ndarray,
    *,
    all_chunks_stored: bool = True,
    prefetch: bool = False,
) -> int:
    """Fill ``out`` with ``box`` of the array ``meta`` stored under the local directory ``root``,
    reading only the shard indexes and inner chunks the box touches. Returns the bytes read.

    With ``prefetch`` a thread of its own reads each shard's runs in file order, up to
    ``PREFETCH_DEPTH`` ahead, while this one checks and copies: one sequential stream per file,
    which a cold disk serves faster than several threads reading parts of one file at once. A
    shard whose first run the page cache holds is read on this thread alone.

    Runs of adjacent chunks are read into one reused buffer, each chunk's crc32c checked and
    its part of the box copied out: one copy fewer than TensorStore's read path, which decodes
    every chunk into a fresh array, and half the CPU time of a whole load. A missing file or
    chunk, a failed checksum or an index that points outside its file raise ``Damaged``; where
    the checkpoint predates ``all_chunks_stored``, missing chunks read as zeros (the fill value).
    """
    global _bytes_read
    inner = tuple(meta.inner_chunk_shape)
    shard = tuple(meta.shard_shape)
    chunk_bytes = out.dtype.itemsize * math.prod(inner)
    codec = _codec(meta.compression, out.dtype.itemsize)
    # Where inner chunk ``at`` of a shard sits in its index: C order over the shard's inner grid.
    grid = [-(-s // c) for s, c in zip(shard, inner)]
    steps = [math.prod(grid[d + 1 :]) for d in range(len(grid))]
    table_bytes = 16 * math.prod(grid) + 4
    buffer = np.empty(0, np.uint8)
    nread = 0

    def place(origin: Sequence[int], at: Sequence[int], chunk: np.ndarray | None) -> None:
        dst, src = [], []
        for (a, b), o, i, c, n in zip(box, origin, at, inner, meta.shape):
            start = o + i * c
            lo, hi = max(start, a), min(start + c, n, b)
            dst.append(slice(lo - a, hi - a))
            src.append(slice(lo - start, hi - start))
        out[tuple(dst)] = 0 if chunk is None else chunk.reshape(inner)[tuple(src)]

    def check(key: str, origin: Sequence[int], run: list[_Chunk], data: np.ndarray) -> None:
        """Check each chunk of ``run``, read into ``data``, and copy it out."""
        pos = 0
        for i, at, _, nbytes in run:
            view = data[pos : pos + nbytes]
            pos += nbytes
            payload = view[:-4]
            if crc32c.crc32c(payload) != int.from_bytes(view[-4:], "little"):
                raise Damaged(False, f"inner chunk {i} of shard {key} fails its crc32c")
            raw = payload if codec is None else np.frombuffer(codec.decode(payload), np.uint8)
            if len(raw) != chunk_bytes:
                raise Damaged(False, f"inner chunk {i} of shard {key} decodes to {len(raw)} bytes, not {chunk_bytes}")
            place(origin, at, raw.view(out.dtype))

    def fetch(fd: int, key: str, origin: Sequence[int], runs: list[list[_Chunk]]) -> int:
        """Read each run of adjacent chunks of one shard with one call, check its chunks and
        copy them out; with ``prefetch``, the reads go ahead on a thread of their own."""
        nonlocal buffer
        sizes = [sum(c[3] for c in run) for run in runs]
        if len(buffer) < max(sizes):
            # Room for a whole run, but not 256 KiB for a small array's one chunk of a few bytes.
            buffer = np.empty(max(max(sizes), min(READ_RUN_BYTES, 16 * (chunk_bytes + 4))), np.uint8)
        first = 0
        if prefetch and len(runs) > 1:
            # A file the page cache holds is read on this thread: reading ahead would only add
            # a hand-off per run (a warm 65 MB tensor in 4 shards: 0.016-0.017 s, 0.011 s without).
            if not _read_cached(fd, buffer[: sizes[0]], runs[0][0][2]):
                _prefetched(fd, key, runs, sizes, lambda run, data: check(key, origin, run, data))
                return sum(sizes)
            check(key, origin, runs[0], buffer[: sizes[0]])
            first = 1
        for run, total in zip(runs[first:], sizes[first:]):
            if os.preadv(fd, [buffer[:total]], run[0][2]) != total:
                raise Damaged(False, f"inner chunk {run[0][0]} of shard {key} is cut short")
            check(key, origin, run, buffer[:total])
        return sum(sizes)

    try:
        for cell in itertools.product(*(range(a // s, (b - 1) // s + 1) for (a, b), s in zip(box, shard))):
            key = meta.chunk_key(cell)
            origin = [c * s for c, s in zip(cell, shard)]
            # The inner chunks of this shard that the box overlaps, along each dimension.
            ranges = [
                range((max(a, o) - o) // c, (min(b, o + s) - 1 - o) // c + 1)
                for (a, b), o, s, c in zip(box, origin, shard, inner)
            ]
            try:
                fd = os.open(root / meta.path / key, os.O_RDONLY)
            except FileNotFoundError:
                if all_chunks_stored:
                    raise Damaged(True, f"shard {key} does not exist") from None
                for at in itertools.product(*ranges):
                    place(origin, at, None)
                continue
            try:
                size = os.fstat(fd).st_size
                if size < table_bytes:
                    raise Damaged(False, f"shard {key} is {size} bytes, too short for its index")
                table = os.pread(fd, table_bytes, size - table_bytes)
                nread += table_bytes
                if crc32c.crc32c(table[:-4]) != int.from_bytes(table[-4:], "little"):
                    raise Damaged(False, f"the index of shard {key} fails its crc32c")
                entries = np.frombuffer(table, "<u8", count=(table_bytes - 4) // 8)
                offsets, lengths = entries[0::2].tolist(), entries[1::2].tolist()
                runs: list[list[_Chunk]] = []
                for at in itertools.product(*ranges):
                    i = sum(x * step for x, step in zip(at, steps))
                    offset, nbytes = offsets[i], lengths[i]
                    if offset == _ABSENT and nbytes == _ABSENT:
                        if all_chunks_stored:
                            raise Damaged(True, f"inner chunk {i} of shard {key} is not stored")
                        place(origin, at, None)
                        continue
                    if nbytes < 4 or offset + nbytes > size - table_bytes:
                        raise Damaged(False, f"inner chunk {i} of shard {key} lies outside its file")
                    run = runs[-1] if runs else None
                    if run is None or offset != run[-1][2] + run[-1][3] or offset + nbytes - run[0][2] > READ_RUN_BYTES:
                        runs.append([])
                    runs[-1].append((i, at, offset, nbytes))
                if runs:
                    nread += fetch(fd, key, origin, runs)
            finally:
                os.close(fd)
    finally:
        with _read_lock:
            _bytes_read += nread
    return nread
