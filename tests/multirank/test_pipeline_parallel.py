"""End to end: pipeline x tensor parallelism saved, resumed under other pipeline degrees.

A tiny Llama (``tests/support/llama.py``, 4 blocks, output projection untied from the embedding:
the embedding lives on the first stage, the output on the last) trains 3 AdamW steps on 4 ranks
as PP=2 x TP=2: a real ``torch.distributed.pipelining`` ``PipelineStage`` per rank, driven by
``Schedule1F1B`` over 4 microbatches (``tests/support/pipeline.py``), its blocks tensor-parallel
through ``parallelize_module`` on the ``tp`` sub-mesh of a ``("pp", "tp")`` device mesh. Stages
keep the model's GLOBAL names (``layers.2...`` on stage 1), so every rank saves only the arrays of
its stage, with ``Layout(..., stages="pp")``. The optimizer's state is taken as torchtitan takes
it from a pipeline stage, ``flatten_optimizer_state_dict=True``: every entry, the param-group
settings included, is keyed by a parameter's name, so that the stages' names stay disjoint.

It resumes under PP=1 x TP=2, PP=4 x TP=1, DP=2 x PP=2 (FSDP2 over ``dp``) and in one plain
process. Right after the load, every parameter, AdamW moment and step must be bit-equal to the
saved ones. The next steps' losses must equal the uninterrupted run's up to ``rtol=1e-5``, not
bit for bit: another TP degree sums the row-parallel products in another order, and data
parallelism averages the gradients over the ranks.

The layouts' rules name the plain tensors only (embedding, norms, output, AdamW steps): the
DTensors of tensor parallelism and FSDP2 carry their placements, which need no rule.

Each configuration is a fresh gloo world (``torch.multiprocessing.spawn``); rank 0 pickles what
every rank saw (full tensors gathered over the world) for the tests to assert on. The training
world serves every test through a module-scoped fixture; each resume is one world.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import layoutckpt as lc
from tests.support import llama
from tests.support import pipeline as pl
from tests.support.multirank import spawn
from tests.support.oracle import leaves

SEED = 0
# Resumed models are built from another seed: only a load that fills every tensor gives back the
# saved values.
OTHER_SEED = 7
STEPS = 3
NEXT = 2  # steps run after the save (uninterrupted) or after the resume, to compare losses
RTOL = 1e-5


def _options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


# Rules for the plain tensors only: DTensors (tensor-parallel blocks, FSDP2's shards, and their
# AdamW moments) carry their own placements and need no rule. AdamW's steps are plain everywhere;
# under tensor parallelism the embedding, the norms, the output projection and their moments are
# plain too, whole on every rank of a stage; with neither TP nor FSDP everything is.
STEPS_RULE = (r"\.step$", lc.P())
TP_PLAIN = [STEPS_RULE, (r"(tok_embeddings|norm|output)\.weight(\.|$)", lc.P())]
ALL_PLAIN = [(r".*", lc.P())]


def _layout(mesh: dict[str, int], rules: list[tuple[str, Any]]) -> lc.Layout:
    """Each ``pp`` coordinate holds its stage's names, each stored once under its global name."""
    return lc.Layout(lc.Mesh(mesh), rules, stages="pp")


# --- worlds ------------------------------------------------------------------------------------


def _full(state: Any) -> dict[str, Any]:
    """Every leaf of a state, DTensors gathered to full tensors (a collective), all copied."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, leaf in leaves(state):
        if isinstance(leaf, DTensor):
            out[name] = leaf.full_tensor().detach().clone()
        elif isinstance(leaf, torch.Tensor):
            out[name] = leaf.detach().clone()
        else:
            out[name] = leaf
    return out


def _gather(value: Any) -> list[Any]:
    """Every rank's ``value``, on every rank."""
    import torch.distributed as dist

    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    # gloo's worker runs collectives in order and lets go of each before the next: once this
    # barrier is done, no Python tensor of the gather is left for it to free as the rank ends.
    dist.barrier()
    return values


def _whole(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The stages' full states as one: ranks of one stage must agree bit for bit."""
    merged: dict[str, Any] = {}
    for state in per_rank:
        for name, value in state.items():
            if name in merged:
                same = _equal(merged[name], value)
                assert same, f"{name}: two ranks of one stage hold different values"
            merged[name] = value
    return merged


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _pipeline(seed: int, pp: int, tp: int = 1, dp: int = 1) -> tuple[pl.Pipeline, torch.optim.Optimizer]:
    """This rank's stage of the model built from ``seed``, parallelized, with its schedule."""
    assert tp == 1 or dp == 1
    inner = "dp" if dp > 1 else "tp"
    mesh = _mesh((pp, max(tp, dp)), ("pp", inner))
    stage = mesh["pp"].get_local_rank()
    module = pl.build_stage(seed, stage, pp)
    if tp > 1:
        pl.apply_tp(module, mesh["tp"])
    dp_group, dp_rank = None, 0
    if dp > 1:
        pl.apply_fsdp(module, mesh["dp"])
        dp_group, dp_rank = mesh["dp"].get_group(), mesh["dp"].get_local_rank()
    pipe = pl.Pipeline(module, stage, pp, mesh["pp"].get_group(), dp_group, dp_rank)
    return pipe, llama.optimizer(module)


def _state(pipe: pl.Pipeline, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return lc.get_state(pipe.module, opt, options=_options())


# --- the workers ---------------------------------------------------------------------------------


def train_pp2_tp2(rank: int, world: int, out: Path) -> dict[str, Any]:
    """3 steps as PP=2 x TP=2, saved, then the uninterrupted run's next 2 steps."""
    pipe, opt = _pipeline(SEED, pp=2, tp=2)
    losses = [pipe.train_step(opt, s) for s in range(STEPS)]
    state = _state(pipe, opt)
    lc.save(out / "ckpt", state, _layout({"pp": 2, "tp": 2}, TP_PLAIN), step=STEPS)
    saved = _full(state)
    placements = {n: str(getattr(p, "placements", "plain")) for n, p in pipe.module.named_parameters()}
    next_losses = [pipe.train_step(opt, s) for s in range(STEPS, STEPS + NEXT)]
    ranks = _gather({"stage": pipe.stage, "state": saved, "placements": placements})
    return {
        "ranks": ranks,
        "state": _whole([r["state"] for r in ranks]),
        "losses": losses,
        "next_losses": next_losses,
    }


def _resume(out: Path, *, pp: int, tp: int = 1, dp: int = 1, layout: lc.Layout, inplace: bool) -> dict[str, Any]:
    """Build the model from another seed under this parallelism, load, gather, train on."""
    pipe, opt = _pipeline(OTHER_SEED, pp=pp, tp=tp, dp=dp)
    template = _state(pipe, opt)
    if inplace:
        loaded = lc.load(out / "ckpt", layout, like=template, inplace=True)
        filled = all(loaded["model"][n] is t for n, t in template["model"].items())
    else:
        loaded = lc.load(out / "ckpt", layout, like=template)
        filled = True
    lc.set_state(pipe.module, opt, loaded, options=_options())
    state = _full(_state(pipe, opt))
    losses = [pipe.train_step(opt, s) for s in range(STEPS, STEPS + NEXT)]
    ranks = _gather({"stage": pipe.stage, "state": state, "filled": filled})
    return {"ranks": ranks, "state": _whole([r["state"] for r in ranks]), "losses": losses}


def resume_pp1_tp2(rank: int, world: int, out: Path) -> dict[str, Any]:
    return _resume(out, pp=1, tp=2, layout=_layout({"pp": 1, "tp": 2}, TP_PLAIN), inplace=True)


def resume_pp4(rank: int, world: int, out: Path) -> dict[str, Any]:
    return _resume(out, pp=4, layout=_layout({"pp": 4}, ALL_PLAIN), inplace=False)


def resume_dp2_pp2(rank: int, world: int, out: Path) -> dict[str, Any]:
    return _resume(out, pp=2, dp=2, layout=_layout({"pp": 2, "dp": 2}, [STEPS_RULE]), inplace=True)


# --- fixtures: one world each ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("pipeline")
    return out, spawn(train_pp2_tp2, 4, out)


# --- checks ----------------------------------------------------------------------------------------


def _dotted(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Every leaf under its dotted name, through dicts, lists and tuples alike (a load without a
    template builds the tree from the stored global names, with dicts only)."""
    if isinstance(tree, dict | list | tuple):
        for k, v in tree.items() if isinstance(tree, dict) else enumerate(tree):
            yield from _dotted(v, f"{prefix}{k}.")
    else:
        yield prefix[:-1], tree


def _bits(t: torch.Tensor) -> torch.Tensor:
    ints = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}
    return t.detach().contiguous().view(ints[t.element_size()])


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(_bits(a), _bits(b))
        )
    return bool(a == b)


def _assert_same_state(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Bit for bit: every parameter, AdamW moment and step, and every optimizer setting."""
    assert sorted(got) == sorted(want)
    params = [n for n in want if n.startswith("model.")]
    assert len(params) == len(list(llama.build(0, pl.CONFIG, device="meta").parameters()))
    moments = [n for n in want if n.endswith((".exp_avg", ".exp_avg_sq", ".step"))]
    assert len(moments) == 3 * len(params)
    for name, w in want.items():
        assert _equal(got[name], w), f"{name} differs from the saved run"


def _assert_next_losses(resumed: list[torch.Tensor], uninterrupted: list[torch.Tensor]) -> None:
    # The first step's loss is computed from the loaded weights; the second one's from weights
    # updated with the loaded AdamW moments and steps.
    assert len(resumed) == len(uninterrupted) == NEXT
    for got, want in zip(resumed, uninterrupted, strict=True):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=0)


def test_training_learns_and_each_stage_holds_its_own_names(trained: tuple[Path, dict[str, Any]]) -> None:
    _, ref = trained
    # The batches follow a pattern that a few steps learn: a resumed run that had lost the
    # weights would be far from the uninterrupted run's losses.
    assert ref["losses"][0].item() - ref["next_losses"][0].item() > 0.5, ref["losses"]
    by_stage: dict[int, set[str]] = {}
    for r in ref["ranks"]:
        names = set(r["state"])
        assert by_stage.setdefault(r["stage"], names) == names  # the tp ranks of a stage agree
    first, last = (by_stage[0], by_stage[1])
    assert not first & last
    assert "model.tok_embeddings.weight" in first and "model.output.weight" in last
    assert "model.layers.1.attention.wq.weight" in first and "model.layers.2.attention.wq.weight" in last
    assert "optim.state.layers.3.feed_forward.w2.weight.exp_avg_sq" in last
    placements = ref["ranks"][0]["placements"]
    assert placements["layers.0.attention.wq.weight"] == "(Shard(dim=0),)"
    assert placements["layers.0.attention.wo.weight"] == "(Shard(dim=1),)"
    assert placements["tok_embeddings.weight"] == "plain"


def test_checkpoint_holds_every_array_once_under_its_global_name(trained: tuple[Path, dict[str, Any]]) -> None:
    out, ref = trained
    rd = lc.open(out / "ckpt")
    assert rd.step == STEPS
    tensors = {n: v for n, v in ref["state"].items() if isinstance(v, torch.Tensor)}
    assert sorted(rd.keys()) == sorted(tensors)
    for name, want in tensors.items():
        got = np.asarray(rd.read(name))
        assert got.shape == tuple(want.shape), name
        assert torch.equal(_bits(torch.from_numpy(got.copy())), _bits(want)), name


def test_resume_pp1_tp2(trained: tuple[Path, dict[str, Any]]) -> None:
    out, ref = trained
    result = spawn(resume_pp1_tp2, 2, out)
    assert all(r["filled"] for r in result["ranks"])  # inplace=True filled the template's tensors
    _assert_same_state(result["state"], ref["state"])
    _assert_next_losses(result["losses"], ref["next_losses"])


def test_resume_pp4_tp1(trained: tuple[Path, dict[str, Any]]) -> None:
    out, ref = trained
    result = spawn(resume_pp4, 4, out)
    assert sorted({r["stage"] for r in result["ranks"]}) == [0, 1, 2, 3]
    assert "model.layers.3.attention.wq.weight" in result["ranks"][3]["state"]
    _assert_same_state(result["state"], ref["state"])
    _assert_next_losses(result["losses"], ref["next_losses"])


def test_resume_dp2_pp2(trained: tuple[Path, dict[str, Any]]) -> None:
    out, ref = trained
    result = spawn(resume_dp2_pp2, 4, out)
    assert all(r["filled"] for r in result["ranks"])
    _assert_same_state(result["state"], ref["state"])
    _assert_next_losses(result["losses"], ref["next_losses"])


def test_resume_in_one_plain_process(trained: tuple[Path, dict[str, Any]]) -> None:
    import torch.distributed as dist

    out, ref = trained
    assert not dist.is_initialized()
    # Without a layout, in one process: every stored array and value under its global name.
    loaded = dict(_dotted(lc.load(out / "ckpt")))
    want = dict(_dotted(ref["state"]))
    assert sorted(loaded) == sorted(want)
    for name, value in want.items():
        got = torch.as_tensor(loaded[name]) if isinstance(value, torch.Tensor) else loaded[name]
        assert _equal(got, value), name

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks ran, so that the kernels sum in the same order
    try:
        model = llama.build(OTHER_SEED, pl.CONFIG)
        opt = llama.optimizer(model)
        result = lc.load_state(out / "ckpt", model, opt, options=_options())
        assert result.restored == ("model", "optimizer") and result.missing == () and result.unexpected == ()
        state = _full(lc.get_state(model, opt, options=_options()))
        losses = [pl.plain_train_step(model, opt, s) for s in range(STEPS, STEPS + NEXT)]
    finally:
        torch.set_num_threads(threads)
    _assert_same_state(state, ref["state"])
    _assert_next_losses(losses, ref["next_losses"])
