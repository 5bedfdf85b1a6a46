"""Ranks that pass a save different paths, steps, metadata or storage options are refused on
every rank before anything is written, with an error naming what differs and on which rank;
managers given different steps likewise. A save_async whose background commit loses no rank keeps
no key of its own in the job's store."""

from __future__ import annotations

import os

import numpy as np
import pytest

import layoutckpt as lc
from layoutckpt.base._errors import InconsistentShardsError

STATE = {"w": np.arange(12, dtype=np.float32).reshape(4, 3)}


def _save_with(rank, group, base, per_rank):
    options = dict(per_rank[rank])
    path = os.path.join(base, options.pop("path", "ckpt"))
    lc.save(path, STATE, None, group=group, **options)


CASES = {
    "path": ({"path": "run/step_00000001"}, {"path": "run/other_step"}, "path"),
    "step": ({"step": 1}, {"step": 2}, "step 1 on rank 0 but 2 on rank 1"),
    "metadata": ({"metadata": {"lr": 0.1}}, {"metadata": {"lr": 0.2}}, "metadata"),
    "compression": ({}, {"compression": "zstd"}, "compression None on rank 0 but 'zstd' on rank 1"),
    "packing": ({"packing": "files"}, {"packing": "ocdbt"}, "packing 'files' on rank 0 but 'ocdbt' on rank 1"),
}


@pytest.mark.parametrize("case", CASES)
def test_ranks_that_disagree_on_where_or_how_are_refused_before_writing(ranks, tmp_path, case):
    rank0, rank1, named = CASES[case]
    errors = ranks.run_expecting_errors(_save_with, 2, str(tmp_path), [rank0, rank1])
    for tb in errors:
        assert "InconsistentShardsError" in tb and named in tb and "nothing was written" in tb, tb
    written = [os.path.join(d, f) for d, _, files in os.walk(tmp_path) for f in files]
    assert written == []


def _manager_save(rank, group, root, steps):
    with lc.CheckpointManager(root, group=group) as mgr:
        try:
            mgr.save(steps[rank], STATE, None)
        except InconsistentShardsError as err:
            return str(err), mgr.steps()
    return "", None


def test_managers_given_different_steps_commit_nothing(ranks, tmp_path):
    results = ranks.run(_manager_save, 2, str(tmp_path), [1, 2])
    for message, steps in results:
        assert "step_00000001" in message and "step_00000002" in message and steps == []
    assert sorted(os.listdir(tmp_path)) == [".layoutckpt.lock"]


def _agreeing_async_save(rank, group, base):
    import torch.distributed as dist

    fut = lc.save_async(os.path.join(base, "ok"), STATE, None, group=group, step=3, timeout=5)
    result = fut.result()
    dist.barrier(group)  # every rank has finished, rank 0's cleanup included
    store = dist.distributed_c10d._get_default_store()
    return result.path, store.num_keys()


def test_an_agreeing_async_save_commits_and_leaves_the_store_as_it_found_it(ranks, tmp_path):
    first = ranks.run(_agreeing_async_save, 2, str(tmp_path / "a"))
    second = ranks.run(_agreeing_async_save, 2, str(tmp_path / "b"))
    assert {p for p, _ in first} == {str(tmp_path / "a" / "ok")}
    # The keys of one save are all deleted once every rank read its last exchange.
    assert first[0][1] == second[0][1]
    assert lc.load(str(tmp_path / "b" / "ok"))["w"].tolist() == STATE["w"].tolist()


def _view_fails_on_rank_1(rank, group, base):
    from layoutckpt.torch import _staging

    def refuse(self):
        raise RuntimeError("cannot view this tensor")

    real = _staging.Staged.view
    if rank == 1:
        _staging.Staged.view = refuse
    try:
        split = lc.Layout(lc.Mesh({"dp": 2}), [(".*", lc.P("dp"))])  # each rank writes its own rows
        lc.save(os.path.join(base, "ck"), {"w": STATE["w"][2 * rank : 2 * rank + 2]}, split, group=group)
    except lc.SaveError as err:
        return str(err)
    finally:
        _staging.Staged.view = real
    return None


def test_a_synchronous_save_that_cannot_view_a_tensor_on_one_rank_fails_on_every_rank(ranks, tmp_path):
    """The live tensors are viewed inside the write's failure handling: the other ranks hear of
    it at the commit's agreement, rather than wait there for a rank that has left."""
    got = ranks.run(_view_fails_on_rank_1, 2, str(tmp_path), timeout=60)
    assert all(g is not None and "rank 1: RuntimeError: cannot view this tensor" in g for g in got), got
    assert os.listdir(tmp_path) == []
