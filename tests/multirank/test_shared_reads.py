"""Loads whose replicas share their reads (``share_reads=True``), on 4 real gloo ranks.

What this file proves: under ``Mesh({"dp": 2, "tp": 2})`` the data-parallel replicas of each
tensor-parallel shard, and all four holders of a replicated array, each read a part of the box
and exchange the parts: every rank ends with the same bits as a load that reads alone, in new
tensors and in place, while the ranks together read about half the bytes from storage; ranks
that load different arrays read alone; a rank whose plan fails fails every rank's load; damage to a
part one rank reads fails the load on every rank, naming it, instead of leaving the others
waiting. The parts of fused and padded leaves (a fused gate-up projection, a padded
vocabulary) are shared like any other box.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import layoutckpt as lc
from layoutckpt.storage import _shardread
from tests.support.oracle import local_shard

AXES = {"dp": 2, "tp": 2}
RULES = [(r"^w\d", lc.P("tp", None)), (r"^emb$", lc.P(("dp", "tp"))), (r".*", lc.P())]
SPECS = {"w0": ("tp", None), "w1": ("tp", None), "emb": (("dp", "tp"),), "norm": (), "step_scale": ()}


def full(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    shapes = {"w0": (64, 48), "w1": (40, 24), "emb": (96, 16), "norm": (48,), "step_scale": ()}
    t = torch.randn(shapes[name], generator=g)
    return t.to(torch.bfloat16) if name == "w1" else t


def layout() -> lc.Layout:
    return lc.Layout(lc.Mesh(AXES), RULES)


def _save(rank, group, path):
    state = {name: full(name) for name in SPECS}
    lc.save(path, state, lc.Layout(lc.Mesh({"dp": 1}), [(r".*", lc.P())]), inner_chunk_bytes=512)
    return True


def _load(rank, group, path, share, inplace, select):
    like = None
    if inplace:
        like = {n: torch.zeros_like(local_shard(full(n), SPECS[n], AXES, rank)) for n in SPECS}
    before = _shardread.bytes_read()
    out = lc.load(path, layout(), group=group, share_reads=share, like=like, inplace=inplace, select=select)
    read = _shardread.bytes_read() - before
    for name, got in out.items():
        want = local_shard(full(name), SPECS[name], AXES, rank)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), name
        if inplace:
            assert got is like[name]
    return read


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("shared") / "ck")
    _save(0, None, path)
    return path


@pytest.mark.parametrize("inplace", [False, True])
def test_replicas_read_parts_and_exchange_them(ranks, saved, inplace):
    alone = ranks.run(_load, 4, saved, False, inplace, None)
    shared = ranks.run(_load, 4, saved, True, inplace, None)
    # w0, w1 are read by 2 replicas each, norm and step_scale by 4, emb by one: together the
    # ranks now read about half (the parts' indexes and binding blocks aside).
    assert sum(shared) < 0.6 * sum(alone), (shared, alone)
    assert all(s <= a for s, a in zip(shared, alone)), (shared, alone)


def _differ(rank, group, path, share):
    select = (lambda n: n != "norm") if rank == 0 else None
    return _load(rank, group, path, share, False, select)


def test_ranks_that_load_different_arrays_read_alone(ranks, saved):
    """Rank 0 selects one array fewer: the ranks do not agree to share, and each reads its own
    boxes whole (the same bytes as without the option)."""
    assert ranks.run(_differ, 4, saved, True) == ranks.run(_differ, 4, saved, False)


def _load_damaged(rank, group, path):
    try:
        lc.load(path, layout(), group=group, share_reads=True)
    except (lc.IntegrityError, RuntimeError) as err:
        return type(err).__name__, str(err)
    return None


def test_damage_to_one_ranks_part_fails_every_rank(ranks, saved, tmp_path):
    """The last chunk row of ``norm``'s only shard is read by one of the four sharers: each
    rank fails with ``IntegrityError``, the others naming that rank, and none hangs."""
    copy = tmp_path / "ck"
    shutil.copytree(saved, copy)
    shard = Path(copy, "norm", "c.0")
    raw = bytearray(shard.read_bytes())
    raw[0] ^= 0xFF  # the first chunk's first byte: its crc32c fails
    shard.write_bytes(bytes(raw))
    got = ranks.run(_load_damaged, 4, str(copy))
    assert all(g is not None and g[0] == "IntegrityError" for g in got), got
    assert sum("norm" in g[1] and "other ranks" not in g[1] for g in got) == 1, got
    assert all("norm" in g[1] for g in got), got
    np.testing.assert_equal(len(got), 4)


def _one_bad_template(rank, group, path, share):
    like = {n: torch.zeros_like(local_shard(full(n), SPECS[n], AXES, rank)) for n in SPECS}
    if rank == 1:
        like["w0"] = torch.zeros(3, 3)  # not the shape rank 1 loads
    try:
        lc.load(path, layout(), group=group, share_reads=share, like=like)
    except lc.TemplateMismatchError as err:
        return str(err)
    return None


@pytest.mark.parametrize("share", [False, True])
def test_a_rank_whose_plan_fails_fails_the_load_on_every_rank(ranks, saved, share):
    """Rank 1's template is wrong: it raises ``TemplateMismatchError`` naming the array, and
    the other ranks, told so before any rank reads, raise one naming rank 1 and the array,
    rather than go on alone with a state their peer did not load."""
    got = ranks.run(_one_bad_template, 4, saved, share, timeout=60)
    assert all(g is not None and "w0" in g for g in got), got
    assert ["other ranks" in g for g in got] == [True, False, True, True], got
    assert all("rank 1: TemplateMismatchError" in g for g in got[:1] + got[2:]), got


VIEWS = [
    (r"^fc1\.weight$", lc.Fused(lc.P("tp", None), [("gate", 64), ("up", 64)])),
    (r"^emb\.weight$", lc.Padded(lc.P("tp", None), size=50)),
]


def _stored_views() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {n: torch.randn(shape, generator=g) for n, shape in VIEW_SHAPES.items()}


VIEW_SHAPES = {"fc1.gate.weight": (64, 16), "fc1.up.weight": (64, 16), "emb.weight": (50, 16)}


def _views_expected(rank: int) -> dict[str, torch.Tensor]:
    """This rank's fused [gate; up] rows and its 26 rows of the vocabulary padded to 52."""
    tp = rank % 2
    full_ = _stored_views()
    fc1 = torch.cat([full_["fc1.gate.weight"][32 * tp : 32 * tp + 32], full_["fc1.up.weight"][32 * tp : 32 * tp + 32]])
    emb = torch.zeros(52, 16)
    emb[:50] = full_["emb.weight"]
    return {"fc1.weight": fc1, "emb.weight": emb[26 * tp : 26 * tp + 26]}


def _load_views(rank, group, path, share, inplace):
    like = {n: torch.zeros_like(t) for n, t in _views_expected(rank).items()}
    before = _shardread.bytes_read()
    out = lc.load(path, lc.Layout(lc.Mesh(AXES), VIEWS), group=group, share_reads=share, like=like, inplace=inplace)
    read = _shardread.bytes_read() - before
    for name, want in _views_expected(rank).items():
        assert torch.equal(out[name], want), name
    return read


@pytest.mark.parametrize("inplace", [False, True])
def test_parts_of_fused_and_padded_leaves_are_shared(ranks, tmp_path, inplace):
    """Each tensor-parallel rank's gate and up rows and its vocabulary rows are read by its two
    data-parallel replicas: sharing, each reads about half of them."""
    path = str(tmp_path / "ck")
    lc.save(path, _stored_views(), lc.Layout(lc.Mesh({"dp": 1}), [(r".*", lc.P())]), inner_chunk_bytes=512)
    alone = ranks.run(_load_views, 4, path, False, inplace)
    shared = ranks.run(_load_views, 4, path, True, inplace)
    assert sum(shared) < 0.7 * sum(alone), (shared, alone)
    assert all(s < a for s, a in zip(shared, alone)), (shared, alone)
