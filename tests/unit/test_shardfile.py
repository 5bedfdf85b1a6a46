"""Shard files written from a whole shard in memory (``save``'s path) against the chunk-by-chunk
path (``import_safetensors``'s, itself checked byte for byte against TensorStore in
``test_openness``): the same bytes, read back bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from layoutckpt.base._options import DEFAULT_IO, IOConfig
from layoutckpt.format._dtypes import numpy_dtype
from layoutckpt.format._format import ArrayMeta
from layoutckpt.format._shard import grid_cells
from layoutckpt.layout._layout import P
from layoutckpt.storage import _shardfile, _shardread

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
    tmp_path, shape, shard, inner, dtype, group_bytes
):
    # 64 bytes: one chunk per group; 1 MiB: every chunk of a grid row in one group.
    io = IOConfig(group_bytes=group_bytes)
    meta = _meta(shape, shard, inner, dtype)
    array = _array(shape, dtype)
    for cell in grid_cells(shape, shard):
        box = tuple(slice(c * s, (c + 1) * s) for c, s in zip(cell, shard))
        data = array[(*box, ...)]  # a view: not contiguous where a later dimension is split
        written = _shardfile.write_shard(tmp_path / "whole", meta, cell, data.dtype, data, io=io)
        origin = [c * s for c, s in zip(cell, shard)]

        def read(b, data=data, origin=origin):
            return data[(*(slice(lo - o, hi - o) for (lo, hi), o in zip(b, origin)), ...)]

        assert _shardfile.write_shard(tmp_path / "chunks", meta, cell, data.dtype, read) == written
        key = f"a/{meta.chunk_key(cell)}"
        assert (tmp_path / "whole" / key).read_bytes() == (tmp_path / "chunks" / key).read_bytes(), key
        assert (tmp_path / "whole" / key).stat().st_size == written
    out = np.empty(shape, numpy_dtype(dtype))
    _shardread.read_box(tmp_path / "whole", meta, tuple((0, n) for n in shape), out)
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
        for cell in grid_cells(shape, shard):
            _shardfile.write_shard(tmp_path, meta, cell, array.dtype, array[cell[0] * 32 : (cell[0] + 1) * 32])
    assert 1 <= len(_shardfile._scratch) <= 2
    assert all(len(b) == DEFAULT_IO.group_bytes for b in _shardfile._scratch)


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
