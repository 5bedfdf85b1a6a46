"""The pure plan of shared reads: who shares a box (``sharing_ranks``) and what each reads
(``shared_parts``)."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

import layoutckpt as lc
from layoutckpt.layout import _plan


@st.composite
def meshes_and_specs(draw):
    sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    mesh = lc.Mesh({f"a{i}": n for i, n in enumerate(sizes)})
    axes = list(mesh.axis_names)
    used = draw(st.lists(st.sampled_from(axes), unique=True, max_size=len(axes)))
    shape = tuple(draw(st.integers(1, 30)) for _ in used) or (draw(st.integers(1, 30)),)
    spec = lc.P(*used) if used else lc.P()
    stages = draw(st.lists(st.sampled_from([a for a in axes if a not in used] or ["none"]), unique=True, max_size=1))
    return mesh, spec, shape, [s for s in stages if s in axes]


@given(meshes_and_specs())
def test_sharers_hold_the_same_box_and_agree_on_their_group(case):
    mesh, spec, shape, stages = case
    for rank in range(mesh.size):
        group = _plan.sharing_ranks(mesh, spec, rank, stages)
        assert rank in group and list(group) == sorted(group) and len(group) <= _plan.SHARE_GROUP
        box = _plan.shard_box(shape, spec, mesh, rank)
        for other in group:
            assert _plan.shard_box(shape, spec, mesh, other) == box
            assert _plan.sharing_ranks(mesh, spec, other, stages) == group
            coords, theirs = mesh.coords(rank), mesh.coords(other)
            assert all(coords[a] == theirs[a] for a in stages)


@given(
    start=st.integers(0, 50),
    length=st.integers(1, 60),
    rows=st.integers(1, 9),
    readers=st.integers(1, 8),
    offset=st.integers(0, 100),
)
def test_parts_cover_the_box_once_at_whole_chunk_rows(start, length, rows, readers, offset):
    box = ((start, start + length), (0, 3))
    parts = _plan.shared_parts(box, rows, readers, offset)
    assert len(parts) == readers
    got = sorted(p for p in parts if p is not None)
    assert [r for p in got for r in range(*p[0])] == list(range(start, start + length))
    assert all(p[1] == (0, 3) for p in got)
    # No chunk row is read by two parts, and the parts differ by at most one chunk row's worth.
    chunks = [{r // rows for r in range(*p[0])} for p in got]
    assert all(not (a & b) for a, b in itertools.combinations(chunks, 2))
    counts = [len(c) for c in chunks] + [0] * (readers - len(got))
    assert max(counts) - min(counts) <= 1


def test_a_scalar_is_read_by_one_sharer_chosen_by_offset():
    assert _plan.shared_parts((), 1, 3, 0) == [(), None, None]
    assert _plan.shared_parts((), 1, 3, 2) == [None, (), None]
