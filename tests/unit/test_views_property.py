"""Fused and padded local tensors, and local-to-global names, against hand-made oracles.

Every rank's local tensor is built here from global, logical arrays with ``torch.chunk`` (never
with the library's planner); ``Fused.cuts`` / ``Padded.cut`` must then find each logical array's
piece in it, and put it back bit for bit. Single-process round trips save one declaration of a
state and load it under another (fused to unfused parts and back, one padding to another), and
``Renumber`` / ``Rename`` either map local names one-to-one or refuse with a ``LayoutError``.
"""

from __future__ import annotations

import re
import tempfile

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import layoutckpt as lc
from layoutckpt.layout._names import to_global

PART_NAMES = ("q", "k", "v", "gate", "up")


def chunk_piece(x: torch.Tensor, k: int, i: int, dim: int) -> torch.Tensor:
    """Piece ``i`` of ``k`` of ``x`` along ``dim`` as ``torch.chunk`` cuts it (empty past its last chunk)."""
    chunks = torch.chunk(x, k, dim=dim)
    if i < len(chunks):
        return chunks[i]
    return x.narrow(dim, x.shape[dim], 0)


def spec_on(dim: int) -> lc.P:
    return lc.P("tp", None) if dim == 0 else lc.P(None, "tp")


def values(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Distinct, exactly representable values: a piece in the wrong place cannot compare equal."""
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=torch.float32) + 1000 * seed).reshape(shape)


@st.composite
def block_cases(draw):
    nparts = draw(st.integers(1, 4))
    sizes = [draw(st.integers(1, 9)) for _ in range(nparts)]
    return sizes, draw(st.integers(1, 5)), draw(st.sampled_from([0, 1])), draw(st.integers(1, 3))


@st.composite
def grouped_cases(draw):
    nparts = draw(st.integers(1, 3))
    sizes = [draw(st.integers(1, 4)) for _ in range(nparts)]
    k = draw(st.integers(1, 4))
    groups = k * draw(st.integers(1, 3))
    return sizes, groups, k, draw(st.sampled_from([0, 1])), draw(st.integers(1, 3))


def _parts(sizes: list[int]) -> list[tuple[str, int]]:
    return [(PART_NAMES[j], s) for j, s in enumerate(sizes)]


def _logical(lengths: list[int], dim: int, other: int) -> list[torch.Tensor]:
    return [values((n, other) if dim == 0 else (other, n), j) for j, n in enumerate(lengths)]


def _check_cuts(fused: lc.Fused, local: torch.Tensor, pieces: list[torch.Tensor], k: int, i: int) -> None:
    cuts = fused.cuts("blk.w", tuple(local.shape), lc.Mesh({"tp": k}), {"tp": i})
    assert [n for n, _ in cuts] == [f"blk.{p}.w" for p, _ in fused.parts]
    rebuilt = torch.full_like(local, float("nan"))
    for (_, cut), piece in zip(cuts, pieces):
        got = cut.take(local)
        assert got.shape == piece.shape and torch.equal(got, piece)
        assert got.is_contiguous()
        cut.place(rebuilt, piece)
    # Bit-exact: NaNs left anywhere (a hole) or a value in the wrong place both fail.
    assert torch.equal(rebuilt.view(torch.int32), local.view(torch.int32))


@given(block_cases())
def test_block_fusion_cuts_recover_every_parts_chunk(case) -> None:
    sizes, k, dim, other = case
    parts = _logical(sizes, dim, other)
    fused = lc.Fused(spec_on(dim), _parts(sizes), dim=dim)
    for i in range(k):
        pieces = [chunk_piece(p, k, i, dim) for p in parts]
        local = torch.cat(pieces, dim=dim)  # SwiGLU [gate_i; up_i], GPT-2 c_attn [q_i | k_i | v_i]
        _check_cuts(fused, local, pieces, k, i)


@given(grouped_cases())
def test_grouped_fusion_cuts_recover_every_parts_chunk(case) -> None:
    sizes, groups, k, dim, other = case
    parts = _logical([groups * s for s in sizes], dim, other)
    fused = lc.Fused(spec_on(dim), _parts(sizes), dim=dim, groups=groups)
    for i in range(k):
        mine = range(i * groups // k, (i + 1) * groups // k)
        # Megatron's linear_qkv: for each local group, its q rows, then its k rows, then its v rows.
        local = torch.cat(
            [p.narrow(dim, g * s, s) for g in mine for p, s in zip(parts, sizes)],
            dim=dim,
        )
        pieces = [chunk_piece(p, k, i, dim) for p in parts]
        _check_cuts(fused, local, pieces, k, i)


@given(st.integers(1, 5), st.integers(2, 6), st.integers(1, 3))
def test_groups_that_do_not_divide_over_the_ranks_are_refused(groups, k, per) -> None:
    if groups % k == 0:
        groups += 1
    fused = lc.Fused(lc.P("tp", None), [("q", per), ("k", 1)], groups=groups)
    with pytest.raises(lc.LayoutError, match=r"'attn\.qkv\.weight'"):
        fused.cuts("attn.qkv.weight", ((groups // k) * (per + 1), 2), lc.Mesh({"tp": k}), {"tp": 0})


@given(st.integers(1, 6), st.integers(1, 4), st.integers(1, 4))
def test_block_sizes_that_do_not_add_up_are_refused(size, k, extra) -> None:
    fused = lc.Fused(lc.P("tp", None), [("gate", size), ("up", size)])
    rows = 2 * chunk_piece(torch.zeros(size), k, 0, 0).numel() + extra
    with pytest.raises(lc.LayoutError, match=r"'mlp\.fc1\.weight'"):
        fused.cuts("mlp.fc1.weight", (rows, 3), lc.Mesh({"tp": k}), {"tp": 0})


@given(st.integers(0, 40), st.integers(1, 6), st.integers(0, 7), st.integers(0, 1))
def test_padded_valid_rows_tile_the_logical_rows_once(size, k, extra, dim) -> None:
    rows = -(-size // k) + extra  # at least torch.chunk's piece: every padding that holds the array
    padded = lc.Padded(spec_on(dim), size, dim=dim)
    cover = [0] * size
    for i in range(k):
        shape = (rows, 2) if dim == 0 else (2, rows)
        cut, start, per = padded.cut("emb.w", shape, lc.Mesh({"tp": k}), {"tp": i})
        assert per == rows and cut.dim == dim and cut.offset == 0
        assert start == min(i * rows, size)
        for r in range(start, start + cut.width):
            cover[r] += 1
        local = values(shape, i)
        assert torch.equal(cut.take(local), local.narrow(dim, 0, cut.width))
    assert cover == [1] * size
    if size > 0:  # one row fewer per piece than torch.chunk's holds less than the logical rows
        short = -(-size // k) - 1
        with pytest.raises(lc.LayoutError, match="padding must be at least"):
            padded.cut("emb.w", (short, 2) if dim == 0 else (2, short), lc.Mesh({"tp": k}), {"tp": 0})


# --- round trips in one process between two declarations --------------------------------------------


@given(st.integers(1, 3), st.lists(st.integers(1, 3), min_size=1, max_size=3), st.integers(1, 3), st.booleans())
def test_fused_and_unfused_declarations_round_trip(groups, sizes, cols, grouped) -> None:
    parts = _parts(sizes)
    lengths = [groups * s for s in sizes] if grouped else sizes
    logical = {name: values((n, cols), j) for j, ((name, _), n) in enumerate(zip(parts, lengths))}
    if grouped:
        fused_local = torch.cat([logical[n][g * s : (g + 1) * s] for g in range(groups) for n, s in parts])
        fused = lc.Fused(lc.P("tp", None), parts, groups=groups)
    else:
        fused_local = torch.cat([logical[n] for n, _ in parts])
        fused = lc.Fused(lc.P("tp", None), parts)
    mesh = lc.Mesh({"tp": 1})
    fused_layout = lc.Layout(mesh, [(r"\.qkv\.weight$", fused), (r".*", lc.P("tp", None))])
    plain_layout = lc.Layout(mesh, [(r".*", lc.P("tp", None))])
    unfused = {"attn": {"qkv": {n: {"weight": t} for n, t in logical.items()}}}
    with tempfile.TemporaryDirectory() as tmp:
        # Saved fused, loaded as the parts (by their stored names), and as fused again.
        lc.save(f"{tmp}/fused", {"attn": {"qkv": {"weight": fused_local}}}, fused_layout)
        assert sorted(lc.open(f"{tmp}/fused").keys()) == sorted(f"attn.qkv.{n}.weight" for n in logical)
        like_parts = {"attn": {"qkv": {n: {"weight": torch.empty(t.shape, device="meta")} for n, t in logical.items()}}}
        got = lc.load(f"{tmp}/fused", plain_layout, like=like_parts)
        for n, t in logical.items():
            assert torch.equal(got["attn"]["qkv"][n]["weight"], t), n
        # Saved unfused under the part names, loaded into a fused tensor (in place).
        lc.save(f"{tmp}/parts", unfused, plain_layout)
        target = {"attn": {"qkv": {"weight": torch.full_like(fused_local, float("nan"))}}}
        lc.load(f"{tmp}/parts", fused_layout, like=target, inplace=True)
        assert torch.equal(target["attn"]["qkv"]["weight"], fused_local)


@given(st.integers(1, 20), st.integers(1, 8), st.integers(1, 8), st.sampled_from([0.0, -3.5, 7.0]))
def test_padding_to_one_multiple_loads_under_another(size, m1, m2, fill) -> None:
    logical = values((size, 2), 1)
    rows1, rows2 = -(-size // m1) * m1, -(-size // m2) * m2
    saved = torch.cat([logical, torch.full((rows1 - size, 2), 99.0)])  # the padding never reaches the file
    mesh = lc.Mesh({"tp": 1})

    def layout(value: float) -> lc.Layout:
        return lc.Layout(mesh, [(r"^emb\.weight$", lc.Padded(lc.P("tp", None), size, value=value)), (r".*", lc.P())])

    with tempfile.TemporaryDirectory() as tmp:
        lc.save(f"{tmp}/ck", {"emb": {"weight": saved}}, layout(0.0))
        rd = lc.open(f"{tmp}/ck")
        assert rd.info("emb.weight").shape == (size, 2)
        assert torch.equal(torch.from_numpy(rd.read("emb.weight")), logical)
        got = lc.load(f"{tmp}/ck", layout(fill), like={"emb": {"weight": torch.empty(rows2, 2, device="meta")}})
        weight = got["emb"]["weight"]
        assert weight.shape == (rows2, 2)
        assert torch.equal(weight[:size], logical)
        assert torch.equal(weight[size:], torch.full((rows2 - size, 2), fill))


# --- local names to global names ------------------------------------------------------------------


@st.composite
def renumber_cases(draw):
    coords = draw(st.integers(1, 4))
    if draw(st.booleans()):
        per = draw(st.integers(1, 4))
        counts = [per] * coords
        rule = lc.Renumber(r"^layers\.(\d+)\.", "pp", per=per)
    else:
        counts = [draw(st.integers(1, 4)) for _ in range(coords)]
        starts = [sum(counts[:c]) for c in range(coords)]
        if draw(st.booleans()):
            starts.append(sum(counts))
        rule = lc.Renumber(r"^layers\.(\d+)\.", "pp", starts=starts)
    # Local numbers each coordinate holds: mostly within its count, sometimes one past it.
    held = [
        sorted(set(draw(st.lists(st.integers(0, n if draw(st.booleans()) else n - 1), min_size=1, max_size=5))))
        for n in counts
    ]
    return rule, counts, held


@given(renumber_cases())
def test_renumber_is_one_to_one_or_refused(case) -> None:
    rule, counts, held = case
    open_ended = rule.starts is not None and len(rule.starts) == len(counts)
    first = [sum(counts[:c]) for c in range(len(counts))]
    seen: dict[str, tuple[int, int]] = {}
    for c, numbers in enumerate(held):
        names = [f"layers.{i}.w" for i in numbers] + ["head.w"]
        past = [i for i in numbers if i >= counts[c]]
        last = c == len(counts) - 1
        if past and not (open_ended and last):
            with pytest.raises(lc.LayoutError, match=re.escape(f"'layers.{past[0]}.w'")):
                to_global((rule,), names, {"pp": c})
            continue
        mapping = to_global((rule,), names, {"pp": c})
        assert mapping["head.w"] == "head.w"
        for i in numbers:
            name = mapping[f"layers.{i}.w"]
            assert name == f"layers.{first[c] + i}.w"
            assert name not in seen, (name, seen[name], (c, i))
            seen[name] = (c, i)


NAME_PARTS = st.sampled_from(["a", "b", "ab", "x", "0", "1"])


@given(
    st.lists(st.lists(NAME_PARTS, min_size=1, max_size=3).map(".".join), min_size=1, max_size=6, unique=True),
    st.sampled_from(["a", "b", "x", "ab"]),
    st.sampled_from(["a", "b", "x", "y"]),
)
def test_rename_is_one_to_one_or_refused(names, old, new) -> None:
    rule = lc.Rename(rf"^{old}\.", f"{new}.")
    expected = {n: (f"{new}.{n[len(old) + 1 :]}" if n.startswith(f"{old}.") else n) for n in names}
    if len(set(expected.values())) < len(names):
        with pytest.raises(lc.LayoutError, match="both map to the global name"):
            to_global((rule,), names, {})
    else:
        assert to_global((rule,), names, {}) == expected
