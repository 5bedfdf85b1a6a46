"""The key-value store writer (``storage._writers.ShardObjectWriter``): layoutckpt encodes each
whole shard and stores it as one value, the same bytes as the shard file a local save writes,
with at most ``IOConfig.budget_bytes`` of encoded shards waiting for their store."""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest

from layoutckpt.base._options import IOConfig
from layoutckpt.format._format import ArrayMeta
from layoutckpt.layout._spec import P
from layoutckpt.storage._commit import new_token
from layoutckpt.storage._location import Location, locate
from layoutckpt.storage._writers import BoxWriter, ShardObjectWriter

ROWS = 8  # rows per shard: 70 rows make 9 shards, the last one cut at the array's edge


class _Counted:
    """A shard's elements at hand; counts its releases."""

    def __init__(self, data: np.ndarray) -> None:
        self.data = data
        self.released = 0

    def wait(self) -> np.ndarray:
        return self.data

    def release(self) -> None:
        self.released += 1


def _meta(data: np.ndarray, compression: str | None = None) -> ArrayMeta:
    dtype = {"float32": "float32", "float64": "float64", "int16": "int16"}[data.dtype.name]
    return ArrayMeta("w", data.shape, dtype, (ROWS, data.shape[1]), (4, 8), P(), "numpy", compression)


def _write_all(staging: Location, meta: ArrayMeta, data: np.ndarray, io: IOConfig) -> list[_Counted]:
    sources = []
    with _writer(staging, io) as writer:
        for start in range(0, data.shape[0], ROWS):
            stop = min(start + ROWS, data.shape[0])
            sources.append(_Counted(data[start:stop]))
            writer.write(meta, ((start, stop), (0, data.shape[1])), sources[-1])
        assert writer.join() == data.nbytes
    return sources


def _writer(staging: Location, io: IOConfig) -> BoxWriter:
    """The location's own writer, or the key-value store writer itself (a memory location's
    own may become another)."""
    return staging.box_writer(io) if staging.is_local else ShardObjectWriter(staging, io)


def _keys(meta: ArrayMeta, rows: int) -> list[str]:
    return [f"{meta.path}/{meta.chunk_key((i, 0))}" for i in range(-(-rows // ROWS))]


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_every_value_is_the_shard_file_a_local_save_writes(tmp_path: Path, compression: str | None) -> None:
    data = np.arange(70 * 40, dtype=np.float32).reshape(70, 40)
    meta = _meta(data, compression)
    local = locate(tmp_path / "ck").staging(new_token())
    memory = locate(f"memory://object-writer-{uuid.uuid4().hex[:8]}/ck").staging(new_token())
    for staging in (local, memory):
        _write_all(staging, meta, data, IOConfig())
    for key in _keys(meta, 70):
        stored = memory.read(key, 1 << 30)
        assert stored is not None and stored == local.read(key, 1 << 30), key


def test_shards_beyond_the_budget_wait_for_their_store_and_every_source_goes_back() -> None:
    data = np.arange(64 * 32, dtype=np.float64).reshape(64, 32)
    meta = _meta(data)
    staging = locate(f"memory://object-writer-{uuid.uuid4().hex[:8]}/ck").staging(new_token())
    # A budget below one shard: each shard's store waits for the one before it.
    sources = _write_all(staging, meta, data, IOConfig(budget_bytes=1, threads=2))
    assert [s.released for s in sources] == [1] * 8
    index_bytes = 16 * 2 * 4 + 4  # a (2, 4) grid of inner chunks
    for key in _keys(meta, 64):
        assert len(staging.read(key, 1 << 30)) == ROWS * 32 * 8 + 8 * 4 + index_bytes
