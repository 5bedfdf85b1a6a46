"""Replica-parallel writes on real ranks: one replicated 128 MiB tensor saved by 4 gloo ranks is
written by all of them (bytes per rank, max/mean <= 1.5), and reads back bit for bit, whole and
under another layout."""

from __future__ import annotations

import numpy as np
import torch

import layoutckpt as lc
from tests.support.multirank import RankPool


def tensor() -> torch.Tensor:
    return torch.arange(8192 * 4096, dtype=torch.float32).reshape(8192, 4096)  # 128 MiB


def _save(rank: int, group, path: str) -> int:
    result = lc.save(path, {"w": tensor()}, lc.Layout(lc.Mesh({"dp": 4}), [(".*", lc.P())]), group=group)
    return result.bytes_written


def _load(rank: int, group, path: str) -> bool:
    layout = lc.Layout(lc.Mesh({"tp": 2}), [(".*", lc.P(None, "tp"))])
    got = lc.load(path, layout, group=group)["w"]
    return torch.equal(got, tensor().chunk(2, dim=1)[rank])


def test_a_replicated_tensor_is_written_by_every_replica(ranks: RankPool, tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    written = np.array(ranks.run(_save, 4, path))
    assert written.sum() == 128 << 20
    assert written.max() / written.mean() <= 1.5, written
    assert lc.open(path).info("w").shard_shape[0] < 8192
    assert np.array_equal(lc.open(path).read("w"), tensor().numpy())
    assert ranks.run(_load, 2, path) == [True, True]
