"""Shard files written from a whole shard in memory (``save``'s path) against the chunk-by-chunk
path (``import_safetensors``'s, itself checked byte for byte against TensorStore in
``test_openness``): the same bytes, read back bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from layoutckpt.format._dtypes import numpy_dtype
from layoutckpt.format._format import ArrayMeta
from layoutckpt.layout._layout import P
from layoutckpt.storage import _shardfile

# (array shape, shard shape, inner chunk shape, dtype): chunks contiguous in the shard (whole
# rows, 1-d, 0-d) and not (column cuts, 3-d blocks), one chunk or many per gather group.
CASES = [
    ((64, 48), (32, 48), (8, 48), "float32"),
    ((64, 48), (32, 48), (8, 6), "float32"),
    ((64, 48), (64, 24), (16, 3), "bfloat16"),
    ((12, 10, 8), (6, 10, 8), (3, 5, 2), "float32"),
    ((12, 10, 8), (12, 10, 8), (12, 2, 8), "int64"),
    ((40,), (20,), (4,), "bool"),
    ((), (), (), "float64"),
]


def _meta(shape, shard, inner, dtype) -> ArrayMeta:
    return ArrayMeta("a", shape, dtype, shard, inner, P(*([None] * len(shape))))


def _array(shape, dtype) -> np.ndarray:
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 256, size=int(np.prod(shape)) * numpy_dtype(dtype).itemsize, dtype=np.uint8)
    if dtype == "bool":
        bits &= 1
    return bits.view(numpy_dtype(dtype)).reshape(shape)


@pytest.mark.parametrize("group_bytes", [64, 1 << 20])
@pytest.mark.parametrize(("shape", "shard", "inner", "dtype"), CASES)
def test_a_whole_shard_is_stored_as_the_chunk_by_chunk_path_stores_it(
    tmp_path, monkeypatch, shape, shard, inner, dtype, group_bytes
):
    # 64 bytes: one chunk per group; 1 MiB: every chunk of a grid row in one group.
    monkeypatch.setattr(_shardfile, "GROUP_BYTES", group_bytes)
    meta = _meta(shape, shard, inner, dtype)
    array = _array(shape, dtype)
    for cell in _shardfile.grid_cells(shape, shard):
        box = tuple(slice(c * s, (c + 1) * s) for c, s in zip(cell, shard))
        data = array[(*box, ...)]  # a view: not contiguous where a later dimension is split
        written = _shardfile.write_shard(tmp_path / "whole", meta, cell, data.dtype, data)
        origin = [c * s for c, s in zip(cell, shard)]

        def read(b, data=data, origin=origin):
            return data[(*(slice(lo - o, hi - o) for (lo, hi), o in zip(b, origin)), ...)]

        assert _shardfile.write_shard(tmp_path / "chunks", meta, cell, data.dtype, read) == written
        key = f"a/{meta.chunk_key(cell)}"
        assert (tmp_path / "whole" / key).read_bytes() == (tmp_path / "chunks" / key).read_bytes(), key
        assert (tmp_path / "whole" / key).stat().st_size == written
    out = np.empty(shape, numpy_dtype(dtype))
    _shardfile.read_box(tmp_path / "whole", meta, tuple((0, n) for n in shape), out)
    assert out.tobytes() == array.tobytes()


def test_the_whole_shard_path_copies_no_chunk_one_at_a_time(tmp_path, monkeypatch):
    """The whole-shard path is the one a save takes: it never falls back to the slow one."""

    def refuse(*args, **kwargs):
        raise AssertionError("fell back to the chunk-by-chunk path")

    monkeypatch.setattr(_shardfile, "_write_chunks", refuse)
    shape, shard, inner, dtype = CASES[1]
    meta = _meta(shape, shard, inner, dtype)
    data = _array(shape, dtype)[:32]
    assert not data[:, :6].flags.c_contiguous
    _shardfile.write_shard(tmp_path, meta, (0, 0), data.dtype, data)
    with pytest.raises(AssertionError, match="chunk-by-chunk"):
        # A shard cut by the array's edge pads its last chunks: the chunk-by-chunk path.
        _shardfile.write_shard(tmp_path, _meta((60, 48), shard, inner, dtype), (1, 0), data.dtype, data[:28])


def test_gather_buffers_are_reused_not_grown(tmp_path):
    shape, shard, inner, dtype = CASES[1]
    meta = _meta(shape, shard, inner, dtype)
    array = _array(shape, dtype)
    for _ in range(3):
        for cell in _shardfile.grid_cells(shape, shard):
            _shardfile.write_shard(tmp_path, meta, cell, array.dtype, array[cell[0] * 32 : (cell[0] + 1) * 32])
    assert 1 <= len(_shardfile._scratch) <= 2
    assert all(len(b) == _shardfile.GROUP_BYTES for b in _shardfile._scratch)


def test_short_writes_are_resumed_where_they_stopped(tmp_path, monkeypatch):
    """``writev`` may write fewer bytes than asked (a signal, a full pipe or quota): the writer
    carries on from the byte it stopped at, mid-chunk or mid-checksum alike."""
    shape, shard, inner, dtype = CASES[2]
    meta = _meta(shape, shard, inner, dtype)
    array = _array(shape, dtype)
    _shardfile.write_shard(tmp_path / "whole", meta, (0, 1), array.dtype, array[:, 24:])
    real = _shardfile.os.writev
    calls = []

    def short(fd, buffers):
        calls.append(len(buffers))
        first = memoryview(buffers[0]).cast("B")
        return real(fd, [first[:7]]) if len(first) > 7 else real(fd, [first])

    monkeypatch.setattr(_shardfile.os, "writev", short)
    _shardfile.write_shard(tmp_path / "short", meta, (0, 1), array.dtype, array[:, 24:])
    key = f"a/{meta.chunk_key((0, 1))}"
    assert len(calls) > (tmp_path / "whole" / key).stat().st_size // 7
    assert (tmp_path / "short" / key).read_bytes() == (tmp_path / "whole" / key).read_bytes()


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
    read_now = _shardfile.os.preadv
    monkeypatch.setattr(
        _shardfile, "_read_cached", lambda fd, view, at: cached and read_now(fd, [view], at) == len(view)
    )
    meta = _meta(shape, shard, inner, dtype)
    array = _array(shape, dtype)
    for cell in _shardfile.grid_cells(shape, shard):
        part = array[tuple(slice(c * s, (c + 1) * s) for c, s in zip(cell, shard))]
        _shardfile.write_shard(tmp_path, meta, cell, array.dtype, part)
    box = box_of(shape)
    want = array[tuple(slice(a, b) for a, b in box)]
    plain, ahead = np.empty_like(want), np.empty_like(want)
    plain_bytes = _shardfile.read_box(tmp_path, meta, box, plain)
    ahead_bytes = _shardfile.read_box(tmp_path, meta, box, ahead, prefetch=True)
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
    monkeypatch.setattr(_shardfile, "READ_RUN_BYTES", 4 * 48 * 4)
    monkeypatch.setattr(_shardfile, "_read_cached", lambda *a: False)  # as if the file were cold
    readers = []
    real = _shardfile.os.preadv
    monkeypatch.setattr(
        _shardfile.os,
        "preadv",
        lambda fd, bufs, at: readers.append(threading.current_thread().name) or real(fd, bufs, at),
    )
    out = np.empty_like(array)
    _shardfile.read_box(tmp_path, meta, ((0, 64), (0, 48)), out, prefetch=True)
    assert out.tobytes() == array.tobytes()
    assert len(readers) == 16 and set(readers) == {"layoutckpt-read-ahead"}

    path = tmp_path / "a" / meta.chunk_key((0, 0))
    data = bytearray(path.read_bytes())
    data[5 * (4 * 48 * 4 + 4) + 10] ^= 0xFF  # inside the sixth chunk
    path.write_bytes(bytes(data))
    readers.clear()
    with pytest.raises(_shardfile.Damaged, match=r"inner chunk 5 of shard c\.0\.0 fails its crc32c"):
        _shardfile.read_box(tmp_path, meta, ((0, 64), (0, 48)), out, prefetch=True)
    assert not any(t.name == "layoutckpt-read-ahead" for t in threading.enumerate())
    assert 6 <= len(readers) <= 6 + _shardfile.PREFETCH_DEPTH  # it stopped soon after


def test_a_file_the_page_cache_holds_is_read_on_the_callers_thread(tmp_path, monkeypatch):
    """Where the first run comes from the page cache without waiting, the shard is read on the
    caller's thread, the first run not read twice; where it does not, on the read-ahead thread."""
    import threading

    shape, shard, inner, dtype = (64, 48), (64, 48), (4, 48), "float32"  # 16 runs of one chunk
    meta = _meta(shape, shard, inner, dtype)
    array = _array(shape, dtype)
    _shardfile.write_shard(tmp_path, meta, (0, 0), array.dtype, array)
    monkeypatch.setattr(_shardfile, "READ_RUN_BYTES", 4 * 48 * 4)
    readers = []
    real = _shardfile.os.preadv
    monkeypatch.setattr(
        _shardfile.os,
        "preadv",
        lambda fd, bufs, at, *flags: readers.append((threading.current_thread().name, at)) or real(fd, bufs, at),
    )
    for cached in (True, False):
        monkeypatch.setattr(
            _shardfile, "_read_cached", lambda fd, view, at, cached=cached: cached and real(fd, [view], at) == len(view)
        )
        readers.clear()
        out = np.empty_like(array)
        _shardfile.read_box(tmp_path, meta, ((0, 64), (0, 48)), out, prefetch=True)
        assert out.tobytes() == array.tobytes()
        names = {name for name, _ in readers}
        assert names == ({threading.current_thread().name} if cached else {"layoutckpt-read-ahead"})
        assert len(readers) == (15 if cached else 16) and len({at for _, at in readers}) == len(readers)


def test_read_cached_reads_only_what_the_page_cache_holds(tmp_path):
    """``_read_cached`` fills the buffer from a file in the page cache and refuses one that was
    dropped from it; a file system that cannot tell (tmpfs) always refuses."""
    import errno
    import os

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
        assert _shardfile._read_cached(fd, view, 0) is tells
        assert not tells or view.tobytes() == data.tobytes()
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert _shardfile._read_cached(fd, np.zeros_like(data), 0) is False
    finally:
        os.close(fd)
