"""``Fused`` and ``Padded`` rules at their edges, on real gloo ranks: a padded array whose spec
also splits its other dimension, a fused tensor whose name has no dot, loaded without a
template, and a fused tensor stored as one plain array (saved without its ``Fused`` rule)."""

from __future__ import annotations

from pathlib import Path

import pytest
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


GATE = torch.arange(8.0).reshape(4, 2)
UP = 100 + torch.arange(8.0).reshape(4, 2)
GATE_UP = lc.Layout(lc.Mesh({"tp": 2}), [(r"^fc1$", lc.Fused(lc.P("tp", None), [("gate", 4), ("up", 4)]))])


def _gate_up_from_whole(rank: int, group, path: str) -> torch.Tensor:
    return lc.load(path, GATE_UP, like={"fc1": torch.empty(4, 2)}, group=group)["fc1"]


def test_a_fused_tensor_stored_whole_loads_each_rank_its_rows_of_each_part(ranks: RankPool, tmp_path: Path) -> None:
    """``[gate; up]`` saved by one process as one array, loaded on tp = 2 under its block
    ``Fused`` rule: each rank's tensor is its half of gate, then its half of up (not a plain
    half of the stored array, which would be all of gate on rank 0)."""
    path = str(tmp_path / "whole")
    lc.save(path, {"fc1": torch.cat([GATE, UP])})
    got = ranks.run(_gate_up_from_whole, 2, path)
    for rank, fc1 in enumerate(got):
        assert torch.equal(fc1, torch.cat([GATE[2 * rank : 2 * rank + 2], UP[2 * rank : 2 * rank + 2]]))


def test_a_fused_part_named_like_another_leaf_is_refused(tmp_path: Path) -> None:
    """Part q of ``a.qkv.weight`` is stored as ``a.qkv.q.weight``: a leaf of that name too would
    overwrite it (or be overwritten), whichever came last."""
    layout = lc.Layout(lc.Mesh({}), [(r"\.qkv\.weight$", lc.Fused(lc.P(), [("q", 2), ("k", 2)])), (r".*", lc.P())])
    state = {"a.qkv.weight": torch.arange(8.0).reshape(4, 2), "a.qkv.q.weight": torch.full((2, 2), 7.0)}
    with pytest.raises(lc.LayoutError, match=r"'a\.qkv\.q\.weight' is stored from two leaves"):
        lc.save(tmp_path / "ck", state, layout)
    assert not (tmp_path / "ck").exists()


def _save_uneven_padding(rank: int, group, path: str) -> str:
    emb = torch.arange(7 * 2, dtype=torch.float32).reshape(7, 2).chunk(2)[rank]  # 4 rows and 3
    layout = lc.Layout(lc.Mesh({"tp": 2}), [(r"^emb$", lc.Padded(lc.P("tp", None), 6))])
    try:
        lc.save(path, {"emb": emb}, layout, group=group)
    except lc.InconsistentShardsError as err:
        return str(err)
    return "saved"


def test_ranks_that_pad_to_different_lengths_are_refused(ranks: RankPool, tmp_path: Path) -> None:
    """A padded array's pieces must be one length: pieces of 4 and 3 rows made a checkpoint whose
    shards disagreed with its grid, committed and then unreadable."""
    path = str(tmp_path / "ck")
    for said in ranks.run(_save_uneven_padding, 2, path):
        assert "pad their pieces to different lengths (3 to 4 rows" in said
    assert not Path(path).exists()


def test_a_leaf_named_like_a_fused_part_must_be_split_as_that_part(tmp_path: Path) -> None:
    """A load infers from the name alone that ``x.qkv.q.weight`` is part q of ``x.qkv.weight``,
    and splits it by the Fused rule's spec: a save that split it otherwise is refused."""
    fused = lc.Fused(lc.P("tp", None), [("q", 2), ("k", 2)])
    mesh = lc.Mesh({"dp": 1, "tp": 1})
    state = {"x.qkv.q.weight": torch.ones(2, 2)}
    first = lc.Layout(mesh, [(r"\.q\.weight$", lc.P("dp", None)), (r"\.qkv\.weight$", fused), (r".*", lc.P())])
    with pytest.raises(lc.LayoutError, match=r"which a load splits by P\('tp', None\)"):
        lc.save(tmp_path / "refused", state, first)
    agreeing = lc.Layout(mesh, [(r"\.q\.weight$", lc.P("tp", None)), (r"\.qkv\.weight$", fused), (r".*", lc.P())])
    lc.save(tmp_path / "ck", state, agreeing)
    got = lc.load(tmp_path / "ck", agreeing)
    assert torch.equal(got["x"]["qkv"]["q"]["weight"], state["x.qkv.q.weight"])
