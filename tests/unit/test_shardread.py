"""Reading boxes from shard files (``_shardread.read_box``): plain and read-ahead reads give the
same elements and bytes, the read-ahead stops at damage, and the page-cache check."""

from __future__ import annotations

import itertools
import os
import time

import crc32c
import numpy as np
import pytest

import layoutckpt as lc
from layoutckpt.format._shard import grid_cells
from layoutckpt.storage import _os, _shardfile, _shardread

from .test_shardfile import CASES, _array, _meta

# Runs of one inner chunk of the cases below (4 x 48 float32): 16 runs per shard.
RUNS_OF_ONE_CHUNK = lc.IOConfig(read_run_bytes=4 * 48 * 4)


@pytest.mark.parametrize("cached", [False, True], ids=["cold", "cached"])
@pytest.mark.parametrize(("shape", "shard", "inner", "dtype"), CASES)
@pytest.mark.parametrize(
    "box_of", [lambda s: tuple((0, n) for n in s), lambda s: tuple((n // 3, n - n // 4) for n in s)]
)
def test_prefetched_reads_give_the_same_array_and_bytes(
    tmp_path, monkeypatch, shape, shard, inner, dtype, box_of, cached
):
    """``read_box(prefetch=True)`` reads each shard's runs on a thread of its own, ahead of the
    checks, or on the caller's where the page cache holds the file: the same elements and the
    same bytes read as the plain path either way, every shard file read front to back."""
    # Cached: the first run read at once, as a file system that tells (ext4, xfs) gives it.
    read_now = os.preadv
    monkeypatch.setattr(_os, "read_cached", lambda fd, view, at: read_now(fd, [view], at) if cached else 0)
    meta = _meta(shape, shard, inner, dtype)
    array = _array(shape, dtype)
    for cell in grid_cells(shape, shard):
        part = array[tuple(slice(c * s, (c + 1) * s) for c, s in zip(cell, shard))]
        _shardfile.write_shard(tmp_path, meta, cell, array.dtype, part)
    box = box_of(shape)
    want = array[tuple(slice(a, b) for a, b in box)]
    plain, ahead = np.empty_like(want), np.empty_like(want)
    plain_bytes = _shardread.read_box(tmp_path, meta, box, plain)
    ahead_bytes = _shardread.read_box(tmp_path, meta, box, ahead, prefetch=True)
    assert ahead.tobytes() == plain.tobytes() == want.tobytes()
    assert ahead_bytes == plain_bytes


def test_prefetched_reads_run_ahead_on_their_own_thread_and_stop_at_damage(tmp_path, monkeypatch):
    """The runs are read by the read-ahead thread; a chunk that fails its checksum raises
    ``Damaged`` on the caller's thread, and the read-ahead thread is gone when it does."""
    import threading

    shape, shard, inner, dtype = (64, 48), (64, 48), (4, 48), "float32"  # 16 runs of one chunk
    meta = _meta(shape, shard, inner, dtype)
    array = _array(shape, dtype)
    _shardfile.write_shard(tmp_path, meta, (0, 0), array.dtype, array)
    monkeypatch.setattr(_os, "read_cached", lambda *a: 0)  # as if the file were cold
    readers = []
    real = os.preadv
    monkeypatch.setattr(
        _shardread.os,
        "preadv",
        lambda fd, bufs, at: readers.append(threading.current_thread().name) or real(fd, bufs, at),
    )
    out = np.empty_like(array)
    _shardread.read_box(tmp_path, meta, ((0, 64), (0, 48)), out, prefetch=True, io=RUNS_OF_ONE_CHUNK)
    assert out.tobytes() == array.tobytes()
    assert len(readers) == 16 and set(readers) == {"layoutckpt-read-ahead"}

    path = tmp_path / "a" / meta.chunk_key((0, 0))
    data = bytearray(path.read_bytes())
    data[5 * (4 * 48 * 4 + 4) + 10] ^= 0xFF  # inside the sixth chunk
    path.write_bytes(bytes(data))
    readers.clear()
    with pytest.raises(_shardread.Damaged, match=r"inner chunk \{5, 0\} of shard c\.0\.0 fails its crc32c"):
        _shardread.read_box(tmp_path, meta, ((0, 64), (0, 48)), out, prefetch=True, io=RUNS_OF_ONE_CHUNK)
    assert not any(t.name == "layoutckpt-read-ahead" for t in threading.enumerate())
    assert 6 <= len(readers) <= 6 + RUNS_OF_ONE_CHUNK.prefetch_depth  # it stopped soon after


def test_a_file_the_page_cache_holds_is_read_on_the_callers_thread(tmp_path, monkeypatch):
    """Where the first page comes from the page cache without waiting, the shard is read on the
    caller's thread (the rest as one read, the cache holding it too), no byte read twice; where
    it does not, on the read-ahead thread, run by run."""
    import threading

    shape, shard, inner, dtype = (64, 48), (64, 48), (4, 48), "float32"  # 16 runs of one chunk
    meta = _meta(shape, shard, inner, dtype)
    array = _array(shape, dtype)
    _shardfile.write_shard(tmp_path, meta, (0, 0), array.dtype, array)
    chunk = 4 * 48 * 4 + 4
    reads = []  # (thread, offset, bytes) of every read that returned data
    real = os.preadv

    def preadv(fd, bufs, at, *flags):
        reads.append((threading.current_thread().name, at, sum(len(b) for b in bufs)))
        return real(fd, bufs, at)

    monkeypatch.setattr(_shardread.os, "preadv", preadv)
    for cached in (True, False):

        def if_cached(fd, view, at, cached=cached):
            return preadv(fd, [view], at) if cached else 0

        monkeypatch.setattr(_os, "read_cached", if_cached)
        reads.clear()
        out = np.empty_like(array)
        _shardread.read_box(tmp_path, meta, ((0, 64), (0, 48)), out, prefetch=True, io=RUNS_OF_ONE_CHUNK)
        assert out.tobytes() == array.tobytes()
        names = {name for name, _, _ in reads}
        assert names == ({threading.current_thread().name} if cached else {"layoutckpt-read-ahead"})
        assert sum(n for _, _, n in reads) == 16 * chunk and len({at for _, at, _ in reads}) == len(reads)
        assert len(reads) == (2 if cached else 16)


def test_read_cached_reads_only_what_the_page_cache_holds(tmp_path):
    """``read_cached`` fills the buffer from a file in the page cache and reads nothing of one
    that was dropped from it; a file system that cannot tell (tmpfs) always reads nothing."""
    import errno

    data = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8)
    path = tmp_path / "f"
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # clean pages, which the eviction below can drop
        try:
            os.preadv(fd, [bytearray(1)], 0, os.RWF_NOWAIT)
            tells = True
        except OSError as err:
            assert err.errno == errno.EOPNOTSUPP
            tells = False
        view = np.zeros_like(data)
        assert _os.read_cached(fd, view, 0) == (len(view) if tells else 0)
        assert not tells or view.tobytes() == data.tobytes()
        # The kernel now and then keeps a just-written file's pages through one request to drop
        # them (about 1 in 150 here, beside other processes): ask again before judging.
        for _ in range(20):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            if _os.read_cached(fd, np.zeros_like(data), 0) == 0:
                break
            time.sleep(0.05)
        assert _os.read_cached(fd, np.zeros_like(data), 0) == 0
    finally:
        os.close(fd)


BLOCK_CASES = [
    ((64, 48), (32, 48), (8, 6), "float32"),
    ((64, 48), (64, 24), (16, 3), "bfloat16"),
    ((30, 50), (14, 24), (7, 6), "float64"),  # checksums misalign the items; edge chunks clipped
    ((12, 10, 8), (6, 10, 8), (3, 5, 2), "int64"),
    ((40,), (40,), (4,), "bool"),
]


@pytest.mark.parametrize("run_bytes", [1, 256 << 10], ids=["one-chunk-runs", "long-runs"])
@pytest.mark.parametrize(("shape", "shard", "inner", "dtype"), BLOCK_CASES)
def test_chunks_placed_in_blocks_give_every_box_exactly(tmp_path, shape, shard, inner, dtype, run_bytes):
    """Runs of whole chunks side by side along the last dimension are placed with one strided
    copy (``_BoxFill.place_block``): every box, into a fresh array and into a strided view of a
    larger one, comes out as the array's own slice, as runs of one chunk give it."""
    meta = _meta(shape, shard, inner, dtype)
    array = _array(shape, dtype)
    for cell in grid_cells(shape, shard):
        part = array[tuple(slice(c * s, (c + 1) * s) for c, s in zip(cell, shard))]
        _shardfile.write_shard(tmp_path, meta, cell, array.dtype, part)
    io = lc.IOConfig(read_run_bytes=run_bytes)
    rng = np.random.default_rng(1)
    boxes = [tuple((0, n) for n in shape), tuple((n // 3, n - n // 4) for n in shape)]
    for _ in range(12):
        box = []
        for n in shape:
            a, b = sorted(rng.integers(0, n + 1, size=2).tolist())
            box.append((a, max(b, a + 1)) if a < n else (n - 1, n))
        boxes.append(tuple(box))
    for box in boxes:
        want = array[tuple(slice(a, b) for a, b in box)]
        out = np.zeros_like(want)
        _shardread.read_box(tmp_path, meta, box, out, io=io)
        assert out.tobytes() == want.tobytes(), box
        # into a view of a larger array, as an in-place load's destination may be
        big = np.zeros(tuple(n + 3 for n in want.shape), want.dtype)
        view = big[tuple(slice(1, 1 + n) for n in want.shape)]
        _shardread.read_box(tmp_path, meta, box, view, io=io)
        assert view.tobytes() == want.tobytes(), box
        assert not big[(0,) * big.ndim]  # nothing written outside the view


def test_a_whole_shard_is_placed_with_one_copy_per_run(tmp_path, monkeypatch):
    """Rows of whole chunks are one block: a box covering the shard, or cutting it only
    between chunks, is placed with one strided copy, not one per row of chunks."""
    shape, inner = (64, 48), (8, 6)
    meta = _meta(shape, shape, inner, "float32")
    array = _array(shape, "float32")
    _shardfile.write_shard(tmp_path, meta, (0, 0), array.dtype, array)
    blocks = []
    real = _shardread._BoxFill.place_block

    def counted(self, origin, at, rows, cols, data):
        blocks.append((tuple(at), rows, cols))
        return real(self, origin, at, rows, cols, data)

    monkeypatch.setattr(_shardread._BoxFill, "place_block", counted)
    out = np.zeros_like(array)
    _shardread.read_box(tmp_path, meta, ((0, 64), (0, 48)), out, io=lc.IOConfig(read_run_bytes=256 << 10))
    assert out.tobytes() == array.tobytes()
    assert blocks == [((0, 0), 8, 8)]
    # a box of half the columns: each row of chunks is cut off from the next in the file
    blocks.clear()
    out = np.zeros((64, 24), np.float32)
    _shardread.read_box(tmp_path, meta, ((0, 64), (0, 24)), out, io=lc.IOConfig(read_run_bytes=256 << 10))
    assert out.tobytes() == array[:, :24].tobytes()
    assert blocks == [((0, 0), 8, 4)]


@pytest.mark.parametrize("held", [100, 2000, 5000])
def test_a_file_the_page_cache_holds_in_part_is_read_once(tmp_path, monkeypatch, held):
    """Where a read from the cache gives only part of what it asked for (readahead brought in
    part of a cold file), the runs it holds whole are checked from it, the rest of the bytes
    start the next run, and no byte of the file is read twice; only a probe of the first run
    that comes back short (a cold file, read ahead on its own thread) is read again."""
    shape, shard, inner, dtype = (64, 48), (64, 48), (4, 48), "float32"  # 16 runs of one chunk
    meta = _meta(shape, shard, inner, dtype)
    array = _array(shape, dtype)
    _shardfile.write_shard(tmp_path, meta, (0, 0), array.dtype, array)
    spans = []  # (offset, bytes) of every read
    real = os.preadv

    def preadv(fd, bufs, at, *flags):
        n = real(fd, bufs, at)
        spans.append((at, n))
        return n

    def part_cached(fd, view, at):  # the cache holds ``held`` bytes from wherever it is asked
        return preadv(fd, [view[:held]], at)

    monkeypatch.setattr(_shardread.os, "preadv", preadv)
    monkeypatch.setattr(_os, "read_cached", part_cached)
    out = np.empty_like(array)
    nread = _shardread.read_box(tmp_path, meta, ((0, 64), (0, 48)), out, prefetch=True, io=RUNS_OF_ONE_CHUNK)
    assert out.tobytes() == array.tobytes()
    chunk = 4 * 48 * 4 + 4
    again = held if held < chunk else 0  # the short probe's bytes
    data = sorted((at, at + n) for at, n in spans if n and at < 16 * chunk)
    if again:
        assert data[0] == (0, again)
        data = data[1:]
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(data))  # no byte twice
    assert sum(b - a for a, b in data) == 16 * chunk
    tail = _shardread._BoxFill(meta, ((0, 64), (0, 48)), out, True, lc.IOConfig()).tail_bytes
    assert nread == 16 * chunk + tail + again


@pytest.mark.parametrize("slab_chunks", [1, 3, 8, 20, 100])
@pytest.mark.parametrize(("shape", "inner"), [((64, 48), (8, 6)), ((12, 10, 8), (3, 5, 2)), ((40,), (4,))])
def test_a_whole_shard_is_read_in_slabs_and_damage_names_its_chunk(tmp_path, monkeypatch, shape, inner, slab_chunks):
    """A box covering a shard stored in order, or cutting it only between chunks, is read in
    slabs of whole chunks of at most ``CACHED_RUN_BYTES`` (rows of chunks where they fit, parts
    of a row where not): the box comes back exactly, no read is larger than a slab, and a chunk
    that fails its checksum is named by its cell."""
    stride = 4 * int(np.prod(inner)) + 4
    monkeypatch.setattr(_shardread, "CACHED_RUN_BYTES", slab_chunks * stride)
    monkeypatch.setattr(_shardread, "WHOLE_SHARD_BYTES", 0)  # slabs even where one call would do
    meta = _meta(shape, shape, inner, "float32")
    array = _array(shape, "float32")
    _shardfile.write_shard(tmp_path, meta, (0,) * len(shape), array.dtype, array)
    reads = []
    real = os.preadv
    monkeypatch.setattr(_shardread.os, "preadv", lambda fd, bufs, at: reads.append(len(bufs[0])) or real(fd, bufs, at))
    grid = [n // c for n, c in zip(shape, inner)]
    # the whole shard, and all but its first and last chunk along every dimension (cut between chunks)
    cuts = (tuple((0, g) for g in grid), tuple((1, g - 1) if g > 2 else (g - 1, g) for g in grid))
    for cut in cuts:
        box = tuple((a * c, b * c) for (a, b), c in zip(cut, inner))
        want = array[tuple(slice(a, b) for a, b in box)]
        out = np.zeros_like(want)
        reads.clear()
        _shardread.read_box(tmp_path, meta, box, out)
        assert out.tobytes() == want.tobytes()
        assert sum(reads) == stride * int(np.prod([b - a for a, b in cut])) and max(reads) <= slab_chunks * stride

    at = [b - 1 for _, b in cuts[1]]  # inside both boxes
    bad = int(np.ravel_multi_index(at, grid))
    cell = ", ".join(map(str, at))
    path = tmp_path / "a" / meta.chunk_key((0,) * len(shape))
    data = bytearray(path.read_bytes())
    data[bad * stride + 1] ^= 0xFF
    path.write_bytes(bytes(data))
    for cut in cuts:
        box = tuple((a * c, b * c) for (a, b), c in zip(cut, inner))
        with pytest.raises(_shardread.Damaged, match=rf"inner chunk \{{{cell}\}} of shard .* fails its crc32c"):
            _shardread.read_box(tmp_path, meta, box, np.zeros([b - a for a, b in box], np.float32))


@pytest.mark.parametrize("payload", [4, 100, 24 << 10])
def test_intact_chunks_laid_end_to_end_have_one_checksum_whatever_they_hold(payload):
    """The crc32c of intact chunks laid end to end, each followed by its crc32c, is the one
    ``_intact_crc`` gives for their count and size, whatever they hold; one flipped bit in any
    chunk or checksum changes it."""
    rng = np.random.default_rng(payload)
    for count in (2, 3, 17):
        chunks = [rng.integers(0, 256, payload, np.uint8).tobytes() for _ in range(count)]
        data = bytearray(b"".join(c + crc32c.crc32c(c).to_bytes(4, "little") for c in chunks))
        assert crc32c.crc32c(data) == _shardread._intact_crc(payload + 4, count)
        for at in (0, len(data) // 2, len(data) - 1):
            data[at] ^= 1
            assert crc32c.crc32c(data) != _shardread._intact_crc(payload + 4, count)
            data[at] ^= 1


def test_a_slab_of_intact_chunks_is_checked_with_one_call(tmp_path, monkeypatch):
    """The chunks of a slab are checked with one crc32c call over them all, not one per chunk:
    each call hands the GIL to the other reading threads and back."""
    shape, inner = (64, 48), (8, 6)
    stride = 4 * int(np.prod(inner)) + 4
    monkeypatch.setattr(_shardread, "CACHED_RUN_BYTES", 16 * stride)  # two rows of 8 chunks
    monkeypatch.setattr(_shardread, "WHOLE_SHARD_BYTES", 0)
    meta = _meta(shape, shape, inner, "float32")
    array = _array(shape, "float32")
    _shardfile.write_shard(tmp_path, meta, (0, 0), array.dtype, array)
    _shardread.read_box(tmp_path, meta, ((0, 64), (0, 48)), np.zeros(shape, np.float32))  # the known sums
    calls = []
    real = crc32c.crc32c
    monkeypatch.setattr(crc32c, "crc32c", lambda data, *a: calls.append(len(data)) or real(data, *a))
    out = np.zeros(shape, np.float32)
    _shardread.read_box(tmp_path, meta, ((0, 64), (0, 48)), out)
    assert out.tobytes() == array.tobytes()
    assert calls == [16 * stride] * 4


def _one_shard(tmp_path, monkeypatch, shape, inner):
    """A float32 array of ``shape`` stored as one shard of ``inner`` chunks: its meta, its
    elements, its file, and the sizes of the ``preadv`` calls made from then on."""
    meta = _meta(shape, shape, inner, "float32")
    array = _array(shape, "float32")
    cell = (0,) * len(shape)
    _shardfile.write_shard(tmp_path, meta, cell, array.dtype, array)
    reads = []
    real = os.preadv
    monkeypatch.setattr(_shardread.os, "preadv", lambda fd, bufs, at: reads.append(len(bufs[0])) or real(fd, bufs, at))
    return meta, array, tmp_path / "a" / meta.chunk_key(cell), reads


@pytest.mark.parametrize(("shape", "inner"), [((64, 48), (8, 6)), ((12, 10, 8), (12, 5, 2)), ((40,), (4,))])
def test_a_small_shard_wanted_whole_is_read_with_one_call(tmp_path, monkeypatch, shape, inner):
    """A shard a box wants whole, laid out as layoutckpt writes it, is read with one call (its
    chunks and index together); damage is still named by its chunk; a shard whose chunks lie
    in another order (a valid index, not layoutckpt's layout) is read chunk by chunk, exactly."""
    meta, array, path, reads = _one_shard(tmp_path, monkeypatch, shape, inner)
    box = tuple((0, n) for n in shape)

    def read() -> np.ndarray:
        out = np.zeros_like(array)
        reads.clear()
        assert _shardread.read_box(tmp_path, meta, box, out) == path.stat().st_size
        return out

    assert read().tobytes() == array.tobytes() and reads == [path.stat().st_size]

    count, stride = int(np.prod([n // c for n, c in zip(shape, inner)])), 4 * int(np.prod(inner)) + 4
    raw = path.read_bytes()
    chunks = [raw[k * stride : (k + 1) * stride] for k in range(count)]
    entries = np.empty(2 * count, "<u8")
    entries[0::2] = [(count - 1 - k) * stride for k in range(count)]  # stored last to first
    entries[1::2] = stride
    table = entries.tobytes()
    path.write_bytes(b"".join(reversed(chunks)) + table + crc32c.crc32c(table).to_bytes(4, "little"))
    assert read().tobytes() == array.tobytes() and len(reads) > 1

    damaged = bytearray(raw)
    damaged[(count - 1) * stride + 1] ^= 0xFF
    path.write_bytes(bytes(damaged))
    last = ", ".join(str(n // c - 1) for n, c in zip(shape, inner))
    with pytest.raises(_shardread.Damaged, match=rf"inner chunk \{{{last}\}} of shard .* fails its crc32c"):
        read()


def test_a_reader_keeps_a_few_shared_data_files_open_until_closed(tmp_path, monkeypatch):
    """A packed checkpoint's data file (an extent with a length) stays open for the shards
    after it, up to ``KEPT_FILES``; past that, and for a plain shard file, the caller closes."""
    for name in ("d1", "d2", "plain"):
        (tmp_path / name).write_bytes(b"0123456789")
    monkeypatch.setattr(_shardread, "KEPT_FILES", 1)
    files = _shardread.Files(tmp_path)
    fd, size, owned = files.open(_shardread.Extent("d1", 0, 4))
    assert (size, owned) == (10, False)
    assert files.open(_shardread.Extent("d1", 4, 4)) == (fd, 10, False)
    for extent in (_shardread.Extent("d2", 0, 4), _shardread.Extent("plain")):
        other, _, owned = files.open(extent)
        assert owned and other != fd
        os.close(other)
    files.close()
    with pytest.raises(OSError):
        os.fstat(fd)


def test_every_shard_inside_a_box_that_spans_several_is_read_with_one_call(tmp_path, monkeypatch):
    """A box over several shards (a load on fewer ranks than the save) reads each shard that
    lies inside it with one call, chunks and index together; the shard it cuts is read in
    parts."""
    shape, shard, inner = (64, 48), (16, 48), (8, 6)
    meta = _meta(shape, shard, inner, "float32")
    array = _array(shape, "float32")
    for row in range(4):
        _shardfile.write_shard(tmp_path, meta, (row, 0), array.dtype, array[16 * row : 16 * (row + 1)])
    tails = []
    real = _shardread._BoxFill.tail
    monkeypatch.setattr(
        _shardread._BoxFill, "tail", lambda self, fd, key, *a: tails.append(key) or real(self, fd, key, *a)
    )
    out = np.zeros((56, 48), np.float32)
    _shardread.read_box(tmp_path, meta, ((0, 56), (0, 48)), out)  # shards 0-2 whole, half of shard 3
    assert out.tobytes() == array[:56].tobytes()
    assert tails == [meta.chunk_key((3, 0))]


def test_chunks_cut_by_the_box_of_a_shard_stored_in_order_are_read_without_parsing_its_index(tmp_path, monkeypatch):
    """A box whose edges cut through inner chunks (a small array resharded) reads them from a
    shard laid out as layoutckpt writes it with no index parsed, in slabs rather than runs
    grouped chunk by chunk; each chunk's checksum still holds it, and a damaged one is named."""
    shape, inner = (64, 48), (8, 6)
    meta = _meta(shape, shape, inner, "float32")
    array = _array(shape, "float32")
    _shardfile.write_shard(tmp_path, meta, (0, 0), array.dtype, array)
    parsed = []
    real = _shardread.checked_index
    monkeypatch.setattr(_shardread, "checked_index", lambda *a: parsed.append(a[2]) or real(*a))
    monkeypatch.setattr(_shardread._BoxFill, "runs", lambda *a: pytest.fail("the chunks were grouped into runs"))
    box = ((3, 61), (5, 25))  # cuts the chunks along both edges of both dimensions
    out = np.zeros((58, 20), np.float32)
    _shardread.read_box(tmp_path, meta, box, out)
    assert out.tobytes() == array[3:61, 5:25].tobytes() and parsed == []

    path = tmp_path / "a" / meta.chunk_key((0, 0))
    raw = bytearray(path.read_bytes())
    stride = 4 * int(np.prod(inner)) + 4
    raw[(1 * 8 + 2) * stride + 5] ^= 1  # inner chunk (1, 2): rows 8-15, columns 12-17
    path.write_bytes(bytes(raw))
    with pytest.raises(_shardread.Damaged, match=r"inner chunk \{1, 2\} of shard c\.0\.0 fails its crc32c"):
        _shardread.read_box(tmp_path, meta, box, np.zeros((58, 20), np.float32))


@pytest.mark.parametrize(
    ("shape", "inner", "box", "bad"),
    [
        ((64, 48), (8, 6), ((3, 61), (2, 46)), [(0, 0), (3, 4)]),  # every chunk cut or inside
        ((10, 12), (10, 12), ((2, 9), (0, 5)), [(0, 0)]),  # one chunk: a small array resharded
        ((12, 10, 8), (12, 5, 2), ((0, 12), (1, 9), (1, 7)), [(0, 1, 3)]),
        ((40,), (4,), ((1, 39),), [(0,), (9,)]),
    ],
)
def test_a_small_shard_the_box_cuts_but_wants_every_chunk_of_is_read_with_one_call(
    tmp_path, monkeypatch, shape, inner, box, bad
):
    """A box that overlaps every inner chunk of a small shard but cuts some of them (a small
    array resharded) reads the shard with one call, chunks and index together: the bytes the
    chunk-by-chunk path reads, in one system call. The box comes back exactly, and a damaged
    chunk, cut or not, is named by its cell."""
    meta, array, path, reads = _one_shard(tmp_path, monkeypatch, shape, inner)
    monkeypatch.setattr(_shardread.os, "pread", lambda *a: pytest.fail("the tail was read on its own"))
    want = array[tuple(slice(a, b) for a, b in box)]
    out = np.zeros_like(want)
    assert _shardread.read_box(tmp_path, meta, box, out) == path.stat().st_size
    assert out.tobytes() == want.tobytes() and reads == [path.stat().st_size]

    raw = path.read_bytes()
    grid = [n // c for n, c in zip(shape, inner)]
    stride = 4 * int(np.prod(inner)) + 4
    for at in bad:
        damaged = bytearray(raw)
        damaged[int(np.ravel_multi_index(at, grid)) * stride + 1] ^= 0xFF
        path.write_bytes(bytes(damaged))
        named = ", ".join(map(str, at))
        with pytest.raises(_shardread.Damaged, match=rf"inner chunk \{{{named}\}} of shard .* fails its crc32c"):
            _shardread.read_box(tmp_path, meta, box, np.zeros_like(want))


def test_a_part_of_a_shard_stored_in_order_is_read_without_parsing_its_index(tmp_path, monkeypatch):
    """A box that wants a part of a shard laid out as layoutckpt writes it (a resharded load's
    column band) reads its chunks with no index parsed: the index's bytes are the known ones.
    The same index after data cut short goes through the parsed, checked index, and raises."""
    shape, inner = (64, 48), (8, 6)
    meta = _meta(shape, shape, inner, "float32")
    array = _array(shape, "float32")
    cell = (0, 0)
    _shardfile.write_shard(tmp_path, meta, cell, array.dtype, array)
    parsed = []
    real = _shardread.checked_index
    monkeypatch.setattr(_shardread, "checked_index", lambda *a: parsed.append(a[2]) or real(*a))
    box = ((8, 64), (12, 24))  # every row of chunks but the first, two columns of chunks
    out = np.zeros((56, 12), np.float32)
    _shardread.read_box(tmp_path, meta, box, out)
    assert out.tobytes() == array[8:64, 12:24].tobytes() and parsed == []

    path = tmp_path / "a" / meta.chunk_key(cell)
    raw = path.read_bytes()
    tail = _shardread._BoxFill(meta, box, out, True, lc.IOConfig()).tail_bytes
    stride = 4 * int(np.prod(inner)) + 4
    path.write_bytes(raw[: len(raw) - tail - stride] + raw[len(raw) - tail :])  # the last chunk gone
    with pytest.raises(_shardread.Damaged, match=r"index of shard .* is invalid"):
        _shardread.read_box(tmp_path, meta, box, np.zeros((56, 12), np.float32))
    assert parsed
