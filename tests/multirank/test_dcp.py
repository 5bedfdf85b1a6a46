"""DCP checkpoints of FSDP2 and tensor-parallel states, imported by several ranks or by one
process, then loaded resharded onto another number of ranks: bit for bit the state saved.

A tiny Llama (``tests/support/llama.py``) trains one AdamW step, so that its optimizer holds
state, and ``dcp.save`` writes ``lc.get_state(model, opt)`` as DCP does for any state dict: one
chunk per rank of each sharded tensor. The device meshes are built on the pool's own process
groups (``DeviceMesh.from_group``), so no rank outside the job takes part.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

import layoutckpt as lc
from tests.support import llama


def _mesh(group: Any, name: str) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, "cpu", mesh_dim_names=(name,))


def _leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(_leaves(v, f"{prefix}{k}."))
    elif isinstance(tree, torch.Tensor):
        out[prefix[:-1]] = tree
    return out


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().copy()


def save_dcp(rank: int, group: Any, kind: str, out: str) -> dict[str, Any] | None:
    """One training step under FSDP2 or tensor parallelism, saved by ``dcp.save``; rank 0
    returns every tensor of the state, gathered whole, with its dtype."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    if kind == "fsdp":
        model = llama.apply_fsdp(llama.build(0), _mesh(group, "dp"))
    else:
        model = llama.apply_tp(llama.build(0), _mesh(group, "tp"))
    opt = llama.optimizer(model)
    llama.train_step(model, opt, 0)
    state = lc.get_state(model, opt)
    dcp.save(state, checkpoint_id=out, process_group=group)
    full = {n: t.full_tensor() if isinstance(t, DTensor) else t for n, t in _leaves(state).items()}
    return {n: (str(t.dtype), tuple(t.shape), _bits(t)) for n, t in full.items()} if rank == 0 else None


def import_dcp(rank: int, group: Any, src: str, dst: str) -> tuple[int, tuple[str, ...]]:
    done = lc.import_dcp(src, dst, trust_pickle=True, group=group)
    return done.arrays, done.skipped


def load_rows(rank: int, group: Any, path: str) -> dict[str, Any]:
    """This rank's rows of every array under dp=<ranks> (0-d arrays whole)."""
    k = torch.distributed.get_world_size(group)
    layout = lc.Layout(lc.Mesh({"dp": k}), [(r"\.step$", lc.P()), (r".*", lc.P("dp"))])
    got = lc.load(path, layout, group=group)
    return {n: (str(t.dtype), _bits(t), tuple(t.shape)) for n, t in _leaves(got).items()}


def assert_resharded_equals(pieces: list[dict[str, Any]], saved: dict[str, Any]) -> None:
    """The ranks' rows, joined in rank order, are the saved tensors bit for bit."""
    assert set(pieces[0]) == set(saved)
    for name, (dtype, shape, want) in saved.items():
        assert pieces[0][name][0] == dtype, name
        if not shape:
            assert all(np.array_equal(p[name][1], want) for p in pieces), name
            continue
        rows = [p[name][1] for p in pieces]
        assert sum(p[name][2][0] for p in pieces) == shape[0], name
        assert np.array_equal(np.concatenate(rows), want), name


def test_fsdp2_checkpoint_imported_by_three_ranks_loads_resharded_on_two(ranks, tmp_path: Path) -> None:
    src, dst = str(tmp_path / "dcp"), str(tmp_path / "lc")
    saved = ranks.run(save_dcp, 4, "fsdp", src)[0]
    imported = ranks.run(import_dcp, 3, src, dst)
    # Every rank reports the same import; the param groups are plain values, nothing skipped.
    assert imported == [(len(saved), ())] * 3
    with lc.open(dst) as rd:
        assert sorted(rd.keys()) == sorted(saved)
    assert_resharded_equals(ranks.run(load_rows, 2, dst), saved)


def test_tensor_parallel_checkpoint_imported_in_one_process_loads_on_three_ranks(ranks, tmp_path: Path) -> None:
    src, dst = str(tmp_path / "dcp"), str(tmp_path / "lc")
    saved = ranks.run(save_dcp, 2, "tp", src)[0]
    done = lc.import_dcp(src, dst, trust_pickle=True)
    assert (done.arrays, done.skipped) == (len(saved), ())
    # The optimizer's param groups come back as the values they were.
    assert lc.load(dst)["optim"]["param_groups"][0]["lr"] == 1e-2
    assert_resharded_equals(ranks.run(load_rows, 3, dst), saved)
