"""Property tests of the pure planner (``layoutckpt.layout._plan``).

Expectations are computed independently of ``_plan``: mesh coordinates with
``np.unravel_index`` (row-major), pieces with ``torch.chunk``, tiling by counting cells.
"""

from __future__ import annotations

import math
import pickle
from collections import Counter, defaultdict

import numpy as np
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import layoutckpt as lc
from layoutckpt.layout import _plan
from tests.support.oracle import mesh_coords

AXIS_NAMES = ("dp", "tp", "pp")


# ----------------------------------------------------------------------------- strategies


@st.composite
def meshes(draw, max_size=8, min_axes=0):
    """A mesh of 0-3 named axes (sizes >= 1) whose size is at most ``max_size``."""
    n = draw(st.integers(min_axes, 3))
    names = draw(st.permutations(AXIS_NAMES))[:n]
    sizes, prod = [], 1
    for _ in range(n):
        size = draw(st.integers(1, max_size // prod))
        sizes.append(size)
        prod *= size
    return dict(zip(names, sizes))


@st.composite
def raw_specs(draw, axes, ndim):
    """Spec entries for an array of ``ndim`` dims: each mesh axis splits one dim or none (a
    replica axis); a dim split by several axes lists them major to minor in a random order.
    Entries are drawn in every accepted spelling: None / (), 'a' / ('a',), ('a', 'b')."""
    target = {a: draw(st.sampled_from([None, *range(ndim)])) for a in axes}
    order = draw(st.permutations(list(axes)))
    entries = [tuple(a for a in order if target[a] == d) for d in range(ndim)]
    used = [d for d in range(ndim) if entries[d]]
    length = draw(st.integers(used[-1] + 1 if used else 0, ndim))
    out = []
    for e in entries[:length]:
        if not e:
            out.append(draw(st.sampled_from([None, ()])))
        elif len(e) == 1:
            out.append(draw(st.sampled_from([e[0], e])))
        else:
            out.append(e)
    return out


shapes = st.integers(0, 3).flatmap(lambda nd: st.tuples(*[st.integers(0, 13)] * nd))


@st.composite
def cases(draw, max_size=8):
    """(global shape, raw spec entries, mesh axes dict)."""
    axes = draw(meshes(max_size))
    shape = draw(shapes)
    return shape, draw(raw_specs(tuple(axes), len(shape))), axes


@st.composite
def plan_inputs(draw, max_size=8, same_spec=False):
    """A mesh and 1-5 arrays on it (random shapes, specs and item sizes)."""
    axes = draw(meshes(max_size))
    n = draw(st.integers(1, 5))
    arrays = []
    if same_spec:
        ndim = draw(st.integers(0, 3))
        raw = draw(raw_specs(tuple(axes), ndim))
    for i in range(n):
        if same_spec:
            shape = draw(st.tuples(*[st.integers(0, 13)] * ndim))
        else:
            shape = draw(shapes)
            raw = draw(raw_specs(tuple(axes), len(shape)))
        itemsize = draw(st.sampled_from([1, 2, 4, 8]))
        arrays.append(_plan.ArraySpec(f"a{i}", shape, lc.P(*raw), itemsize))
    return axes, arrays


# ----------------------------------------------------------------------------- independent model


def norm_entry(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


def model_pieces(entry: tuple[str, ...], axes: dict[str, int], coords: dict[str, int]) -> tuple[int, int]:
    k, i = 1, 0
    for a in entry:
        k, i = k * axes[a], i * axes[a] + coords[a]
    return k, i


def model_box(shape, raw, axes, rank):
    """Per dim the (start, stop) torch.chunk gives this rank, or None for an empty piece."""
    coords = mesh_coords(axes, rank)
    entries = [norm_entry(e) for e in raw] + [()] * (len(shape) - len(raw))
    box = []
    for n, entry in zip(shape, entries):
        k, i = model_pieces(entry, axes, coords)
        chunks = torch.arange(n).chunk(k)
        if i < len(chunks) and chunks[i].numel():
            box.append((int(chunks[i][0]), int(chunks[i][-1]) + 1))
        else:
            box.append(None)
    return box


def used_axes(raw) -> set[str]:
    return {a for e in raw for a in norm_entry(e)}


def replica_key(raw, axes, rank):
    """Coordinates of the axes the spec does not name: equal within one replica group."""
    coords = mesh_coords(axes, rank)
    return tuple(coords[a] for a in axes if a not in used_axes(raw))


def piece_key(raw, axes, rank):
    """Coordinates of the axes the spec names: equal for the replicas of one box."""
    coords = mesh_coords(axes, rank)
    return tuple(coords[a] for a in axes if a in used_axes(raw))


def box_slices(box):
    return tuple(slice(a, b) for a, b in box)


def nonempty(box) -> bool:
    return all(b > a for a, b in box)


def nbytes(box, itemsize) -> int:
    return math.prod(b - a for a, b in box) * itemsize


def mesh_size(axes) -> int:
    return math.prod(axes.values())


# ----------------------------------------------------------------------------- boxes


@given(cases(max_size=64))
def test_boxes_equal_torch_chunk(case):
    shape, raw, axes = case
    mesh = lc.Mesh(axes)
    spec = lc.P(*raw)
    for rank in range(mesh.size):
        box = lc.shard_box(shape, spec, mesh, rank)
        assert box == _plan.shard_box(shape, spec, mesh, rank)
        assert len(box) == len(shape)
        for d, (got, want) in enumerate(zip(box, model_box(shape, raw, axes, rank))):
            start, stop = got
            assert 0 <= start <= stop <= shape[d]
            if want is None:
                assert start == stop, (d, got)
            else:
                assert got == want, (d, got, want)


@given(cases(max_size=64))
def test_replica_group_tiles_the_array_exactly(case):
    shape, raw, axes = case
    mesh = lc.Mesh(axes)
    spec = lc.P(*raw)
    groups: dict[tuple, list[int]] = defaultdict(list)
    for rank in range(mesh.size):
        groups[replica_key(raw, axes, rank)].append(rank)
    pieces = math.prod(axes[a] for a in used_axes(raw))
    assert len(groups) == mesh.size // pieces
    for members in groups.values():
        assert len(members) == pieces
        count = np.zeros(shape, dtype=np.int64)
        for rank in members:
            count[box_slices(lc.shard_box(shape, spec, mesh, rank))] += 1
        assert (count == 1).all(), (members, count)


@given(cases(max_size=64))
def test_replicas_hold_identical_boxes(case):
    shape, raw, axes = case
    mesh = lc.Mesh(axes)
    spec = lc.P(*raw)
    by_piece: dict[tuple, set] = defaultdict(set)
    for rank in range(mesh.size):
        by_piece[piece_key(raw, axes, rank)].add(lc.shard_box(shape, spec, mesh, rank))
    assert all(len(boxes) == 1 for boxes in by_piece.values())


@given(cases(max_size=64))
def test_every_box_is_one_cell_of_the_shard_grid(case):
    shape, raw, axes = case
    mesh = lc.Mesh(axes)
    spec = lc.P(*raw)
    grid = _plan.shard_shape(shape, spec, mesh)
    entries = [norm_entry(e) for e in raw] + [()] * (len(shape) - len(raw))
    want = tuple(max(1, -(-n // math.prod(axes[a] for a in e))) for n, e in zip(shape, entries))
    assert grid == want
    boxes = {lc.shard_box(shape, spec, mesh, r) for r in range(mesh.size)}
    for box in boxes:
        if nonempty(box):
            for (start, stop), g, n in zip(box, grid, shape):
                assert start % g == 0
                assert stop == min(start + g, n)
    # Every cell of the grid is some rank's box: nothing is left unwritten.
    cells = math.prod(-(-n // g) for n, g in zip(shape, grid))
    assert sum(nonempty(b) for b in boxes) == cells


@given(cases(max_size=64))
def test_global_shape_is_recovered_from_local_shapes(case):
    shape, raw, axes = case
    mesh = lc.Mesh(axes)
    spec = lc.P(*raw)
    local = np.array(
        [[b - a for a, b in lc.shard_box(shape, spec, mesh, r)] for r in range(mesh.size)], dtype=np.int64
    ).reshape(mesh.size, len(shape))
    got = _plan.global_shape_from_sums(
        "x", spec, mesh, local.sum(0).tolist(), local.min(0).tolist(), local.max(0).tolist()
    )
    assert got == tuple(shape)


@given(meshes(max_size=64))
def test_mesh_coords_are_row_major(axes):
    mesh = lc.Mesh(axes)
    assert mesh.size == mesh_size(axes)
    for rank in range(mesh.size):
        coords = mesh.coords(rank)
        assert coords == mesh_coords(axes, rank)
        assert mesh.rank_of(coords) == rank


# ----------------------------------------------------------------------------- writers


@given(plan_inputs(max_size=64))
def test_exactly_one_writer_per_nonempty_box(inputs):
    axes, arrays = inputs
    mesh = lc.Mesh(axes)
    writers = _plan.assign_writers(arrays, mesh)
    assert len(writers) == len(arrays)
    for a, w in zip(arrays, writers):
        assert w.shape == (mesh.size,)
        holders: dict[tuple, list[int]] = defaultdict(list)
        for r in range(mesh.size):
            holders[lc.shard_box(a.shape, a.spec, mesh, r)].append(r)
        for box, ranks in holders.items():
            chosen = {int(w[r]) for r in ranks}
            if not nonempty(box):
                assert chosen == {-1}
                continue
            assert len(chosen) == 1, (a, box, chosen)
            (writer,) = chosen
            # The writer is one of the replicas that hold this very box.
            assert writer in ranks
            assert lc.shard_box(a.shape, a.spec, mesh, writer) == box


@given(plan_inputs(max_size=64))
def test_writers_are_deterministic(inputs):
    axes, arrays = inputs
    first = _plan.assign_writers(arrays, lc.Mesh(axes))
    rebuilt = [_plan.ArraySpec(a.name, tuple(a.shape), lc.P(*a.spec.entries), a.itemsize) for a in arrays]
    second = _plan.assign_writers(rebuilt, lc.Mesh(dict(axes)))
    assert all(np.array_equal(x, y) for x, y in zip(first, second))


@given(plan_inputs(max_size=64))
def test_writes_of_covers_every_box_exactly_once(inputs):
    axes, arrays = inputs
    mesh = lc.Mesh(axes)
    writers = _plan.assign_writers(arrays, mesh)
    written = Counter()
    for rank in range(mesh.size):
        for index, box in _plan.writes_of(arrays, mesh, rank):
            a = arrays[index]
            # A rank writes only what it holds, and only what it was assigned.
            assert box == lc.shard_box(a.shape, a.spec, mesh, rank)
            assert writers[index][rank] == rank
            written[(index, box)] += 1
    wanted = {
        (i, lc.shard_box(a.shape, a.spec, mesh, r))
        for i, a in enumerate(arrays)
        for r in range(mesh.size)
        if nonempty(lc.shard_box(a.shape, a.spec, mesh, r))
    }
    assert set(written) == wanted
    assert all(c == 1 for c in written.values())
    # Each array's written boxes tile it exactly.
    for i, a in enumerate(arrays):
        count = np.zeros(a.shape, dtype=np.int64)
        for j, box in written:
            if j == i:
                count[box_slices(box)] += 1
        assert (count == 1).all()


@given(plan_inputs(max_size=64, same_spec=True))
def test_writer_loads_are_balanced_within_each_replica_set(inputs):
    """With one spec for all arrays, the replicas of a box form the same sets for every array;
    largest-first to the least-loaded replica keeps each set's loads within one piece."""
    axes, arrays = inputs
    mesh = lc.Mesh(axes)
    raw = arrays[0].spec.entries
    loads = np.zeros(mesh.size, dtype=np.int64)
    largest: dict[tuple, int] = defaultdict(int)
    for rank in range(mesh.size):
        for index, box in _plan.writes_of(arrays, mesh, rank):
            size = nbytes(box, arrays[index].itemsize)
            loads[rank] += size
            key = piece_key(raw, axes, rank)
            largest[key] = max(largest[key], size)
    sets: dict[tuple, list[int]] = defaultdict(list)
    for rank in range(mesh.size):
        sets[piece_key(raw, axes, rank)].append(rank)
    for key, members in sets.items():
        spread = loads[members].max() - loads[members].min()
        assert spread <= largest.get(key, 0), (key, loads[members])


@given(
    world=meshes(max_size=64, min_axes=1),
    n=st.integers(1, 40),
    shape=st.tuples(st.integers(1, 13), st.integers(1, 13)),
    itemsize=st.sampled_from([1, 2, 4, 8]),
)
def test_equal_replicated_arrays_spread_over_all_ranks(world, n, shape, itemsize):
    mesh = lc.Mesh(world)
    arrays = [_plan.ArraySpec(f"a{i}", shape, lc.P(), itemsize) for i in range(n)]
    counts = [len(_plan.writes_of(arrays, mesh, r)) for r in range(mesh.size)]
    assert sum(counts) == n
    assert max(counts) - min(counts) <= 1
    assert set(counts) <= {n // mesh.size, -(-n // mesh.size)}
    loads = [c * math.prod(shape) * itemsize for c in counts]
    assert max(loads) - min(loads) <= math.prod(shape) * itemsize


def reference_assign_writers(arrays, mesh):
    """The first implementation of ``assign_writers``, kept as the oracle of the vectorized
    one: a Python loop over pieces, each to its least-loaded replica at that moment."""
    coords = {mesh: _plan._mesh_coords(mesh)}
    pieces = []
    for index, a in enumerate(arrays):
        m = a.mesh or mesh
        if m not in coords:
            coords[m] = _plan._mesh_coords(m)
        ids = _plan._piece_ids(a, m, coords[m])
        order = np.argsort(ids, kind="stable")
        bounds = np.flatnonzero(np.diff(ids[order])) + 1
        for group in np.split(order, bounds):
            size = _plan.box_size(_plan.shard_box(a.shape, a.spec, m, int(group[0]))) * a.itemsize
            if size > 0:
                pieces.append((-size, index, int(ids[group[0]]), group))
    pieces.sort(key=lambda p: p[:3])
    loads = np.zeros(mesh.size, dtype=np.int64)
    writers = [np.full(mesh.size, -1, dtype=np.int64) for _ in arrays]
    for neg_size, index, _, group in pieces:
        rank = int(group[np.argmin(loads[group])])
        loads[rank] -= neg_size
        writers[index][group] = rank
    return writers


@st.composite
def plan_inputs_on_own_meshes(draw, max_size=64):
    """A mesh and 1-8 arrays, some on a mesh of their own of the same size (a DTensor's): the
    same axes in another order, or the whole world on one axis."""
    axes = draw(meshes(max_size))
    size = mesh_size(axes)
    own = [None, dict(draw(st.permutations(list(axes.items())))), {"dp": size}]
    arrays = []
    for i in range(draw(st.integers(1, 8))):
        mesh_axes = draw(st.sampled_from(own))
        shape = draw(shapes)
        raw = draw(raw_specs(tuple(mesh_axes or axes), len(shape)))
        itemsize = draw(st.sampled_from([1, 2, 4, 8]))
        arrays.append(_plan.ArraySpec(f"a{i}", shape, lc.P(*raw), itemsize, mesh_axes and lc.Mesh(mesh_axes)))
    return axes, arrays


@given(st.one_of(plan_inputs(max_size=64), plan_inputs(max_size=64, same_spec=True), plan_inputs_on_own_meshes()))
@example(  # equal pieces of several arrays on the same replicas: the order between arrays decides
    (
        {"dp": 3, "tp": 2},
        [
            _plan.ArraySpec("a", (5, 4), lc.P("tp"), 4),
            _plan.ArraySpec("b", (4, 5), lc.P(None, "tp"), 4),
            _plan.ArraySpec("c", (12,), lc.P(), 2),
            _plan.ArraySpec("d", (7,), lc.P(("dp", "tp")), 8),
        ],
    )
)
@settings(max_examples=max(60, settings().max_examples))
def test_writers_equal_the_reference_implementation(inputs):
    axes, arrays = inputs
    mesh = lc.Mesh(axes)
    _plan._writers_by_piece.cache_clear()
    want = reference_assign_writers(arrays, mesh)
    got = _plan.assign_writers(arrays, mesh)
    assert len(got) == len(want)
    for a, g, w in zip(arrays, got, want):
        assert g.dtype == w.dtype and np.array_equal(g, w), (a, g, w)
    for rank in range(mesh.size):
        wanted = [(i, _plan.shard_box(a.shape, a.spec, a.mesh or mesh, rank)) for i, a in enumerate(arrays)]
        assert _plan.writes_of(arrays, mesh, rank) == [(i, box) for i, box in wanted if want[i][rank] == rank]


def test_writers_are_not_shared_mutable_state():
    """The cached assignment is handed out read-only or as fresh arrays: a caller scribbling on
    its result cannot change the next plan."""
    mesh = lc.Mesh({"dp": 4, "tp": 2})
    arrays = [_plan.ArraySpec("w", (8, 8), lc.P("tp"), 4), _plan.ArraySpec("b", (8,), lc.P(), 4)]
    first = _plan.assign_writers(arrays, mesh)
    first[0][:] = 99
    assert [w.tolist() for w in _plan.assign_writers(arrays, mesh)] == [
        w.tolist() for w in reference_assign_writers(arrays, mesh)
    ]
    # A shape given as a list cannot key the cache; the plan is computed all the same.
    listed = [_plan.ArraySpec("w", [8, 8], lc.P("tp"), 4)]  # type: ignore[arg-type]
    assert _plan.writes_of(listed, mesh, 0) == [(0, ((0, 4), (0, 8)))]


def test_planning_thousands_of_ranks_is_quick():
    """A smoke check, not a benchmark (benchmarks/plan_scale.py has the numbers): one rank's
    writes on a 4096-rank mesh, ~200 arrays of a dp x tp x pp model, planned from scratch."""
    import time

    mesh = lc.Mesh({"pp": 4, "dp": 128, "tp": 8})
    specs = [lc.P("tp", None), lc.P(None, "tp"), lc.P(), lc.P(("tp", "dp"), None), lc.P("pp", "dp", "tp")]
    arrays = [
        _plan.ArraySpec(f"a{i}", (8 * (i % 3) + 3, 4096, 4096)[-len(spec) - 1 :], spec, 2 + 2 * (i % 2))
        for i, spec in enumerate(specs * 40)
    ]
    _plan._writers_by_piece.cache_clear()
    start = time.perf_counter()
    mine = _plan.writes_of(arrays, mesh, 4095)
    seconds = time.perf_counter() - start
    assert seconds < 5, seconds  # about 0.02 s on one core; generous for loaded CI machines
    assert all(arrays[i].spec != lc.P() or box == tuple((0, n) for n in arrays[i].shape) for i, box in mine)


# ----------------------------------------------------------------------------- inner chunks


def largest_prime_factor(n: int) -> int:
    largest, f = 1, 2
    while n > 1:
        while n % f == 0:
            largest, n = f, n // f
        f += 1
    return largest


@given(
    outer=st.integers(0, 3).flatmap(lambda nd: st.tuples(*[st.integers(1, 48)] * nd)),
    itemsize=st.sampled_from([1, 2, 4, 8]),
    target=st.integers(1, 1 << 16),
)
def test_inner_chunk_divides_the_shard_and_fits_the_target(outer, itemsize, target):
    """Whatever shape policy the planner follows, an inner chunk divides the shard, respects
    the byte target whenever some divisor allows it (at worst single elements), and is not
    needlessly small: growing it by one prime factor of the shard would break the target."""
    inner = _plan.inner_chunk_shape(outer, itemsize, target)
    assert len(inner) == len(outer)
    assert all(1 <= c <= o and o % c == 0 for c, o in zip(inner, outer))
    size = itemsize * math.prod(inner)
    if itemsize * math.prod(outer) <= target:
        assert inner == tuple(outer)
    else:
        if itemsize <= target:
            assert size <= target
        largest = max((largest_prime_factor(o) for o in outer), default=1)
        assert size * largest > target, (inner, size, largest)


@given(cases(max_size=8), st.sampled_from([1, 2, 4, 8]), st.integers(1, 4096))
def test_inner_chunks_of_real_shards(case, itemsize, target):
    shape, raw, axes = case
    outer = _plan.shard_shape(shape, lc.P(*raw), lc.Mesh(axes))
    inner = _plan.inner_chunk_shape(outer, itemsize, target)
    assert all(o % c == 0 for c, o in zip(inner, outer))
    if itemsize <= target:
        assert itemsize * math.prod(inner) <= target


@given(
    st.integers(0, 3).flatmap(
        lambda nd: st.tuples(
            st.tuples(*[st.tuples(st.integers(0, 20), st.integers(0, 20))] * nd),
            st.tuples(*[st.integers(1, 7)] * nd),
        )
    )
)
def test_chunks_touched_counts_overlapping_cells(box_and_chunk):
    raw_box, chunk = box_and_chunk
    box = tuple((min(a, b), max(a, b)) for a, b in raw_box)
    want = 1
    for (start, stop), c in zip(box, chunk):
        want *= len({i // c for i in range(start, stop)})
    assert _plan.chunks_touched(box, chunk) == want


# ----------------------------------------------------------------------------- values


@given(cases(max_size=8))
def test_specs_meshes_and_layouts_survive_pickle(case):
    """Rank processes receive layouts by pickle (multiprocessing, RPC): they must round-trip."""
    _, raw, axes = case
    mesh = lc.Mesh(axes)
    spec = lc.P(*raw)
    layout = lc.Layout(mesh, [(r"\.w$", spec), (r".*", lc.P())])
    for value in (spec, mesh, layout):
        back = pickle.loads(pickle.dumps(value))
        assert back == value
        assert hash(back) == hash(value)
        assert repr(back) == repr(value)
    assert pickle.loads(pickle.dumps(layout)).spec_for("m.w") == spec


@given(
    outer=st.integers(0, 3).flatmap(lambda nd: st.tuples(*[st.integers(1, 300)] * nd)),
    itemsize=st.sampled_from([1, 2, 4]),
    target=st.integers(1, 1 << 16),
)
def test_save_chunks_let_other_layouts_split_any_dimension(outer, itemsize, target):
    """A save's chunk divides the shard and fits the target; a side with small factors is cut to
    at most an eighth of the shard's (so readers splitting it up to 8 ways read whole chunks),
    unless the chunk would fall below the smallest chunk size."""
    inner = _plan.chunk_shape_for(outer, itemsize, target)
    assert all(1 <= c <= o and o % c == 0 for c, o in zip(inner, outer))
    chosen = _plan.chunk_target(outer, itemsize, target)
    floor = min(chosen, _plan.MIN_INNER_CHUNK_BYTES)
    size = itemsize * math.prod(inner)
    # Within the target, unless every cut left would take the chunk below the floor.
    assert size <= chosen or all(size // _plan._smallest_factor(c) < floor for c in inner if c > 1), inner
    for d, (c, o) in enumerate(zip(inner, outer)):
        if c > 1 and c * _plan.READER_SPLITS > o and largest_prime_factor(c) <= 7:
            # Not cut further: only because the chunk, or a row of the last dimension, would
            # fall below its floor.
            f = min(f for f in (2, 3, 5, 7) if c % f == 0)
            short_run = d == len(inner) - 1 and itemsize * c // f < _plan.MIN_RUN_BYTES
            assert short_run or itemsize * math.prod(inner) // f < floor, (inner, d)
