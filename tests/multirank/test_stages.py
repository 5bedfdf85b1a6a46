"""Ranks that hold different names, local names, fused and padded tensors, on real gloo ranks.

A tiny GPT-like state is made from one seed as global, logical arrays; each rank of a
``{"pp": 2, "tp": 2}`` mesh keeps only its stage's layers under local names, its tensor-parallel
pieces of a fused QKV (query groups interleaved), a fused ``[gate; up]`` and a padded vocabulary.
It is saved, then loaded under other meshes (TP=4, PP=4, one process) and compared bit for bit
with the pieces those ranks must hold, cut from the same global arrays.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import layoutckpt as lc
from tests.support.multirank import RankPool

LAYERS, G, QPG, HD, H, FFN, VOCAB = 4, 4, 2, 2, 8, 8, 13


def global_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {"embedding.weight": torch.randn(VOCAB, H, generator=g)}
    for i in range(LAYERS):
        for name, shape in (("q", (G * QPG * HD, H)), ("k", (G * HD, H)), ("v", (G * HD, H))):
            out[f"layers.{i}.qkv.{name}.weight"] = torch.randn(shape, generator=g)
        out[f"layers.{i}.fc1.gate.weight"] = torch.randn(FFN, H, generator=g)
        out[f"layers.{i}.fc1.up.weight"] = torch.randn(FFN, H, generator=g)
        out[f"layers.{i}.norm.weight"] = torch.randn(H, generator=g)
    return out


def layout(pp: int, tp: int, *, local_names: bool = True) -> lc.Layout:
    names = [lc.Renumber(r"^layers\.(\d+)\.", "pp", per=LAYERS // pp)] if local_names else []
    return lc.Layout(
        lc.Mesh({"pp": pp, "tp": tp}),
        [
            (r"qkv\.weight$", lc.Fused(lc.P("tp", None), [("q", QPG * HD), ("k", HD), ("v", HD)], groups=G)),
            (r"fc1\.weight$", lc.Fused(lc.P("tp", None), [("gate", FFN), ("up", FFN)])),
            (r"^embedding\.weight$", lc.Padded(lc.P("tp", None), VOCAB)),
            (r".*", lc.P()),
        ],
        stages="pp",
        names=names,
    )


def rank_state(pp: int, tp: int, rank: int, *, local_names: bool = True, pad_to: int = 8) -> dict[str, torch.Tensor]:
    """What rank ``rank`` of ``{"pp": pp, "tp": tp}`` holds, cut from the global arrays."""
    full = global_state()
    s, t = divmod(rank, tp)
    per = LAYERS // pp
    out: dict[str, torch.Tensor] = {}
    if s == 0:
        rows = -(-VOCAB // (pad_to * tp)) * pad_to  # Megatron: padded to a multiple of pad_to * tp
        padded = torch.cat([full["embedding.weight"], torch.zeros(rows * tp - VOCAB, H)])
        out["embedding.weight"] = padded[t * rows : (t + 1) * rows].clone()
    for i in range(s * per, (s + 1) * per):
        local = i - s * per if local_names else i
        groups = range(t * G // tp, (t + 1) * G // tp)
        q, k, v = (full[f"layers.{i}.qkv.{n}.weight"] for n in "qkv")
        out[f"layers.{local}.qkv.weight"] = torch.cat(
            [
                torch.cat([q[g * QPG * HD : (g + 1) * QPG * HD], k[g * HD : (g + 1) * HD], v[g * HD : (g + 1) * HD]])
                for g in groups
            ]
        )
        gate, up = full[f"layers.{i}.fc1.gate.weight"], full[f"layers.{i}.fc1.up.weight"]
        f = FFN // tp
        out[f"layers.{local}.fc1.weight"] = torch.cat([gate[t * f : (t + 1) * f], up[t * f : (t + 1) * f]])
        out[f"layers.{local}.norm.weight"] = full[f"layers.{i}.norm.weight"].clone()
    return out


def _save(rank: int, group, path: str, pp: int, tp: int, local_names: bool) -> None:
    state = rank_state(pp, tp, rank, local_names=local_names)
    lc.save(path, state, layout(pp, tp, local_names=local_names), group=group)


def _load_and_compare(rank: int, group, path: str, pp: int, tp: int) -> None:
    expected = rank_state(pp, tp, rank, pad_to=1)
    like = {name: torch.full_like(t, float("nan")) for name, t in expected.items()}
    got = lc.load(path, layout(pp, tp), like=like, group=group)
    assert sorted(got) == sorted(expected)
    for name, t in expected.items():
        assert torch.equal(got[name], t), name


def _load_without_template(rank: int, group, path: str) -> None:
    """Without like=, each stored (global, logical) array comes back split as its rule says: a
    fused part as its fused rule's P, whatever the part's own name matches."""
    got = lc.load(path, layout(1, 2), group=group)
    full = global_state()
    q = got["layers"]["3"]["qkv"]["q"]["weight"]
    assert torch.equal(q, full["layers.3.qkv.q.weight"].chunk(2)[rank])
    assert torch.equal(got["layers"]["3"]["norm"]["weight"], full["layers.3.norm.weight"])


@pytest.mark.parametrize("local_names", [True, False], ids=["local-names", "global-names"])
def test_pipeline_stages_save_once_and_load_under_other_meshes(ranks: RankPool, tmp_path, local_names) -> None:
    path = str(tmp_path / "ckpt")
    ranks.run(_save, 4, path, 2, 2, local_names)
    reader = lc.open(path)
    full = global_state()
    assert sorted(reader.keys()) == sorted(full)
    for name, t in full.items():
        assert np.array_equal(reader.read(name), t.numpy()), name
    ranks.run(_load_and_compare, 4, path, 1, 4)  # PP=1 x TP=4, another padding
    ranks.run(_load_and_compare, 4, path, 4, 1)  # PP=4 x TP=1
    _load_and_compare(0, None, path, 1, 1)  # one plain process
    ranks.run(_load_without_template, 2, path)


def _save_expecting(rank: int, group, path: str, case: str) -> None:
    pp, tp = 2, 2
    state = rank_state(pp, tp, rank)
    lay = layout(pp, tp)
    if case == "missing-layer" and rank in (0, 1):
        del state["layers.1.norm.weight"], state["layers.1.qkv.weight"], state["layers.1.fc1.weight"]
    if case == "shapes-differ":
        state["shared"] = torch.zeros(3 if rank < 2 else 4)
    if case == "values-differ":
        state["shared"] = torch.full((3,), float(rank // 2))
    if case == "parts-do-not-add-up" and rank == 1:
        state["layers.0.fc1.weight"] = state["layers.0.fc1.weight"][:-1]
    if case == "padding-too-small":
        state["embedding.weight"] = state.get("embedding.weight", torch.zeros(1, H))[:3]
    if case == "renumber-collision" and rank in (0, 1):
        state["layers.2.norm.weight"] = torch.zeros(H)
    lc.save(path, state, lay, group=group)


@pytest.mark.parametrize(
    ("case", "error", "words"),
    [
        ("missing-layer", lc.LayoutError, "no rank holds 'layers.1"),
        ("shapes-differ", lc.InconsistentShardsError, "'shared'"),
        ("values-differ", lc.InconsistentShardsError, "'shared'"),
        ("parts-do-not-add-up", lc.LayoutError, "'layers.0.fc1.weight'"),
        ("padding-too-small", lc.LayoutError, "padding must be at least"),
        ("renumber-collision", lc.LayoutError, "'layers.2.norm.weight'"),
    ],
)
def test_bad_declarations_are_refused_before_anything_is_written(ranks: RankPool, tmp_path, case, error, words):
    path = str(tmp_path / "ckpt")
    errors = ranks.run_expecting_errors(_save_expecting, 4, path, case)
    assert any(error.__name__ in e and words in e for e in errors), errors[0]
    assert not os.path.exists(os.path.join(path, "zarr.json"))


# --- ZeRO over tensor parallelism ----------------------------------------------------------------

ZERO_PARAMS = [("w1", (8, 6)), ("w2", (6, 10)), ("b", (5,))]
ZERO_SPECS = {"w1": lc.P("tp", None), "w2": lc.P(None, "tp")}


def zero_globals() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {name: torch.randn(shape, generator=g) for name, shape in ZERO_PARAMS}


def zero_flat(dp: int, tp: int) -> lc.Flat:
    return lc.Flat(ZERO_PARAMS, "dp", specs=ZERO_SPECS if tp > 1 else None)


def zero_buffer(dp: int, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s ZeRO buffer: its data-parallel range of its tensor-parallel pieces, cut by hand."""
    d, t = divmod(rank, tp)
    pieces = []
    for name, tensor in zero_globals().items():
        spec = ZERO_SPECS.get(name, lc.P()) if tp > 1 else lc.P()
        dim = next((i for i, e in enumerate(spec) if e == "tp"), None)
        pieces.append((tensor.chunk(tp, dim)[t] if dim is not None else tensor).reshape(-1))
    flat = torch.cat(pieces)
    length = -(-flat.numel() // dp)
    flat = torch.cat([flat, torch.zeros(length * dp - flat.numel())])
    return flat[d * length : (d + 1) * length].clone()


def zero_layout(dp: int, tp: int) -> lc.Layout:
    return lc.Layout(lc.Mesh({"dp": dp, "tp": tp}), [("^optim$", zero_flat(dp, tp)), (".*", lc.P())])


def _zero_save(rank: int, group, path: str) -> None:
    lc.save(path, {"optim": zero_buffer(2, 2, rank)}, zero_layout(2, 2), group=group)


def _zero_load(rank: int, group, path: str, dp: int, tp: int) -> None:
    got = lc.load(path, zero_layout(dp, tp), like={"optim": zero_buffer(dp, tp, rank) * 0}, group=group)
    assert torch.equal(got["optim"], zero_buffer(dp, tp, rank))


def test_zero_buffers_over_tensor_parallel_pieces_store_global_arrays(ranks: RankPool, tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    ranks.run(_zero_save, 4, path)
    reader = lc.open(path)
    for name, tensor in zero_globals().items():
        assert np.array_equal(reader.read(f"optim.{name}"), tensor.numpy()), name
    ranks.run(_zero_load, 4, path, 2, 2)  # the same ZeRO-over-TP layout
    ranks.run(_zero_load, 4, path, 4, 1)  # ZeRO over four data-parallel ranks, no TP
    ranks.run(_zero_load, 2, path, 1, 2)  # TP=2, one data-parallel rank


# --- a distributed optimizer per pipeline stage -----------------------------------------------------


def stage_params(stage: int) -> list[tuple[str, tuple[int, ...]]]:
    return [(f"layers.{2 * stage + i}.w", (5, 3)) for i in range(2)]


def stage_flat_layout() -> lc.Layout:
    rules = [(rf"^optim\.{s}$", lc.Flat(stage_params(s), "dp")) for s in range(2)]
    return lc.Layout(
        lc.Mesh({"pp": 2, "dp": 2}), [*rules, ("^shared$", lc.Flat([("s", (6,))], "dp")), (".*", lc.P())], stages="pp"
    )


def stage_values(stage: int) -> torch.Tensor:
    return torch.arange(30.0) + 100 * stage


def _stage_flat_save(rank: int, group, path: str) -> None:
    stage, d = divmod(rank, 2)
    state = {
        "optim": {str(stage): stage_values(stage)[d * 15 : (d + 1) * 15].clone()},
        "shared": torch.arange(6.0)[d * 3 : (d + 1) * 3].clone(),  # held alike on both stages
    }
    lc.save(path, state, stage_flat_layout(), group=group)


def test_each_stage_saves_its_own_flat_buffer(ranks: RankPool, tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    ranks.run(_stage_flat_save, 4, path)
    reader = lc.open(path)
    for stage in range(2):
        values = stage_values(stage).reshape(2, 5, 3)
        for i, (name, _) in enumerate(stage_params(stage)):
            assert np.array_equal(reader.read(f"optim.{stage}.{name}"), values[i].numpy()), name
    assert np.array_equal(reader.read("shared.s"), np.arange(6.0))


class _Stage(torch.nn.Module):
    """Pipeline stage ``s`` of ``layers`` linear layers (``per`` a stage), named from 0 on each
    stage (``local``) or by their place in the whole model."""

    def __init__(self, s: int, per: int, local: bool, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed + s)
        first = 0 if local else s * per
        self.layers = torch.nn.ModuleDict({str(first + i): torch.nn.Linear(4, 4) for i in range(per)})


def _stage_layout(local: bool, per: int) -> lc.Layout:
    names = [lc.Renumber(r"(?:^|\.)layers\.(\d+)\.", "pp", per=per)] if local else []
    return lc.Layout(lc.Mesh({"pp": 2}), [(r".*", lc.P())], stages="pp", names=names)


def _stage_round_trip(rank: int, group, path: str, local: bool) -> tuple[bool, str | None]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    flat = StateDictOptions(flatten_optimizer_state_dict=True)  # param_groups per parameter, as torchtitan
    stage = _Stage(rank, 2, local, seed=0)
    opt = torch.optim.AdamW(stage.parameters(), lr=0.1)
    for p in stage.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    lc.save(path, lc.get_state(stage, opt, options=flat), _stage_layout(local, 2), group=group)
    fresh = _Stage(rank, 2, local, seed=5)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    done = lc.load_state(path, fresh, fresh_opt, _stage_layout(local, 2), group=group, options=flat)  # strict
    same = all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), stage.state_dict().values()))
    moments = [s["exp_avg"] for s in fresh_opt.state.values()], [s["exp_avg"] for s in opt.state.values()]
    same = same and done.unexpected == () and all(torch.equal(a, b) for a, b in zip(*moments, strict=True))
    grown = _Stage(
        rank, 3, local, seed=5
    )  # 6 layers now, 3 a stage: stage 1 holds 3 to 5, of which 4 and 5 are not stored
    try:
        lc.load_state(path, grown, None, _stage_layout(local, 3), group=group)
    except lc.TemplateMismatchError as err:
        return same, str(err)
    return same, None


@pytest.mark.parametrize("local", [True, False], ids=["local-names", "global-names"])
def test_pipeline_stages_load_state_under_strict(ranks: RankPool, tmp_path, local: bool) -> None:
    """Each stage holds part of the model: the arrays of the other stages are not "unexpected",
    and a stage's names are checked as stored (a local ``layers.0`` of stage 1 is ``layers.2``).
    A model that grew is refused on every rank, the stage that lacks layers naming them."""
    (same0, err0), (same1, err1) = ranks.run(_stage_round_trip, 2, str(tmp_path / "ck"), local)
    assert same0 and same1
    assert err1 is not None and "lacks 4 of the model's 6 entries" in err1, err1  # global layers 4 and 5
    assert err0 is not None and "rank 1: TemplateMismatchError" in err0, err0
