"""Replica-parallel writes: a box held by several replicas is stored as several shards, each
written by another replica, so that no rank writes much more than its share.

The plan is checked purely on random states and meshes (every stored shard of every array is
written by exactly one rank that holds it, and the shards tile the array), and on the cases the
scale issue names: one replicated 128 MiB tensor on 4 ranks, and a Megatron-style state.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import layoutckpt as lc
from layoutckpt.layout import _plan

MiB = 1 << 20


def writer_bytes(arrays: list[_plan.ArraySpec], mesh: lc.Mesh) -> np.ndarray:
    return np.array(
        [
            sum(_plan.box_size(box) * arrays[i].itemsize for i, box in _plan.writes_of(arrays, mesh, r))
            for r in range(mesh.size)
        ]
    )


def test_one_replicated_tensor_on_four_ranks_is_written_by_all_four() -> None:
    mesh = lc.Mesh({"dp": 4})
    arrays = [_plan.ArraySpec("w", (8192, 4096), lc.P(), 4)]  # 128 MiB
    loads = writer_bytes(arrays, mesh)
    assert loads.sum() == 128 * MiB
    assert loads.max() / loads.mean() <= 1.5
    assert _plan.stored_shards(arrays, mesh) == [(2048, 4096)]


def test_megatron_tp_with_data_parallel_replicas_balances_writers() -> None:
    mesh = lc.Mesh({"pp": 2, "dp": 4, "tp": 2})
    arrays = []
    for layer in range(4):
        arrays += [
            _plan.ArraySpec(f"layers.{layer}.qkv", (3072, 1024), lc.P("tp", None), 2),
            _plan.ArraySpec(f"layers.{layer}.proj", (1024, 1024), lc.P(None, "tp"), 2),
            _plan.ArraySpec(f"layers.{layer}.fc1", (8192, 1024), lc.P("tp", None), 2),
            _plan.ArraySpec(f"layers.{layer}.fc2", (1024, 4096), lc.P(None, "tp"), 2),
            _plan.ArraySpec(f"layers.{layer}.norm", (1024,), lc.P(), 4),
        ]
    loads = writer_bytes(arrays, mesh)
    assert loads.max() / loads.mean() <= 1.25, loads


def test_small_arrays_keep_one_shard_per_box() -> None:
    mesh = lc.Mesh({"dp": 8})
    arrays = [_plan.ArraySpec("w", (256, 256), lc.P(), 4)]
    assert _plan.stored_shards(arrays, mesh) == [(256, 256)]


@st.composite
def states(draw):
    axes = {"dp": draw(st.integers(1, 4)), "tp": draw(st.integers(1, 3))}
    mesh = lc.Mesh(axes)
    arrays = []
    for i in range(draw(st.integers(1, 4))):
        ndim = draw(st.integers(1, 3))
        shape = tuple(draw(st.integers(0, 40)) for _ in range(ndim))
        spec = draw(st.sampled_from([lc.P(), lc.P("tp"), lc.P(None, "tp") if ndim > 1 else lc.P("dp")]))
        arrays.append(_plan.ArraySpec(f"a{i}", shape, spec, 4))
    return mesh, arrays


@given(states())
def test_every_stored_shard_has_one_writer_holding_it(case) -> None:
    mesh, arrays = case
    _plan._splits_cached.cache_clear()
    _plan._writers_by_piece.cache_clear()
    original = _plan.MIN_SPLIT_BYTES
    _plan.MIN_SPLIT_BYTES = 64  # tiny units: random small arrays get cut too
    try:
        shards = _plan.stored_shards(arrays, mesh)
        written = {i: [] for i in range(len(arrays))}
        for rank in range(mesh.size):
            for i, box in _plan.writes_of(arrays, mesh, rank):
                a = arrays[i]
                held = _plan.shard_box(a.shape, a.spec, mesh, rank)
                assert all(h0 <= b0 and b1 <= h1 for (b0, b1), (h0, h1) in zip(box, held)), (box, held)
                assert _plan.shard_cell(box, a.shape, shards[i]) is not None, (box, shards[i])
                written[i].append(box)
        for i, a in enumerate(arrays):
            cells = [math.ceil(n / s) if n else 0 for n, s in zip(a.shape, shards[i])]
            expected = math.prod(cells)
            cells_written = [_plan.shard_cell(b, a.shape, shards[i]) for b in written[i]]
            assert len(cells_written) == len(set(cells_written)) == expected, (a, shards[i], written[i])
            assert set(cells_written) == set(itertools.product(*(range(c) for c in cells)))
    finally:
        _plan.MIN_SPLIT_BYTES = original
        _plan._splits_cached.cache_clear()
        _plan._writers_by_piece.cache_clear()


@given(states())
def test_a_writer_rule_names_the_writer_of_every_stored_shard(case) -> None:
    """Where ``writer_rules`` gives an array a rule, the rank it names for each stored shard is
    the one that writes it: a reader of a packed checkpoint looks the shard up in that rank's
    database. Arrays of one shard have one, and so do arrays without replicas whose spec names
    the mesh's axes in its order (all that ``states`` draws)."""
    mesh, arrays = case
    _plan._splits_cached.cache_clear()
    _plan._writers_by_piece.cache_clear()
    original = _plan.MIN_SPLIT_BYTES
    _plan.MIN_SPLIT_BYTES = 64
    try:
        shards = _plan.stored_shards(arrays, mesh)
        rules = _plan.writer_rules(arrays, mesh)
        for rank in range(mesh.size):
            for i, box in _plan.writes_of(arrays, mesh, rank):
                if rules[i] is not None:
                    a, (start, step) = arrays[i], rules[i]
                    cell = _plan.shard_cell(box, a.shape, shards[i])
                    grid = [math.ceil(n / s) for n, s in zip(a.shape, shards[i])]
                    assert start + step * int(np.ravel_multi_index(cell, grid)) == rank, (a, cell, rules[i])
        for a, shard, rule in zip(arrays, shards, rules):
            stored = math.prod(math.ceil(n / s) if n else 0 for n, s in zip(a.shape, shard))
            alone = _plan._replica_count(a, mesh) == 1
            assert rule is not None or not (alone or stored == 1) or stored == 0, (a, shard)
    finally:
        _plan.MIN_SPLIT_BYTES = original
        _plan._splits_cached.cache_clear()
        _plan._writers_by_piece.cache_clear()


def test_fsdp_and_tensor_parallel_shards_are_written_by_rank_cell_order() -> None:
    mesh = lc.Mesh({"dp": 2, "tp": 4})
    arrays = [
        _plan.ArraySpec("fsdp", (64, 8), lc.P(("dp", "tp")), 4),
        _plan.ArraySpec("tp2d", (64, 8), lc.P("dp", "tp"), 4),
        _plan.ArraySpec("norm", (8,), lc.P(), 4),
        _plan.ArraySpec("swapped", (64, 8), lc.P("tp", "dp"), 4),  # rank order is not cell order
    ]
    rules = _plan.writer_rules(arrays, mesh)
    assert rules[:2] == [(0, 1), (0, 1)]
    assert rules[2] is not None and rules[2][1] == 0  # one shard, by one rank
    assert rules[3] is None
