"""Large shards written past the page cache (``O_DIRECT``): the same bytes as through it, a file
system or a write that refuses O_DIRECT goes on through the page cache, and a failed write
gives its buffers back."""

from __future__ import annotations

import errno
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

import layoutckpt as lc
from layoutckpt.format._format import ArrayMeta
from layoutckpt.format._shard import grid_cells
from layoutckpt.layout._layout import P
from layoutckpt.storage import _os, _shardfile, _shardread

BLOCK = 8192  # IOConfig.direct_bytes in these tests: two aligned blocks, so a shard spans several writes
DIRECT = lc.IOConfig(direct_bytes=BLOCK)
BUFFERED = lc.IOConfig(direct_io=False)


def _accepts_direct(directory) -> bool:
    """Whether the file system of ``directory`` opens files with O_DIRECT. Where it does not
    (tmpfs before Linux 6.6), the tests below check that the same files are written through the page cache."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = directory / "probe"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)
    return True


@pytest.fixture
def small_blocks(tmp_path, monkeypatch):
    """An empty buffer pool, and a count of the O_DIRECT sinks made."""
    monkeypatch.setattr(_shardfile, "_aligned", [])
    made = []
    real = _shardfile._Direct.__init__

    def counting(self, fd, *args):
        made.append(fd)
        real(self, fd, *args)

    monkeypatch.setattr(_shardfile._Direct, "__init__", counting)
    return made


# (array shape, shard shape, inner chunk shape, dtype): whole rows (written from the source),
# column cuts (gathered), bf16; none a whole number of 4096-byte blocks, so the last is padded.
# Gathered chunks go straight into the blocks where they fit: float64 elements then sit at
# offsets that are no multiple of 8 (each chunk is followed by 4 checksum bytes), and chunks
# larger than a block never fit.
CASES = [
    ((256, 100), (128, 100), (8, 100), "float32"),
    ((256, 100), (128, 100), (8, 10), "float32"),
    ((90, 130), (90, 130), (30, 13), "bfloat16"),
    ((60, 90), (60, 90), (6, 9), "float64"),
    ((64, 2048), (64, 2048), (8, 256), "float32"),
]


def _meta(shape, shard, inner, dtype) -> ArrayMeta:
    return ArrayMeta("a", shape, dtype, shard, inner, P(*([None] * len(shape))))


def _array(shape, dtype) -> np.ndarray:
    bits = np.random.default_rng(0).integers(0, 256, size=int(np.prod(shape)) * 4, dtype=np.uint8)
    if dtype == "float64":
        return (
            np.random.default_rng(0)
            .integers(0, 256, size=int(np.prod(shape)) * 8, dtype=np.uint8)
            .view(np.float64)
            .reshape(shape)
        )
    if dtype == "bfloat16":
        return torch.from_numpy(bits.view(np.float32)).to(torch.bfloat16).view(torch.int16).numpy().reshape(shape)
    return bits.view(np.float32).reshape(shape)


def _write_every_shard(root, meta, array, io=BUFFERED) -> None:
    for cell in grid_cells(meta.shape, meta.shard_shape):
        box = tuple(slice(c * s, (c + 1) * s) for c, s in zip(cell, meta.shard_shape))
        data = array[box]
        assert _shardfile.write_shard(root, meta, cell, data.dtype, data, io=io) == os.path.getsize(
            root / "a" / meta.chunk_key(cell)
        )


def _files(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(("shape", "shard", "inner", "dtype"), CASES)
def test_a_shard_written_past_the_page_cache_has_the_same_bytes(tmp_path, small_blocks, shape, shard, inner, dtype):
    meta = _meta(shape, shard, inner, dtype)
    array = _array(shape, dtype)
    _write_every_shard(tmp_path / "buffered", meta, array)
    assert small_blocks == []
    _write_every_shard(tmp_path / "direct", meta, array, DIRECT)
    shards = len(list(grid_cells(shape, shard)))
    assert len(small_blocks) == (shards if _accepts_direct(tmp_path) else 0)
    direct, buffered = _files(tmp_path / "direct"), _files(tmp_path / "buffered")
    assert direct == buffered
    assert any(len(b) % 4096 for b in direct.values())  # a padded last block was cut back
    out = np.empty(shape, array.dtype)
    _shardread.read_box(tmp_path / "direct", meta, tuple((0, n) for n in shape), out)
    assert out.tobytes() == array.tobytes()


@pytest.mark.parametrize("elements", [2042, 2000, 3000])
def test_a_block_size_off_the_alignment_writes_the_same_bytes(tmp_path, small_blocks, elements):
    """``direct_bytes`` of 5000 is rounded up to whole 4096-byte blocks: 2,042 float32 make a
    shard of exactly 8,192 bytes (two blocks, nothing to cut back), the others end mid-block."""
    meta = _meta((elements,), (elements,), (elements,), "float32")
    array = _array((elements,), "float32")
    _write_every_shard(tmp_path / "buffered", meta, array)
    _write_every_shard(tmp_path / "direct", meta, array, lc.IOConfig(direct_bytes=5000))
    assert len(small_blocks) == (1 if _accepts_direct(tmp_path) else 0)
    assert _files(tmp_path / "direct") == _files(tmp_path / "buffered")
    out = np.empty((elements,), np.float32)
    _shardread.read_box(tmp_path / "direct", meta, ((0, elements),), out)
    assert out.tobytes() == array.tobytes()


def test_gathered_chunks_go_through_the_scratch_buffer_only_across_blocks(tmp_path, monkeypatch):
    """The block sink driven on a plain file (its writes need no O_DIRECT), so that this holds
    on any file system: every chunk is gathered into the blocks at its place but the one that
    straddles each block boundary, and the file is the one written through the page cache."""
    through_scratch = []
    real = _shardfile._write_group

    def counting(sink, buffer, start, n, chunk_bytes):
        through_scratch.append(n)
        real(sink, buffer, start, n, chunk_bytes)

    monkeypatch.setattr(_shardfile, "_write_group", counting)
    shape, shard, inner, dtype = CASES[1]
    array = _array(shape, dtype)[: shard[0]]  # one shard of 160 chunks of 324 bytes, 25.3 to a block
    meta = _meta(shape, shard, inner, dtype)
    with ThreadPoolExecutor(2) as threads, open(tmp_path / "blocks", "wb") as f:
        sink = _shardfile._Direct(f.fileno(), threads, BLOCK)
        try:
            _shardfile.encode(sink, meta, (0, 0), array.dtype, array, DIRECT.group_bytes)
            sink.finish()
        finally:
            sink.release()
    assert through_scratch == [1] * ((160 * (8 * 10 * 4 + 4)) // BLOCK)
    monkeypatch.setattr(_shardfile, "_write_group", real)
    _write_every_shard(tmp_path / "buffered", meta, _array(shape, dtype))
    assert (tmp_path / "blocks").read_bytes() == (tmp_path / "buffered" / "a" / meta.chunk_key((0, 0))).read_bytes()


def test_small_and_compressed_shards_stay_in_the_page_cache(tmp_path, small_blocks):
    shape, shard, inner, dtype = CASES[0]
    array = _array(shape, dtype)
    _write_every_shard(tmp_path / "small", _meta((8, 100), (8, 100), inner, dtype), array[:8], DIRECT)
    meta = ArrayMeta("a", shape, dtype, shard, inner, P(None, None), compression="zstd")
    _write_every_shard(tmp_path / "zstd", meta, array, DIRECT)
    assert small_blocks == []


def test_a_file_system_that_refuses_o_direct_is_written_through_the_page_cache(tmp_path, small_blocks, monkeypatch):
    """tmpfs before Linux 6.6 and some FUSE file systems refuse O_DIRECT at open (EINVAL)."""
    real = os.open
    refused = []

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            refused.append(path)
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real(path, flags, *args)

    meta = _meta(*CASES[1])
    array = _array(CASES[1][0], CASES[1][3])
    _write_every_shard(tmp_path / "buffered", meta, array)
    monkeypatch.setattr(_os.os, "open", no_direct)
    _write_every_shard(tmp_path / "refused", meta, array, DIRECT)
    assert len(refused) == 2 and small_blocks == []
    assert _files(tmp_path / "refused") == _files(tmp_path / "buffered")


def test_a_write_that_o_direct_refuses_goes_on_through_the_page_cache(tmp_path, small_blocks, monkeypatch):
    """A file system may take the flag at open and refuse the writes (larger blocks): the first
    refused write clears O_DIRECT on the file, and it is written through the page cache."""
    real = os.pwrite
    refused = []

    def picky(fd, data, offset):
        if _os.is_direct(fd):
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    assert _same_through(tmp_path, monkeypatch, picky)
    files = 2 if _accepts_direct(tmp_path) else 0
    # Refused once per file, then no more O_DIRECT; twice where its two blocks were in flight
    # together before the first refusal cleared the flag.
    assert len(small_blocks) == files and files <= len(refused) <= 2 * files
    assert refused.count(0) == files


def test_a_short_write_past_the_page_cache_goes_on_through_it(tmp_path, small_blocks, monkeypatch):
    """A write past the page cache that returns short leaves the rest unaligned, which O_DIRECT
    refuses: the rest goes through the page cache, and the file has the same bytes."""
    real = os.pwrite
    shorts = []

    def short(fd, data, offset):
        if _os.is_direct(fd) and offset == BLOCK and len(data) == BLOCK:  # the second block's write
            real(fd, data[:4096], offset)
            shorts.append(offset)
            return 1000  # as if the write stopped there: the next one starts unaligned
        return real(fd, data, offset)

    assert _same_through(tmp_path, monkeypatch, short)
    assert len(shorts) == (2 if _accepts_direct(tmp_path) else 0)  # one per shard file


def _same_through(tmp_path, monkeypatch, pwrite) -> bool:
    """Whether ``CASES[0]`` written with ``DIRECT`` through the fake ``pwrite`` has the bytes it
    has written through the page cache."""
    meta = _meta(*CASES[0])
    array = _array(CASES[0][0], CASES[0][3])
    _write_every_shard(tmp_path / "buffered", meta, array)
    monkeypatch.setattr(_os.os, "pwrite", pwrite)
    _write_every_shard(tmp_path / "direct", meta, array, DIRECT)
    return _files(tmp_path / "direct") == _files(tmp_path / "buffered")


def test_a_failed_write_raises_and_gives_its_buffers_back(tmp_path, small_blocks, monkeypatch):
    real_pwrite, real_writev = os.pwrite, os.writev
    calls = []

    def full(real):
        def write(*args):
            calls.append(args[-1])
            if len(calls) == 3:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(*args)

        return write

    meta = _meta(*CASES[0])
    array = _array(CASES[0][0], CASES[0][3])
    monkeypatch.setattr(_os.os, "pwrite", full(real_pwrite))
    monkeypatch.setattr(_os.os, "writev", full(real_writev))  # where O_DIRECT is refused
    with pytest.raises(OSError, match="No space left"):
        _write_every_shard(tmp_path / "full", meta, array, DIRECT)
    pooled = 2 if _accepts_direct(tmp_path) else 0
    assert len(_shardfile._aligned) == pooled  # both of the sink's buffers, nothing still in flight
    monkeypatch.setattr(_os.os, "pwrite", real_pwrite)
    monkeypatch.setattr(_os.os, "writev", real_writev)
    _write_every_shard(tmp_path / "after", meta, array, DIRECT)
    assert len(_shardfile._aligned) == pooled  # reused, not grown
    _write_every_shard(tmp_path / "buffered", meta, array)
    assert _files(tmp_path / "after") == _files(tmp_path / "buffered")


@pytest.mark.parametrize("direct_io", [True, False])
def test_save_writes_large_shards_past_the_page_cache_unless_told_not_to(tmp_path, monkeypatch, direct_io):
    opened = []
    real = _os.create_file

    def spy(path, *, direct=False):
        fd = real(path, direct=direct)
        opened.append((path, _os.is_direct(fd)))
        return fd

    monkeypatch.setattr(_os, "create_file", spy)
    g = torch.Generator().manual_seed(5)
    big = torch.randn(2048, 1100, generator=g)  # 9 MB: past direct_bytes, not a whole number of blocks
    state = {"big": big, "small": torch.randn(64, generator=g)}
    lc.save(tmp_path / "ck", state, io=lc.IOConfig(direct_io=direct_io))
    shards = [d for path, d in opened if path.name.startswith("c.")]
    assert sorted(shards) == [False, direct_io and _accepts_direct(tmp_path)]
    back = lc.load(tmp_path / "ck")
    assert torch.equal(back["big"], big) and torch.equal(back["small"], state["small"])
