"""Shard files (``docs/format.md`` section 5.4) on a local file system, without TensorStore.

``read_box`` reads a box of an array: the index of each shard it touches, then only the inner
chunks it needs, each checked and copied into the result (loads on local disks use it).

``write_shard`` writes one shard as a stream, one inner chunk at a time. Two writers use it:

- ``save``: TensorStore would copy each inner chunk into a fresh buffer, assemble the shard in
  memory and write it through a lock file and a rename. Here a chunk that is contiguous in the
  source goes from the tensor's own memory to the file (one ``writev`` with its checksum), and
  the others are gathered into one reused buffer: half the CPU time of the TensorStore path.
- ``import_safetensors``, which reads its source piece by piece: TensorStore stores a shard as
  one value, so every partial write re-reads and rewrites the whole shard (measured: a 200 MB
  shard written in 25 MB blocks took 3.5x as long and peaked at 280 MB).

Either way each inner chunk is read, encoded, appended and dropped, and the index follows, so
memory stays at one inner chunk whatever the shard size.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import crc32c
import numpy as np

from ._plan import Box

if TYPE_CHECKING:
    from ._format import ArrayMeta

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
    read: Callable[[Box], np.ndarray],
    *,
    start_writeback: bool = False,
) -> int:
    """Write the shard at grid ``cell`` of the array ``meta`` under the local directory
    ``root``; ``read(box)`` gives the elements of a box of the array, as ``dtype``. Returns the
    bytes written.

    A chunk that reaches past the array's edge is stored whole, padded with the fill value
    (zero bits, ``False`` for bool); chunks wholly outside the array are absent from the index.
    With ``start_writeback`` the kernel is asked to start writing the file to storage as soon
    as it is closed (``_store.start_writeback``).
    """
    codec = _codec(meta.compression, dtype.itemsize)
    inner = tuple(meta.inner_chunk_shape)
    boxes = inner_boxes(meta.shape, meta.shard_shape, inner, cell)
    index = np.full((inner_count(meta.shard_shape, inner), 2), _ABSENT, dtype="<u8")
    scratch: np.ndarray | None = None  # one gather buffer per shard, not one per chunk
    offset = 0
    from . import _store  # lazily: it imports TensorStore

    fd = _store.create_file(root / meta.path / meta.chunk_key(cell))
    try:
        for i, box in enumerate(boxes):
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
            _write_all(fd, [encoded, crc32c.crc32c(encoded).to_bytes(4, "little")])
            nbytes = len(encoded) + 4
            index[i] = (offset, nbytes)
            offset += nbytes
        table = index.tobytes()
        _write_all(fd, [table, crc32c.crc32c(table).to_bytes(4, "little")])
        if start_writeback:
            _store.start_writeback(fd)
    finally:
        os.close(fd)
    return offset + len(table) + 4


def _write_all(fd: int, parts: list[bytes | memoryview | np.ndarray]) -> None:
    """``writev`` until every byte of ``parts`` is written (a regular file may take fewer)."""
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        done = os.writev(fd, views)
        while views and done >= len(views[0]):
            done -= len(views[0])
            views.pop(0)
        if views and done:
            views[0] = views[0][done:]


# Threads that read or write shard files for one save or load: the work is copies, checksums
# and system calls, all outside the GIL, so about one per core; more only contend for them.
THREADS = max(2, min(4, os.cpu_count() or 1))

_read_lock = threading.Lock()
_bytes_read = 0


def bytes_read() -> int:
    """Bytes this process has read from shard files through ``read_box`` (index and chunks,
    checksums included): the counterpart of TensorStore's ``/tensorstore/kvstore/file/bytes_read``."""
    return _bytes_read


class Damaged(Exception):
    """A shard file is missing or fails its checks; the caller names the array (``_store``)."""

    def __init__(self, missing: bool, detail: str) -> None:
        super().__init__(detail)
        self.missing = missing


def read_box(root: Path, meta: ArrayMeta, box: Box, out: np.ndarray, *, all_chunks_stored: bool = True) -> int:
    """Fill ``out`` with ``box`` of the array ``meta`` stored under the local directory ``root``,
    reading only the shard indexes and inner chunks the box touches. Returns the bytes read.

    Each chunk is read into one reused buffer, its crc32c checked, and its part of the box
    copied out: one copy fewer than TensorStore's read path, which decodes every chunk into a
    fresh array, and half the CPU time of a whole load. A missing file or chunk, a failed
    checksum or an index that points outside its file raise ``Damaged``; where the checkpoint
    predates ``all_chunks_stored``, missing chunks read as zeros (the fill value).
    """
    global _bytes_read
    inner = tuple(meta.inner_chunk_shape)
    chunk_bytes = out.dtype.itemsize * math.prod(inner)
    codec = _codec(meta.compression, out.dtype.itemsize)
    buffer: np.ndarray | None = None
    nread = 0
    origin = [a for a, _ in box]

    def place(part: Box, chunk: np.ndarray | None, chunk_origin: Sequence[int]) -> None:
        dst = tuple(slice(a - o, b - o) for (a, b), o in zip(part, origin))
        out[dst] = 0 if chunk is None else chunk[tuple(slice(a - o, b - o) for (a, b), o in zip(part, chunk_origin))]

    try:
        cells = itertools.product(*(range(a // s, (b - 1) // s + 1) for (a, b), s in zip(box, meta.shard_shape)))
        for cell in cells:
            boxes = list(inner_boxes(meta.shape, meta.shard_shape, inner, cell))
            key = meta.chunk_key(cell)
            try:
                fd = os.open(root / meta.path / key, os.O_RDONLY)
            except FileNotFoundError:
                if all_chunks_stored:
                    raise Damaged(True, f"shard {key} does not exist") from None
                for b in boxes:
                    part = _intersect(b, box) if b is not None else None
                    if part is not None:
                        place(part, None, ())
                continue
            try:
                size = os.fstat(fd).st_size
                table_bytes = 16 * len(boxes) + 4
                if size < table_bytes:
                    raise Damaged(False, f"shard {key} is {size} bytes, too short for its index")
                table = os.pread(fd, table_bytes, size - table_bytes)
                nread += table_bytes
                if crc32c.crc32c(table[:-4]) != int.from_bytes(table[-4:], "little"):
                    raise Damaged(False, f"the index of shard {key} fails its crc32c")
                index = np.frombuffer(table, "<u8", count=2 * len(boxes)).reshape(-1, 2)
                for i, b in enumerate(boxes):
                    part = _intersect(b, box) if b is not None else None
                    if part is None:
                        continue
                    offset, nbytes = int(index[i, 0]), int(index[i, 1])
                    if offset == _ABSENT and nbytes == _ABSENT:
                        if all_chunks_stored:
                            raise Damaged(True, f"inner chunk {i} of shard {key} is not stored")
                        place(part, None, ())
                        continue
                    if nbytes < 4 or offset + nbytes > size - table_bytes:
                        raise Damaged(False, f"inner chunk {i} of shard {key} lies outside its file")
                    if buffer is None or len(buffer) < nbytes:
                        buffer = np.empty(max(nbytes, chunk_bytes + 4), np.uint8)
                    view = buffer[:nbytes]
                    if os.preadv(fd, [view], offset) != nbytes:
                        raise Damaged(False, f"inner chunk {i} of shard {key} is cut short")
                    nread += nbytes
                    payload = view[:-4]
                    if crc32c.crc32c(payload) != int.from_bytes(view[-4:].tobytes(), "little"):
                        raise Damaged(False, f"inner chunk {i} of shard {key} fails its crc32c")
                    raw = payload if codec is None else np.frombuffer(codec.decode(payload), np.uint8)
                    if len(raw) != chunk_bytes:
                        raise Damaged(
                            False, f"inner chunk {i} of shard {key} decodes to {len(raw)} bytes, not {chunk_bytes}"
                        )
                    place(part, raw.view(out.dtype).reshape(inner), [a for a, _ in b])
            finally:
                os.close(fd)
    finally:
        with _read_lock:
            _bytes_read += nread
    return nread


def _intersect(a: Box, b: Box) -> Box | None:
    part = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return part if all(lo < hi for lo, hi in part) else None
