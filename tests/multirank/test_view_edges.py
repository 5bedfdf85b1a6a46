"""``Fused`` and ``Padded`` rules at their edges, on real gloo ranks: a padded array whose spec
also splits its other dimension, a fused tensor whose name has no dot, loaded without a
template, and a fused tensor stored as one plain array (saved without its ``Fused`` rule)."""

from __future__ import annotations

from pathlib import Path

import torch

import layoutckpt as lc
from tests.support.multirank import RankPool

VOCAB, ROWS, HIDDEN = 10, 6, 8  # a vocabulary of 10 padded to 2 x 6 rows, its columns split by dp
MESH = lc.Mesh({"tp": 2, "dp": 2})
PADDED = lc.Layout(MESH, [(r"^emb\.weight$", lc.Padded(lc.P("tp", "dp"), VOCAB)), (r".*", lc.P())])
Q = torch.arange(12.0).reshape(4, 3)
K = 100 + torch.arange(6.0).reshape(2, 3)
FUSED = lc.Layout(lc.Mesh({"tp": 2}), [(r"^qkv$", lc.Fused(lc.P("tp", None), [("q", 4), ("k", 2)])), (r".*", lc.P())])


def _full_embedding() -> torch.Tensor:
    return torch.arange(VOCAB * HIDDEN, dtype=torch.float32).reshape(VOCAB, HIDDEN)


def _padded_local(rank: int, padding: float) -> torch.Tensor:
    padded = torch.cat([_full_embedding(), torch.full((2 * ROWS - VOCAB, HIDDEN), padding)])
    at = MESH.coords(rank)
    cols = HIDDEN // 2
    return padded[at["tp"] * ROWS : (at["tp"] + 1) * ROWS, at["dp"] * cols : (at["dp"] + 1) * cols].clone()


def _padded_round_trip(rank: int, group, path: str) -> bool:
    lc.save(path, {"emb": {"weight": _padded_local(rank, padding=-1.0)}}, PADDED, group=group)
    like = {"emb": {"weight": torch.full((ROWS, HIDDEN // 2), 7.0)}}
    got = lc.load(path, PADDED, like=like, group=group)["emb"]["weight"]
    return torch.equal(got, _padded_local(rank, padding=0.0))  # the padding comes back as zeros


def test_a_padded_array_split_along_another_dimension_too_loads_back(ranks: RankPool, tmp_path: Path) -> None:
    path = str(tmp_path / "padded")
    assert ranks.run(_padded_round_trip, 4, path) == [True] * 4
    assert torch.equal(torch.from_numpy(lc.open(path).read("emb.weight")), _full_embedding())


def _fused_parts(rank: int, group, path: str) -> tuple[torch.Tensor, torch.Tensor]:
    lc.save(
        path,
        {"qkv": torch.cat([Q[2 * rank : 2 * rank + 2], K[rank : rank + 1]]), "b": torch.ones(2)},
        FUSED,
        group=group,
    )
    got = lc.load(path, FUSED, group=group)
    return got["qkv"]["q"], got["qkv"]["k"]


def test_a_fused_name_without_a_dot_loads_each_rank_its_rows_of_each_part(ranks: RankPool, tmp_path: Path) -> None:
    path = str(tmp_path / "fused")
    got = ranks.run(_fused_parts, 2, path)
    assert sorted(lc.open(path).keys()) == ["b", "qkv.k", "qkv.q"]
    for rank, (q, k) in enumerate(got):
        assert torch.equal(q, Q[2 * rank : 2 * rank + 2]) and torch.equal(k, K[rank : rank + 1])


def test_a_fused_tensor_stored_whole_loads_as_the_array_it_is(tmp_path: Path) -> None:
    """Saved without its ``Fused`` rule, ``qkv`` is one stored array: a load under the rule reads
    it as that array, as the template check already does, not as parts it does not have."""
    whole = torch.cat([Q, K])
    lc.save(tmp_path / "plain", {"qkv": whole})
    layout = lc.Layout(lc.Mesh({}), [(r"^qkv$", lc.Fused(lc.P(), [("q", 4), ("k", 2)]))])
    assert torch.equal(lc.load(tmp_path / "plain", layout, like={"qkv": torch.empty(6, 3)})["qkv"], whole)
