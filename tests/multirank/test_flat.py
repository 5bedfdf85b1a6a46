"""Flat (ZeRO-style) shards: one 1-D buffer per rank over a range of many concatenated parameters.

The plan is checked purely (hypothesis): every stored row block has exactly one writer, its
parts tile it, and every part received is sent by exactly one rank. Real gloo ranks then save
random parameter lists under random partitions and load them under other flat partitions, on
other world sizes, and per parameter, bit for bit.
"""

from __future__ import annotations

import itertools
import math
import os
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import layoutckpt as lc
from layoutckpt.layout import _flat
from tests.support.multirank import RankPool

SHARD_SHAPES_TARGET = 64  # bytes: tiny row blocks, so ranges cut many of them


@st.composite
def flat_cases(draw, max_pieces: int = 4):
    n = draw(st.integers(1, 6))
    shapes = []
    for _ in range(n):
        ndim = draw(st.integers(0, 3))
        shapes.append(tuple(draw(st.integers(0, 5)) for _ in range(ndim)))
    params = [(f"p{i}.w" if i % 2 else f"p{i}", s) for i, s in enumerate(shapes)]
    pieces = draw(st.integers(1, max_pieces))
    replicas = draw(st.sampled_from([1, 2]))
    total = sum(math.prod(s) for s in shapes)
    bounds = None
    if draw(st.booleans()):
        cuts = sorted(draw(st.lists(st.integers(0, total + 3), min_size=pieces - 1, max_size=pieces - 1)))
        bounds = [0, *cuts, max(total, *cuts, 0) + draw(st.integers(0, 3))]
    return params, pieces, replicas, bounds


def mesh_for(pieces: int, replicas: int) -> lc.Mesh:
    return lc.Mesh({"rep": replicas, "dp": pieces}) if replicas > 1 else lc.Mesh({"dp": pieces})


def shard_shapes(flat: lc.Flat, itemsize: int = 4) -> list[tuple[int, ...]]:
    return [_flat.row_shard_shape(s, itemsize, SHARD_SHAPES_TARGET) for _, s in flat.params]


@given(flat_cases())
def test_every_row_block_has_one_writer_and_every_part_one_sender(case) -> None:
    params, pieces, replicas, bounds = case
    flat = lc.Flat(params, "dp", bounds=bounds)
    mesh = mesh_for(pieces, replicas)
    shapes = shard_shapes(flat)
    writers: Counter = Counter()
    received: Counter = Counter()
    sent: Counter = Counter()
    for rank in range(mesh.size):
        writes, sends = _flat.save_plan(flat, mesh, rank, shapes)
        assert len(sends) <= 1, "a rank sends at most the fragment before its range"
        for w in writes:
            writers[(w.param, w.box)] += 1
            covered = sorted((p.lo, p.hi) for p in w.parts)
            assert covered[0][0] == 0 and covered[-1][1] == w.size
            assert all(a[1] == b[0] for a, b in itertools.pairwise(covered)), "parts tile the block"
            for p in w.parts:
                if p.rank != rank:
                    received[(p.rank, rank, p.hi - p.lo)] += 1
        for s in sends:
            sent[(rank, s.to, s.hi - s.lo)] += 1
    assert received == sent
    expected = Counter()
    for (_, shape), outer in zip(flat.params, shapes):
        if math.prod(shape) == 0:
            continue
        rows = shape[0] if shape else 1
        block = outer[0] if shape else 1
        for s in range(-(-rows // block)):
            box = _flat.row_box(shape, s * block, min(rows, (s + 1) * block))
            expected[box] += 1
    assert sum(writers.values()) == sum(expected.values())
    assert set(writers.values()) <= {1}


@given(flat_cases())
def test_load_plan_fills_exactly_the_range(case) -> None:
    params, pieces, replicas, bounds = case
    flat = lc.Flat(params, "dp", bounds=bounds)
    mesh = mesh_for(pieces, replicas)
    total = flat.total
    for rank in range(mesh.size):
        piece, _ = flat.piece_of(mesh, rank)
        start, stop = flat.piece_range(mesh, piece)
        length, reads = _flat.load_plan(flat, mesh, rank)
        assert length == stop - start
        spans = sorted((r.dst, r.dst + r.hi - r.lo) for r in reads)
        filled = sum(b - a for a, b in spans)
        assert filled == max(0, min(stop, total) - min(start, total))
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))


# ---- real ranks ----------------------------------------------------------------------------


def concat(full: dict[str, np.ndarray], flat: lc.Flat) -> np.ndarray:
    return np.concatenate([full[n].reshape(-1) for n, _ in flat.params] + [np.zeros(0, np.float32)])


def local_buffer(full: dict[str, np.ndarray], flat: lc.Flat, mesh: lc.Mesh, rank: int) -> np.ndarray:
    cat = concat(full, flat)
    piece, _ = flat.piece_of(mesh, rank)
    start, stop = flat.piece_range(mesh, piece)
    out = np.zeros(stop - start, dtype=np.float32)
    part = cat[start : min(stop, cat.size)]
    out[: part.size] = part
    return out


def save_flat(rank: int, group, path: str, full, params, axes, bounds, as_numpy: bool):
    mesh = lc.Mesh(axes)
    flat = lc.Flat(params, "dp", bounds=bounds)
    layout = lc.Layout(mesh, [(r"^opt\.exp_avg$", flat), (r".*", lc.P())])
    buf = local_buffer(full, flat, mesh, rank)
    state = {"opt": {"exp_avg": buf if as_numpy else torch.from_numpy(buf)}, "step": 3}
    result = lc.save(path, state, layout, group=group)
    return result.arrays_written


def load_flat(rank: int, group, path: str, params, axes, bounds, with_template: bool):
    mesh = lc.Mesh(axes)
    flat = lc.Flat(params, "dp", bounds=bounds)
    layout = lc.Layout(mesh, [(r"^opt\.exp_avg$", flat), (r".*", lc.P())])
    piece, _ = flat.piece_of(mesh, rank)
    start, stop = flat.piece_range(mesh, piece)
    if with_template:
        like = {"opt": {"exp_avg": torch.full((stop - start,), -1.0)}, "step": 0}
        out = lc.load(path, layout, like=like, inplace=True, group=group)
        assert out["opt"]["exp_avg"] is like["opt"]["exp_avg"]
    else:
        out = lc.load(path, layout, group=group)
    assert out["step"] == 3
    return out["opt"]["exp_avg"].numpy().copy()


def random_full(params, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in params}


CASES = [
    # (params, save (ranks, axes, bounds), load (ranks, axes, bounds))
    ([("a", (7, 3)), ("b.w", (5,)), ("c", ()), ("d", (2, 3, 4))], (4, {"dp": 4}, None), (3, {"dp": 3}, None)),
    ([("a", (9, 5)), ("b", (0, 4)), ("c", (13,))], (3, {"dp": 3}, [0, 11, 12, 58]), (2, {"dp": 2}, [0, 40, 58])),
    ([("x", (6, 6)), ("y", (6,))], (4, {"rep": 2, "dp": 2}, None), (4, {"dp": 4}, [0, 0, 20, 42, 42])),
    ([("x", (3, 2)), ("y", (1,))], (1, {"dp": 1}, None), (4, {"dp": 4}, None)),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_flat_round_trips_into_other_flat_partitions_and_per_parameter(ranks: RankPool, tmp_path, case) -> None:
    params, (k_save, axes_save, b_save), (k_load, axes_load, b_load) = CASES[case]
    full = random_full(params, case)
    path = os.fspath(tmp_path / "ck")
    written = ranks.run(save_flat, k_save, path, full, params, axes_save, b_save, case % 2 == 1)

    # Every stored row block was written by one rank: the counts add up to the blocks there are.
    rd = lc.open(path)
    blocks = 0
    for name, shape in params:
        info = rd.info(f"opt.exp_avg.{name}")
        if math.prod(shape):
            blocks += math.ceil((shape[0] if shape else 1) / (info.shard_shape[0] if shape else 1))
        np.testing.assert_array_equal(rd.read(f"opt.exp_avg.{name}"), full[name])
    assert sum(written) == blocks

    flat_load = lc.Flat(params, "dp", bounds=b_load)
    mesh_load = lc.Mesh(axes_load)
    for with_template in (False, True):
        got = ranks.run(load_flat, k_load, path, params, axes_load, b_load, with_template)
        for rank, buf in enumerate(got):
            np.testing.assert_array_equal(buf, local_buffer(full, flat_load, mesh_load, rank))

    # Per parameter, in one plain process: the flat save is an ordinary checkpoint.
    per_param = lc.load(path)
    for name, _ in params:
        node = per_param["opt"]["exp_avg"]
        for part in name.split("."):
            node = node[part]
        np.testing.assert_array_equal(np.asarray(node), full[name])


def per_param_save(rank: int, group, path: str, full, axes):
    """An ordinary per-parameter save: every parameter split by rows over ``dp``."""
    mesh = lc.Mesh(axes)
    state: dict = {}
    for name, array in full.items():
        node = state.setdefault("opt", {}).setdefault("exp_avg", {})
        *parents, last = name.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = torch.from_numpy(array).chunk(mesh.size)[rank].clone()
    lc.save(path, state, lc.Layout(mesh, [(r".*", lc.P("dp"))]), group=group)


def test_per_parameter_save_loads_as_flat_buffers(ranks: RankPool, tmp_path) -> None:
    params = [("a", (8, 3)), ("b.w", (6,)), ("c", (5, 2))]
    full = random_full(params, 7)
    path = os.fspath(tmp_path / "ck")
    ranks.run(per_param_save, 2, path, full, {"dp": 2})
    flat = lc.Flat(params, "dp")
    got = ranks.run(load_flat_no_step, 3, path, params, {"dp": 3})
    for rank, buf in enumerate(got):
        np.testing.assert_array_equal(buf, local_buffer(full, flat, lc.Mesh({"dp": 3}), rank))


def load_flat_no_step(rank: int, group, path: str, params, axes):
    layout = lc.Layout(lc.Mesh(axes), [(r"^opt\.exp_avg$", lc.Flat(params, "dp")), (r".*", lc.P())])
    return lc.load(path, layout, group=group)["opt"]["exp_avg"].numpy().copy()


def test_wrong_buffer_length_names_the_array(tmp_path) -> None:
    flat = lc.Flat([("a", (4, 4))], "dp")
    layout = lc.Layout(lc.Mesh({"dp": 1}), [(r"buf", flat)])
    with pytest.raises(lc.InconsistentShardsError, match=r"flat array 'buf'.*a 1-D buffer of 16"):
        lc.save(tmp_path / "ck", {"buf": torch.zeros(15)}, layout)
    assert not (tmp_path / "ck").exists()


def test_flat_declaration_errors() -> None:
    with pytest.raises(lc.LayoutError, match="twice"):
        lc.Flat([("a", (2,)), ("a", (3,))], "dp")
    with pytest.raises(lc.LayoutError, match="start at 0"):
        lc.Flat([("a", (2,))], "dp", bounds=[1, 2])
    with pytest.raises(lc.LayoutError, match="axis 'tp'"):
        lc.Layout(lc.Mesh({"dp": 2}), [("x", lc.Flat([("a", (2,))], "tp"))])


@st.composite
def partitions(draw, total: int):
    pieces = draw(st.integers(1, 4))
    if draw(st.booleans()):
        return pieces, None
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=pieces - 1, max_size=pieces - 1)))
    return pieces, [0, *cuts, total + draw(st.integers(0, 2))]


@settings(max_examples=8)
@given(data=st.data())
def test_random_flat_partitions_round_trip_on_real_ranks(ranks: RankPool, tmp_path_factory, data) -> None:
    params, *_ = data.draw(flat_cases())
    total = sum(math.prod(s) for _, s in params)
    k_save, b_save = data.draw(partitions(total))
    k_load, b_load = data.draw(partitions(total))
    full = random_full(params, data.draw(st.integers(0, 2**16)))
    path = os.fspath(tmp_path_factory.mktemp("flat") / "ck")
    ranks.run(save_flat, k_save, path, full, params, {"dp": k_save}, b_save, False)
    got = ranks.run(load_flat, k_load, path, params, {"dp": k_load}, b_load, True)
    flat = lc.Flat(params, "dp", bounds=b_load)
    for rank, buf in enumerate(got):
        np.testing.assert_array_equal(buf, local_buffer(full, flat, lc.Mesh({"dp": k_load}), rank))
    per_param = lc.open(path)
    for name, _ in params:
        np.testing.assert_array_equal(per_param.read(f"opt.exp_avg.{name}"), full[name])


def save_flat_async(rank: int, group, path: str, full, params, axes):
    mesh = lc.Mesh(axes)
    flat = lc.Flat(params, "dp")
    layout = lc.Layout(mesh, [(r"^opt\.exp_avg$", flat), (r".*", lc.P())])
    buf = torch.from_numpy(local_buffer(full, flat, mesh, rank))
    fut = lc.save_async(path, {"opt": {"exp_avg": buf}}, layout, group=group)
    buf.fill_(float("nan"))  # the optimizer steps on: the save must own its copy
    fut.result()


def test_flat_save_async_owns_its_copy(ranks: RankPool, tmp_path) -> None:
    params = [("a", (33, 5)), ("b", (7,))]
    full = random_full(params, 3)
    path = os.fspath(tmp_path / "ck")
    ranks.run(save_flat_async, 3, path, full, params, {"dp": 3})
    rd = lc.open(path)
    for name, _ in params:
        np.testing.assert_array_equal(rd.read(f"opt.exp_avg.{name}"), full[name])
