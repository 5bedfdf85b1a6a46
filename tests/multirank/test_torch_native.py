"""End to end with torch's own parallelisms: train, save, resume under another one, same numbers.

A tiny Llama (``tests/support/llama.py``) trains 3 AdamW steps under FSDP2 on 4 ranks and saves
``lc.get_state(model, opt)`` with no layout. It resumes under FSDP2 on 2 ranks, tensor
parallelism on 2 ranks, a 2-D dp=2 x tp=2 mesh on 4 ranks, and in one plain process. Every rank
trains on the same global batch, so each step's loss is the full-batch loss whatever the
parallelism, and a resumed run's next losses can be compared with the uninterrupted run's.

Each configuration is a fresh gloo world (``torch.multiprocessing.spawn``); rank 0 pickles what
it saw (full tensors, losses, caught errors) for the tests to assert on. Starting a world costs
seconds, so the worker of one world serves several tests through a module-scoped fixture.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import layoutckpt as lc
from tests.support import llama
from tests.support.multirank import spawn

SEED = 0
# Resumed models are built from another seed (or left uninitialized on meta): only a load that
# fills every tensor can give back the saved values.
OTHER_SEED = 7
STEPS = 3
NEXT = 2  # steps run after the save (uninterrupted) or after the resume, to compare losses
TIED = "model.output.weight"
EMBEDDING = "model.tok_embeddings.weight"


# --- worlds ------------------------------------------------------------------------------------


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _leaves(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{prefix}{k}.")
    elif isinstance(tree, list | tuple) and any(isinstance(v, dict | torch.Tensor) for v in tree):
        for i, v in enumerate(tree):
            yield from _leaves(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], tree


def _full(state: Any) -> dict[str, Any]:
    """Every leaf of a state, DTensors gathered to full tensors (a collective), all copied."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, leaf in _leaves(state):
        if isinstance(leaf, DTensor):
            out[name] = leaf.full_tensor().detach().clone()
        elif isinstance(leaf, torch.Tensor):
            out[name] = leaf.detach().clone()
        else:
            out[name] = leaf
    return out


def _errors(fn: Callable[[], Any]) -> list[BaseException | None]:
    """Every rank's exception from ``fn`` (None where it returned), gathered on all ranks."""
    import torch.distributed as dist

    try:
        fn()
        error = None
    except Exception as err:  # noqa: BLE001 - sent back for the test to check its type
        error = err
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return errors


def _resumed(model: llama.Llama, opt: torch.optim.Optimizer, loaded: Any) -> dict[str, Any]:
    """What a resumed run shows: full state, tied weights, and the losses of the next steps."""
    from torch.distributed.tensor import DTensor

    def local(t: Any) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    emb, out = model.tok_embeddings.weight, model.output.weight
    return {
        "state": _full(lc.get_state(model, opt)),
        "tied_parameter": out is emb,
        "tied_storage": local(out).untyped_storage().data_ptr() == local(emb).untyped_storage().data_ptr(),
        # lc.load gives one tensor to both tied names; lc.load_state says it restored everything.
        "tied_loaded": loaded["model"]["output.weight"] is loaded["model"]["tok_embeddings.weight"]
        if isinstance(loaded, dict)
        else loaded.restored == ("model", "optimizer") and loaded.missing == () and loaded.unexpected == (),
        "losses": [llama.train_step(model, opt, s) for s in range(STEPS, STEPS + NEXT)],
    }


# --- the workers ---------------------------------------------------------------------------------


def train_fsdp4(rank: int, world: int, out: Path) -> dict[str, Any]:
    """3 steps under FSDP2 on 4 ranks, saved by layoutckpt and by DCP, then 2 steps more."""
    import torch.distributed.checkpoint as dcp

    model = llama.apply_fsdp(llama.build(SEED), _mesh((world,), ("dp",)))
    opt = llama.optimizer(model)
    with torch.no_grad():
        fresh = llama.loss_fn(model, STEPS).detach()
    losses = [llama.train_step(model, opt, s) for s in range(STEPS)]
    state = lc.get_state(model, opt)
    lc.save(out / "ckpt", state, step=STEPS)
    dcp.save(state, checkpoint_id=out / "dcp")
    full = _full(state)
    return {
        "state": full,
        "fresh_loss": fresh,
        "losses": losses,
        "next_losses": [llama.train_step(model, opt, s) for s in range(STEPS, STEPS + NEXT)],
    }


def resume_fsdp2(rank: int, world: int, out: Path) -> dict[str, Any]:
    """FSDP2 on 2 ranks, from meta; then the same checkpoint through DCP and through lc.load."""
    import torch.distributed.checkpoint as dcp

    mesh = _mesh((world,), ("dp",))
    model = llama.apply_fsdp(llama.build(OTHER_SEED, device="meta"), mesh)
    llama.materialize(model)
    opt = llama.optimizer(model)
    result = _resumed(model, opt, lc.load_state(out / "ckpt", model, opt))

    def fresh_state() -> dict[str, Any]:
        m = llama.apply_fsdp(llama.build(OTHER_SEED), mesh)
        return lc.get_state(m, llama.optimizer(m))

    by_dcp = fresh_state()
    dcp.load(by_dcp, checkpoint_id=out / "dcp")
    by_lc = lc.load(out / "ckpt", like=fresh_state())
    result["dcp"] = _full(by_dcp)
    result["lc"] = _full(by_lc)
    # In place: the template's own DTensors are filled and given back.
    target = fresh_state()
    filled = lc.load(out / "ckpt", like=target, inplace=True)
    result["inplace"] = _full(filled)
    result["inplace_same_objects"] = all(filled["model"][n] is t for n, t in target["model"].items()) and all(
        filled["optim"]["state"][p]["exp_avg"] is s["exp_avg"] for p, s in target["optim"]["state"].items()
    )
    return result


def resume_tp2(rank: int, world: int, out: Path) -> dict[str, Any]:
    """Tensor parallelism on 2 ranks, into a model initialized from another seed."""
    model = llama.apply_tp(llama.build(OTHER_SEED), _mesh((world,), ("tp",))["tp"])
    opt = llama.optimizer(model)
    result = _resumed(model, opt, lc.load_state(out / "ckpt", model, opt))
    result["placements"] = {n: str(getattr(p, "placements", "plain")) for n, p in model.named_parameters()}
    return result


def resume_2d(rank: int, world: int, out: Path) -> dict[str, Any]:
    """dp=2 x tp=2 from a meta-device template, then the unit checks that need a 2-D mesh."""
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

    mesh = _mesh((2, 2), ("dp", "tp"))
    model = llama.apply_2d(llama.build(OTHER_SEED, device="meta"), mesh)
    opt = llama.optimizer(model)
    template = lc.get_state(model, opt)
    template_on_meta = all(
        t.device.type == "meta" for n, t in _leaves(template["model"]) if isinstance(t, torch.Tensor)
    )
    state = lc.load(out / "ckpt", like=template)
    llama.materialize(model)
    lc.set_state(model, opt, state)
    result = _resumed(model, opt, state)
    result["template_on_meta"] = template_on_meta
    wq = model.layers[0].attention.wq.weight
    result["wq_placements"] = tuple(type(p).__name__ for p in wq.placements)
    result["after_resume"] = _full(lc.get_state(model, opt))
    lc.save(out / "ckpt2d", lc.get_state(model, opt))

    # A rule that matches a DTensor must give the boxes its placements give.
    wrong = lc.Layout(lc.Mesh({"dp": 2, "tp": 2}), [(r"wq\.weight$", lc.P("dp")), (r".*", lc.P())])
    result["rule_errors"] = _errors(lambda: lc.save(out / "bad-rule", {"layers.0.attention.wq.weight": wq}, wrong))
    partial = DTensor.from_local(torch.full((4, 2), float(rank)), mesh["tp"], [Partial()])
    result["partial_errors"] = _errors(lambda: lc.save(out / "partial", {"pending": partial}))
    # 5 rows over dp x tp nest unevenly: DTensor gives rank 1 row 2, a spec rows 1:3. With no
    # columns the shards hold no element, but their shapes still differ.
    empty = distribute_tensor(torch.zeros(5, 0), mesh, [Shard(0), Shard(0)])
    result["empty_uneven_errors"] = _errors(lambda: lc.save(out / "empty-uneven", {"x": empty}))

    # DTensors on a flattened and on a sliced sub-mesh of the 2-D root mesh.
    flat = distribute_tensor(torch.arange(24.0).reshape(8, 3), mesh["dp", "tp"]._flatten(), [Shard(0)])
    sliced = distribute_tensor(torch.arange(24.0).reshape(4, 6) * -1, mesh["tp"], [Shard(1)])
    lc.save(out / "submesh", {"flat": flat, "sliced": sliced})
    like = {
        "flat": distribute_tensor(torch.zeros(8, 3), flat.device_mesh, [Shard(0)]),
        "sliced": distribute_tensor(torch.zeros(4, 6), sliced.device_mesh, [Shard(1)]),
    }
    back = lc.load(out / "submesh", like=like)
    same = [torch.equal(back[k].to_local(), v.to_local()) for k, v in {"flat": flat, "sliced": sliced}.items()]
    placements = [tuple(back[k].placements) == tuple(like[k].placements) for k in like]
    result["submesh_ok"] = _gather_all(all(same) and all(placements))
    return result


def _gather_all(value: Any) -> list[Any]:
    import torch.distributed as dist

    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    # gloo's worker runs collectives in order and lets go of each before the next: once this
    # barrier (whose tensors are torch's own) is done, no Python tensor of the gather is left for
    # it to free while the rank shuts down.
    dist.barrier()
    return values


# --- fixtures: one world each ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("torch-native")
    return out, spawn(train_fsdp4, 4, out)


@pytest.fixture(scope="module")
def fsdp2(trained: tuple[Path, dict[str, Any]]) -> dict[str, Any]:
    return spawn(resume_fsdp2, 2, trained[0])


@pytest.fixture(scope="module")
def twod(trained: tuple[Path, dict[str, Any]]) -> dict[str, Any]:
    return spawn(resume_2d, 4, trained[0])


# --- checks ----------------------------------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    ints = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}
    return t.detach().contiguous().view(ints[t.element_size()])


def _assert_same_state(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Bit for bit: every parameter, AdamW moment and step, and every optimizer setting."""
    assert sorted(got) == sorted(want)
    moments = [n for n in want if n.endswith((".exp_avg", ".exp_avg_sq", ".step"))]
    assert len(moments) == 3 * len(list(llama.build(0, device="meta").parameters()))
    for name, w in want.items():
        g = got[name]
        if isinstance(w, torch.Tensor):
            assert isinstance(g, torch.Tensor) and g.dtype == w.dtype and g.shape == w.shape, name
            assert torch.equal(_bits(g), _bits(w)), f"{name} differs from the saved run"
        else:
            assert g == w, name


def _assert_resumed(result: dict[str, Any], reference: dict[str, Any], *, exact: bool, tol: float = 0.0) -> None:
    _assert_same_state(result["state"], reference["state"])
    assert result["tied_parameter"] and result["tied_storage"] and result["tied_loaded"]
    resumed, uninterrupted = result["losses"][0], reference["next_losses"][0]
    if exact:
        assert torch.equal(_bits(resumed), _bits(uninterrupted)), (resumed.item(), uninterrupted.item())
    else:
        assert abs(resumed.item() - uninterrupted.item()) <= tol, (resumed.item(), uninterrupted.item())
    # A model that had not resumed would be near the fresh loss, far above the trained one.
    assert reference["fresh_loss"].item() - resumed.item() > 0.5, (resumed.item(), reference["fresh_loss"].item())
    # The step after uses the loaded AdamW moments (a fresh optimizer is 0.03 off there); its
    # gradients are reduced over another world, which may change their last bits.
    assert abs(result["losses"][1].item() - reference["next_losses"][1].item()) <= 1e-5


def test_checkpoint_holds_the_tied_embedding_once(trained: tuple[Path, dict[str, Any]]) -> None:
    out, ref = trained
    rd = lc.open(out / "ckpt")
    assert rd.step == STEPS
    assert EMBEDDING in rd.keys() and TIED not in rd.keys()
    assert rd.aliases == {TIED: EMBEDDING}
    # The tied weight's moments are stored once too: the optimizer keys it by its first name.
    assert not [k for k in rd.keys() if k.startswith("optim.state.output.")]
    assert np.array_equal(rd.read(TIED), ref["state"][EMBEDDING].numpy())
    assert len(rd.keys()) == len([k for k, v in ref["state"].items() if isinstance(v, torch.Tensor)]) - 1


def test_one_plain_process_reads_a_slice_of_a_dtensor_checkpoint(trained: tuple[Path, dict[str, Any]]) -> None:
    out, ref = trained
    name = "model.layers.1.feed_forward.w2.weight"
    rd = lc.open(out / "ckpt")
    assert rd.info(name).spec == lc.P("dp")
    assert rd.info(name).saved_mesh == lc.Mesh({"dp": 4})
    got = rd.read(name, np.s_[5:27, 30:50])
    want = ref["state"][name][5:27, 30:50].numpy()
    assert got.dtype == want.dtype and np.array_equal(got.view(np.int32), want.view(np.int32))
    step = rd.read("optim.state.layers.1.feed_forward.w2.weight.step")
    assert step == STEPS


def test_resume_fsdp2_on_two_ranks(trained: tuple[Path, dict[str, Any]], fsdp2: dict[str, Any]) -> None:
    _assert_resumed(fsdp2, trained[1], exact=True)


def test_dcp_and_layoutckpt_load_the_same_tensors(fsdp2: dict[str, Any]) -> None:
    by_dcp, by_lc = fsdp2["dcp"], fsdp2["lc"]
    tensors = [n for n, v in by_dcp.items() if isinstance(v, torch.Tensor)]
    assert len(tensors) > 3 * len(list(llama.build(0, device="meta").parameters()))
    assert sorted(by_lc) == sorted(by_dcp)
    for name in tensors:
        assert torch.equal(_bits(by_lc[name]), _bits(by_dcp[name])), name


def test_inplace_load_fills_the_template_dtensors(fsdp2: dict[str, Any]) -> None:
    assert fsdp2["inplace_same_objects"]
    for name, value in fsdp2["dcp"].items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(_bits(fsdp2["inplace"][name]), _bits(value)), name


def test_resume_tensor_parallel_on_two_ranks(trained: tuple[Path, dict[str, Any]]) -> None:
    out, ref = trained
    result = spawn(resume_tp2, 2, out)
    assert result["placements"]["layers.0.attention.wq.weight"] == "(Shard(dim=0),)"
    assert result["placements"]["layers.0.attention.wo.weight"] == "(Shard(dim=1),)"
    assert result["placements"]["tok_embeddings.weight"] == "plain"
    # Row-parallel projections sum partial products across the ranks: not bit-exact, but close.
    _assert_resumed(result, ref, exact=False, tol=1e-5)


def test_resume_2d_from_a_meta_template(trained: tuple[Path, dict[str, Any]], twod: dict[str, Any]) -> None:
    assert twod["template_on_meta"]
    _assert_resumed(twod, trained[1], exact=False, tol=1e-5)


def test_strided_shards_save_as_minor_axis(trained: tuple[Path, dict[str, Any]], twod: dict[str, Any]) -> None:
    out, _ = trained
    assert twod["wq_placements"] == ("_StridedShard", "Shard")
    rd = lc.open(out / "ckpt2d")
    assert rd.info("model.layers.0.attention.wq.weight").spec == lc.P(("tp", "dp"))
    assert rd.info("model.layers.0.attention.wo.weight").spec == lc.P("dp", "tp")
    assert rd.info(EMBEDDING).spec == lc.P("dp")
    assert rd.aliases == {TIED: EMBEDDING}
    # Every row landed where it belongs: the stored arrays are the full tensors.
    for name, want in twod["after_resume"].items():
        if isinstance(want, torch.Tensor) and name != TIED:
            got = rd.read(name)
            assert np.array_equal(np.asarray(got).view(want.numpy().dtype), want.numpy()), name


def test_rule_that_disagrees_with_placements_raises(twod: dict[str, Any]) -> None:
    for err in twod["rule_errors"]:
        assert isinstance(err, lc.LayoutError), err
        assert "layers.0.attention.wq.weight" in str(err) and "P('dp')" in str(err)


def test_partial_dtensor_raises(twod: dict[str, Any]) -> None:
    for err in twod["partial_errors"]:
        assert isinstance(err, lc.LayoutError), err
        assert "'pending'" in str(err) and "Partial" in str(err)


def test_an_empty_dtensor_split_unevenly_on_two_axes_gets_the_layout_error(twod: dict[str, Any]) -> None:
    for err in twod["empty_uneven_errors"]:
        assert isinstance(err, lc.LayoutError), err
        assert "'x' with shape (5, 0)" in str(err) and "pad the dimension" in str(err)


def test_dtensors_on_flattened_and_sliced_submeshes(trained: tuple[Path, dict[str, Any]], twod: dict[str, Any]) -> None:
    out, _ = trained
    assert twod["submesh_ok"] == [True] * 4
    rd = lc.open(out / "submesh")
    assert rd.info("flat").spec == lc.P(("dp", "tp"))
    assert rd.info("sliced").spec == lc.P(None, "tp")
    assert np.array_equal(rd.read("flat"), np.arange(24.0, dtype=np.float32).reshape(8, 3))
    assert np.array_equal(rd.read("sliced"), np.arange(24.0, dtype=np.float32).reshape(4, 6) * -1)


def test_resume_in_one_plain_process(trained: tuple[Path, dict[str, Any]]) -> None:
    import torch.distributed as dist

    out, ref = trained
    assert not dist.is_initialized()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks ran, so that the kernels sum in the same order
    try:
        model = llama.materialize(llama.build(OTHER_SEED, device="meta"))
        opt = llama.optimizer(model)
        result = _resumed(model, opt, lc.load_state(out / "ckpt", model, opt))
    finally:
        torch.set_num_threads(threads)
    _assert_resumed(result, ref, exact=True)


def test_a_dtensor_on_its_own_mesh_records_that_mesh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A layout's mesh names the plain tensors; a DTensor keeps the mesh its placements name."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    try:
        w = distribute_tensor(torch.arange(12.0).reshape(4, 3), _mesh((1,), ("dp",)), [Shard(0)])
        layout = lc.Layout(lc.Mesh({"tp": 1}), [(r"^x$", lc.P("tp"))])
        lc.save(tmp_path / "ck", {"w": w, "x": torch.ones(5)}, layout)
        rd = lc.open(tmp_path / "ck")
        assert rd.info("w").saved_mesh == lc.Mesh({"dp": 1}) and rd.info("w").spec == lc.P("dp")
        assert rd.info("x").saved_mesh == lc.Mesh({"tp": 1}) and rd.info("x").spec == lc.P("tp")
        assert rd.meta.arrays["x"].mesh is None  # the root's mesh is not repeated per array
        back = lc.load(tmp_path / "ck", like={"w": w, "x": torch.zeros(5)})
        assert torch.equal(back["w"].full_tensor(), w.full_tensor()) and back["w"].placements == (Shard(0),)
    finally:
        dist.destroy_process_group()
