"""End to end: a mixture-of-experts layer resumed EP=4 -> EP=2 (x TP=2) -> 1, bit for bit.

Eight experts (bf16 weights, fp32 Adam moments), a router and a shared expert, in two forms:

- stacked: each expert weight is one ``(E, ffn, hidden)`` / ``(E, hidden, ffn)`` array, split over
  ``ep`` on dim 0 and, inside the experts, over ``tp`` (``P("ep", "tp", None)``, ``P("ep", None, "tp")``);
- per-module: each expert-parallel rank holds modules ``moe.experts.{j}`` numbered LOCALLY from 0,
  declared with ``lc.Renumber(r"experts\\.(\\d+)\\.", axis="ep", per=E // ep)``; inside an expert,
  ``linear_fc1`` is column-parallel and ``linear_fc2`` row-parallel over ``tp``.

The router and the shared expert are replicated on every rank: held by every expert-parallel
rank, stored once. Every rank's tensors are cut here, with ``torch.chunk``, from one global state.
4 gloo ranks save at EP=4; 4 ranks load at EP=2 x TP=2 (into tensors of another seed, in place)
and save again; one plain process loads that at EP=1, and the first checkpoint too.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import layoutckpt as lc
from tests.support.multirank import RankPool
from tests.support.oracle import leaves

E, HIDDEN, FFN = 8, 8, 12
SEED = 0
KINDS = ["stacked", "modules"]


def _rand(gen: torch.Generator, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


def global_state(kind: str, seed: int) -> dict[str, torch.Tensor]:
    """Every array under its global name: parameters (bf16, router fp32) and their fp32 moments."""
    gen = torch.Generator().manual_seed(seed)
    params = {
        "moe.router.weight": _rand(gen, E, HIDDEN, dtype=torch.float32),
        "moe.shared_expert.linear_fc1.weight": _rand(gen, 2 * FFN, HIDDEN, dtype=torch.bfloat16),
        "moe.shared_expert.linear_fc2.weight": _rand(gen, HIDDEN, FFN, dtype=torch.bfloat16),
    }
    if kind == "stacked":
        params["moe.experts.linear_fc1.weight"] = _rand(gen, E, FFN, HIDDEN, dtype=torch.bfloat16)
        params["moe.experts.linear_fc2.weight"] = _rand(gen, E, HIDDEN, FFN, dtype=torch.bfloat16)
    else:
        for j in range(E):
            params[f"moe.experts.{j}.linear_fc1.weight"] = _rand(gen, FFN, HIDDEN, dtype=torch.bfloat16)
            params[f"moe.experts.{j}.linear_fc2.weight"] = _rand(gen, HIDDEN, FFN, dtype=torch.bfloat16)
    moments = {f"optim.exp_avg.{n}": _rand(gen, *p.shape, dtype=torch.float32) for n, p in params.items()}
    return params | moments


def layout(kind: str, ep: int, tp: int, replicas: list[tuple[str, str]] | None = None) -> lc.Layout:
    mesh = lc.Mesh({"ep": ep, "tp": tp})
    if kind == "stacked":
        rules = [
            (r"experts\.linear_fc1\.weight$", lc.P("ep", "tp", None)),
            (r"experts\.linear_fc2\.weight$", lc.P("ep", None, "tp")),
            (r".*", lc.P()),
        ]
        return lc.Layout(mesh, rules)
    rules = [
        (r"experts\.\d+\.linear_fc1\.weight$", lc.P("tp", None)),
        (r"experts\.\d+\.linear_fc2\.weight$", lc.P(None, "tp")),
        (r".*", lc.P()),
    ]
    names = [lc.Renumber(r"experts\.(\d+)\.", axis="ep", per=E // ep)]
    if replicas is None:
        return lc.Layout(mesh, rules, names=names)
    return lc.Layout(mesh, rules, names=names, replicas=replicas)


def local_state(full: dict[str, torch.Tensor], kind: str, ep: int, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """What rank ``rank`` of Mesh({"ep": ep, "tp": tp}) holds, under its local names."""
    e, t = divmod(rank, tp)
    per = E // ep
    out = {}
    for name, x in full.items():
        if kind == "stacked" and ".experts." in name:
            dim = 1 if "linear_fc1" in name else 2
            out[name] = x.chunk(ep)[e].chunk(tp, dim=dim)[t].clone()
        elif ".experts." in name:
            prefix, rest = name.split(".experts.")
            j, tail = rest.split(".", 1)
            if int(j) // per != e:
                continue
            dim = 0 if "linear_fc1" in tail else 1
            out[f"{prefix}.experts.{int(j) - e * per}.{tail}"] = x.chunk(tp, dim=dim)[t].clone()
        else:
            out[name] = x.clone()
    return out


# --- tasks on the pool's ranks ---------------------------------------------------------------------


def _save(rank: int, group: Any, path: str, kind: str, ep: int, tp: int) -> list[str]:
    state = local_state(global_state(kind, SEED), kind, ep, tp, rank)
    lc.save(path, state, layout(kind, ep, tp), group=group)
    return sorted(state)


def _load_and_save(rank: int, group: Any, src: str, dst: str, kind: str, ep: int, tp: int) -> dict[str, torch.Tensor]:
    """Load in place into tensors of another seed, then save what was loaded under this layout."""
    target = local_state(global_state(kind, SEED + 1), kind, ep, tp, rank)
    loaded = lc.load(src, layout(kind, ep, tp), like=target, inplace=True, group=group)
    assert sorted(loaded) == sorted(target) and all(loaded[k] is target[k] for k in target)
    lc.save(dst, target, layout(kind, ep, tp), group=group)
    return {k: v.clone() for k, v in target.items()}


def _save_disagreeing(rank: int, group: Any, path: str, policy: str | None) -> tuple[bool, str, str]:
    """Per-module experts at EP=4 whose router copies differ: rank r holds a router of r's."""
    state = local_state(global_state("modules", SEED), "modules", 4, 1, rank)
    state["moe.router.weight"] = torch.full((E, HIDDEN), float(rank))
    try:
        lc.save(
            path, state, layout("modules", 4, 1, None if policy is None else [(r"\.router\.", policy)]), group=group
        )
    except Exception as err:  # noqa: BLE001 - sent back for the test to check its type
        return isinstance(err, lc.InconsistentShardsError), type(err).__name__, str(err)
    return False, "", "saved"


def _bits(t: torch.Tensor) -> torch.Tensor:
    ints = {4: torch.int32, 2: torch.int16}
    return t.detach().contiguous().view(ints[t.element_size()])


def _assert_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], where: str) -> None:
    assert sorted(got) == sorted(want), where
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype and g.shape == w.shape, (where, name, g.dtype, g.shape)
        assert torch.equal(_bits(g), _bits(w)), f"{where}: {name} differs"


@pytest.fixture(scope="module", params=KINDS)
def resumed(
    request: pytest.FixtureRequest, ranks: RankPool, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """EP=4 (tp=1) saved; loaded at EP=2 x TP=2 and saved again."""
    kind = request.param
    root = tmp_path_factory.mktemp(f"moe-{kind}")
    ep4, ep2 = root / "ep4", root / "ep2"
    held = ranks.run(_save, 4, os.fspath(ep4), kind, 4, 1)
    loaded = ranks.run(_load_and_save, 4, os.fspath(ep4), os.fspath(ep2), kind, 2, 2)
    return {"kind": kind, "ep4": ep4, "ep2": ep2, "held": held, "loaded": loaded}


def test_ep4_checkpoint_stores_global_names_once(resumed: dict[str, Any]) -> None:
    kind = resumed["kind"]
    full = global_state(kind, SEED)
    if kind == "modules":  # local names on every expert-parallel rank: experts.0 and experts.1
        assert all(sum(".experts.0." in n for n in held) == 4 for held in resumed["held"])
    rd = lc.open(resumed["ep4"])
    assert sorted(rd.keys()) == sorted(full)
    for name, want in full.items():
        got = rd.read_torch(name)
        assert torch.equal(_bits(got), _bits(want)), name


def test_ep4_to_ep2_tp2(resumed: dict[str, Any]) -> None:
    kind = resumed["kind"]
    full = global_state(kind, SEED)
    for rank, got in enumerate(resumed["loaded"]):
        _assert_bits(got, local_state(full, kind, 2, 2, rank), f"EP=2 x TP=2, rank {rank}")


@pytest.mark.parametrize("source", ["ep2", "ep4"])
def test_to_ep1_in_one_plain_process(resumed: dict[str, Any], source: str) -> None:
    kind = resumed["kind"]
    full = global_state(kind, SEED)
    like = {n: torch.empty(x.shape, dtype=x.dtype, device="meta") for n, x in full.items()}
    _assert_bits(lc.load(resumed[source], layout(kind, 1, 1), like=like), full, f"EP=1 from {source}")
    _assert_bits(dict(leaves(lc.load(resumed[source]))), full, f"plain load of {source}")
    rd = lc.open(resumed[source])
    assert sorted(rd.keys()) == sorted(full)
    for name, want in full.items():
        assert torch.equal(_bits(rd.read_torch(name)), _bits(want)), name


def test_router_copies_that_differ_are_refused(ranks: RankPool, tmp_path: Path) -> None:
    path = tmp_path / "disagree"
    for rank, (inconsistent, kind, message) in enumerate(ranks.run(_save_disagreeing, 4, os.fspath(path), None)):
        assert inconsistent, f"rank {rank}: {kind}: {message}"
        assert "moe.router.weight" in message, message
    with pytest.raises(lc.CheckpointNotFoundError):
        lc.open(path)
    assert not path.exists() or not any(path.rglob("*")), sorted(path.rglob("*"))


@pytest.mark.parametrize(("policy", "value"), [("first", 0.0), ("mean", 1.5)])
def test_router_copies_declared_first_or_mean(ranks: RankPool, tmp_path: Path, policy: str, value: float) -> None:
    path = tmp_path / policy
    assert ranks.run(_save_disagreeing, 4, os.fspath(path), policy) == [(False, "", "saved")] * 4
    rd = lc.open(path)
    assert torch.equal(rd.read_torch("moe.router.weight"), torch.full((E, HIDDEN), value))
    full = global_state("modules", SEED)
    for name in full:
        if name != "moe.router.weight":
            assert torch.equal(_bits(rd.read_torch(name)), _bits(full[name])), name
