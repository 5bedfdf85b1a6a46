"""Packed checkpoints saved by real gloo ranks: each rank writes its own OCDBT database under
``packs/RRRRR/`` and rank 0's commit merges them into one at the root.

What this file proves: 400 arrays split FSDP-style over 4 ranks (1600 shards, ``packing="auto"``
packs them) are a handful of files per rank and at the root, where the same state in plain files
is a file per shard; the packed checkpoint loads bit for bit under another mesh on 2 ranks and
whole in one plain process, and under its own mesh each rank reads its own database's index
only; per-rank documents stay plain files; and a rank that writes no box
at all still commits a packed checkpoint that loads.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import layoutckpt as lc
from layoutckpt.storage import _packindex, _packs
from tests.support.multirank import RankPool

N = 400
SAVE_LAYOUT = lc.Layout(lc.Mesh({"dp": 4}), [(r".*", lc.P("dp"))])
LOAD_LAYOUT = lc.Layout(lc.Mesh({"tp": 2}), [(r".*", lc.P(None, "tp"))])
# A data file per writing thread below the default pack_bytes
# (tests/integration/test_packing.py, test_a_rank_writes_a_data_file_per_thread).
MOST_DATA_FILES_PER_RANK = lc.IOConfig().threads


def full(i: int) -> torch.Tensor:
    """Array ``i`` whole, (8, 6): float32, bfloat16 or int64 by ``i``, random bits."""
    g = torch.Generator().manual_seed(100 + i)
    kind = i % 3
    if kind == 0:
        return torch.randn(8, 6, generator=g)
    if kind == 1:
        return torch.randint(-(1 << 15), 1 << 15, (8, 6), generator=g, dtype=torch.int16).view(torch.bfloat16)
    return torch.randint(-(1 << 62), 1 << 62, (8, 6), generator=g, dtype=torch.int64)


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bits(a) == bits(b)


# --- rank functions -------------------------------------------------------------------------


def _save(rank, group, path, packing):
    state = {f"l{i}": {"w": full(i).chunk(4)[rank].clone()} for i in range(N)}
    state["step"] = 5
    result = lc.save(path, state, SAVE_LAYOUT, group=group, packing=packing, rank_state={"rank": rank})
    return result.arrays_written


def _load_fsdp(rank, group, path):
    """This rank's rows again, and the B+tree nodes read, by database, meanwhile."""
    before = _packindex.nodes_read()
    like = {f"l{i}": {"w": torch.zeros(2, 6, dtype=full(i).dtype)} for i in range(N)}
    out = lc.load(path, SAVE_LAYOUT, like={**like, "step": 0}, group=group)
    nodes = {base: n - before.get(base, 0) for base, n in _packindex.nodes_read().items() if n != before.get(base, 0)}
    return [i for i in range(N) if not same(out[f"l{i}"]["w"], full(i).chunk(4)[rank])], nodes


HSDP_LAYOUT = lc.Layout(lc.Mesh({"pp": 2, "dp": 2}), [(r".*", lc.P("dp"))])


def _save_hsdp(rank, group, path):
    piece = rank % 2  # replicated over pp: ranks 0 and 2 hold piece 0, ranks 1 and 3 piece 1
    state = {f"l{i}": {"w": full(i).chunk(2)[piece].clone()} for i in range(N)}
    return lc.save(path, state, HSDP_LAYOUT, group=group, packing="ocdbt").arrays_written


def _load_hsdp(rank, group, path):
    before = _packindex.nodes_read()
    like = {f"l{i}": {"w": torch.zeros(4, 6, dtype=full(i).dtype)} for i in range(N)}
    out = lc.load(path, HSDP_LAYOUT, like=like, group=group)
    nodes = {base: n - before.get(base, 0) for base, n in _packindex.nodes_read().items() if n != before.get(base, 0)}
    return [i for i in range(N) if not same(out[f"l{i}"]["w"], full(i).chunk(2)[rank % 2])], nodes


def _load_tp2(rank, group, path):
    out = lc.load(path, LOAD_LAYOUT, group=group)
    bad = [i for i in range(N) if not same(out[f"l{i}"]["w"], full(i).chunk(2, dim=1)[rank])]
    mine = lc.load_rank_state(path, group=group, redistribute=lambda states, r, world: states[2 * r : 2 * r + 2])
    return bad, out["step"], mine


# --- helpers ----------------------------------------------------------------------------------


def relative(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def packed_counts(root: Path, world: int) -> dict[str, int]:
    """How many files each rank's database and the root hold, asserting that nothing else is
    stored but the marker and the per-rank documents."""
    names = relative(root)
    counts = {}
    for r in range(world):
        base = _packs.rank_base(r)
        mine = [n for n in names if n.startswith(base + "/")]
        assert f"{base}/manifest.ocdbt" in mine, names
        assert all(n == f"{base}/manifest.ocdbt" or n.startswith(f"{base}/d/") for n in mine), mine
        counts[base] = len(mine)
    database = [n for n in names if n == "manifest.ocdbt" or n.startswith("d/")]
    counts["root"] = len(database)
    hidden = [n for n in names if n.startswith(".")]
    counts["hidden"] = len(hidden)
    assert all(n.startswith(".rank_state/") for n in hidden), hidden
    counted = sum(counts.values()) + 1  # and the marker
    assert "zarr.json" in names and counted == len(names), (counts, names)
    return counts


# --- 9. FSDP-style over 4 ranks ---------------------------------------------------------------


def test_fsdp_packed_is_a_few_files_per_rank_and_loads_under_another_mesh(ranks: RankPool, tmp_path):
    path = tmp_path / "packed"
    assert ranks.run(_save, 4, str(path), "auto") == [N] * 4
    rd = lc.open(path)
    assert rd.meta.packing == "ocdbt"
    assert rd.info("l0.w").shard_shape == (2, 6)

    counts = packed_counts(path, 4)
    for r in range(4):
        # the manifest and a data file per writing thread
        assert 2 <= counts[_packs.rank_base(r)] <= 1 + MOST_DATA_FILES_PER_RANK, counts
    assert 2 <= counts["root"] <= 3, counts  # the merged manifest and its B-tree
    assert counts["hidden"] >= 4, counts  # each rank's state, a plain file
    assert len(relative(path)) < 1600 // 10, counts
    assert not list(path.glob("**/c.*"))

    # Under the mesh it was saved with, each rank finds its shards in its own database: a
    # quarter of the keys, where the merged root holds them all.
    assert rd.meta.writers == {f"l{i}.w": (0, 1) for i in range(N)}
    for r, (bad, nodes) in enumerate(ranks.run(_load_fsdp, 4, str(path))):
        assert bad == [] and nodes == {f"{_packs.rank_base(r)}/": 1}, nodes

    # Under another mesh on 2 ranks, and whole in one plain process.
    for r, (bad, step, rank_state) in enumerate(ranks.run(_load_tp2, 2, str(path))):
        assert bad == [] and step == 5 and rank_state == [{"rank": 2 * r}, {"rank": 2 * r + 1}]
    out = lc.load(path)
    assert out["step"] == 5
    assert [i for i in range(N) if not same(out[f"l{i}"]["w"], full(i))] == []
    assert lc.open(path).rank_states() == [{"rank": r} for r in range(4)]


def test_hsdp_shards_are_found_in_their_replicas_databases(ranks: RankPool, tmp_path):
    """Sharded over dp, replicated over pp: the save's balance picks which replica writes each
    shard (a rule names it where the choice is regular, as here for most arrays), and each load
    looks in its piece's two holders' databases only, never in the merged root."""
    path = tmp_path / "hsdp"
    assert sum(ranks.run(_save_hsdp, 4, str(path))) == 2 * N
    for r, (bad, nodes) in enumerate(ranks.run(_load_hsdp, 4, str(path))):
        holders = {f"{_packs.rank_base(h)}/" for h in (r % 2, r % 2 + 2)}
        assert bad == [] and nodes and set(nodes) <= holders, nodes


def test_fsdp_in_files_is_a_file_per_shard(ranks: RankPool, tmp_path):
    path = tmp_path / "files"
    assert ranks.run(_save, 4, str(path), "files") == [N] * 4
    assert lc.open(path).meta.packing == "files"
    shards = list(path.glob("**/c.*"))
    assert len(shards) == 4 * N >= 1600
    assert not (path / "packs").exists() and not (path / "manifest.ocdbt").exists()
    with lc.open(path) as rd:
        assert bits(torch.from_numpy(np.ascontiguousarray(rd.read("l3.w")))) == bits(full(3))


# --- 10. a rank with nothing to write ------------------------------------------------------------

UNEVEN = torch.arange(3 * 4, dtype=torch.float32).reshape(3, 4)  # 3 rows over 4 ranks: rank 3 has none
REPLICATED = torch.arange(10, dtype=torch.int64)


def _save_uneven(rank, group, path):
    layout = lc.Layout(lc.Mesh({"dp": 4}), [(r"^u$", lc.P("dp")), (r".*", lc.P())])
    rows = UNEVEN[rank : rank + 1] if rank < 3 else UNEVEN[3:]
    result = lc.save(path, {"u": rows.clone(), "r": REPLICATED.clone(), "k": 1}, layout, group=group, packing="ocdbt")
    return result.arrays_written


def _load_uneven(rank, group, path):
    out = lc.load(path, lc.Layout(lc.Mesh({"tp": 2}), [(r"^u$", lc.P(None, "tp")), (r".*", lc.P())]), group=group)
    return same(out["u"], UNEVEN.chunk(2, dim=1)[rank]) and same(out["r"], REPLICATED) and out["k"] == 1


def test_a_rank_that_writes_nothing_still_commits_a_packed_checkpoint(ranks: RankPool, tmp_path):
    path = tmp_path / "ck"
    written = ranks.run(_save_uneven, 4, str(path))
    assert written[3] == 0 and sum(written) == 4, written  # three rows of u, one copy of r
    rd = lc.open(path)
    assert rd.meta.packing == "ocdbt" and rd.info("u").shard_shape == (1, 4)
    out = lc.load(path)
    assert same(out["u"], UNEVEN) and same(out["r"], REPLICATED) and out["k"] == 1
    assert ranks.run(_load_uneven, 2, str(path)) == [True, True]
    # The empty rank's database holds no data file (if it exists at all).
    base = path / _packs.rank_base(3) / "d"
    assert not base.exists() or not any(base.iterdir())


@pytest.mark.parametrize("world", [2, 4])
def test_one_small_replicated_array_is_written_by_one_rank_packed(ranks: RankPool, tmp_path, world):
    path = tmp_path / "ck"
    written = ranks.run(_save_replicated, world, str(path), world)
    assert sorted(written) == [0] * (world - 1) + [1], written
    assert lc.open(path).meta.packing == "ocdbt"
    assert same(lc.load(path)["r"], REPLICATED)


def _save_replicated(rank, group, path, world):
    layout = lc.Layout(lc.Mesh({"dp": world}), [(r".*", lc.P())])
    return lc.save(path, {"r": REPLICATED.clone()}, layout, group=group, packing="ocdbt").arrays_written
