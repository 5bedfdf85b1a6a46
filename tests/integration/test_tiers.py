"""Multi-tier checkpoints (``CheckpointManager(local=...)``): saves commit to each rank's fast tier,
persists to the durable tier are ordinary checkpoints, and a restore takes the newest step that
some tier holds for every rank, bit for bit: from the rank's own tier, from a peer's replica when
its own tier is lost, from the durable tier when the fast tiers cannot serve every rank, and never
a step that only some ranks hold. Persist failures never stop the loop and are never lost.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid

import pytest
import torch

import layoutckpt as lc
from layoutckpt.base import _faults
from layoutckpt.tiers._local import TIER_KEY
from tests.support.s3server import running

BUCKET = "tiers"
FULL = 8  # rows of the tp-split array: ranks hold torch.chunk rows of it


def full_state(step: int) -> dict:
    g = torch.Generator().manual_seed(7000 + step)
    return {
        "w": torch.randn(FULL, 6, generator=g),
        "e": torch.randn(5, 4, generator=g).to(torch.bfloat16),
        "step": step,
    }


def layout_for(world: int) -> lc.Layout:
    return lc.Layout(lc.Mesh({"tp": world}), [(r"^w$", lc.P("tp", None)), (r".*", lc.P())])


def local_state(step: int, rank: int, world: int) -> dict:
    full = full_state(step)
    return {"w": full["w"].chunk(world)[rank].clone(), "e": full["e"], "step": step}


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
    )


def assert_local(out: dict, step: int, rank: int, world: int) -> None:
    want = local_state(step, rank, world)
    assert out["step"] == step
    for k in ("w", "e"):
        assert same(out[k], want[k]), (k, step, rank)


# --- one process -----------------------------------------------------------------------------------


def test_a_step_without_rank_state_says_so_from_either_tier(tmp_path):
    """The same KeyError whether the step is read from the fast tier or the durable one:
    code that treats per-rank state as optional must not see a 'damaged' FormatError."""
    durable, local = tmp_path / "durable", tmp_path / "local" / "{rank}"
    with lc.CheckpointManager(durable, local=local, persist_every=1) as mgr:
        mgr.save(1, local_state(1, 0, 1), lc.Layout.replicated())
        mgr.wait()
        with pytest.raises(KeyError, match="saved without rank_state="):
            mgr.load_rank_state(1)  # the fast tier's piece
    with lc.CheckpointManager(durable) as mgr, pytest.raises(KeyError, match="saved without rank_state="):
        mgr.load_rank_state(1)


def test_every_step_local_some_persisted_and_restored_bit_exact(tmp_path):
    layout = lc.Layout.replicated()
    durable, local = tmp_path / "durable", tmp_path / "local" / "{rank}"
    with lc.CheckpointManager(durable, local=local, local_keep_last=2, persist_every=3, keep_last=2) as mgr:
        for step in range(1, 11):
            mgr.save(step, local_state(step, 0, 1), layout, metadata={"step": step}, rank_state={"pos": step * 10})
            mgr.wait()  # each persist finishes before the next is due: none is skipped
        assert mgr.local_steps() == [9, 10]
        assert mgr.steps() == [6, 9]
        m = mgr.tier_metrics()
        assert (m.saves, m.persists_started, m.persists_committed, m.persists_skipped) == (10, 3, 3, 0)
        assert m.last_persisted_step == 9 and m.last_local_step == 10
    # The durable tier's checkpoints are ordinary ones, and so is a rank's piece.
    assert_local(lc.load(durable / "step_00000009"), 9, 0, 1)
    assert lc.open(tmp_path / "local" / "0" / "step_00000010").read("w").shape == (FULL, 6)
    with lc.CheckpointManager(durable, local=local, persist_every=3) as mgr:
        assert mgr.latest_step() == 10
        assert_local(mgr.load(layout), 10, 0, 1)
        assert mgr.tier_metrics().restored_from == "local"
        assert mgr.load_rank_state() == {"pos": 100} and mgr.metadata() == {"step": 10}
        assert_local(mgr.load(layout, step=6), 6, 0, 1)  # only durable: read from there
        assert mgr.tier_metrics().restored_from == "durable"
        with pytest.raises(lc.CheckpointNotFoundError, match="step 7 cannot be restored"):
            mgr.load(layout, step=7)
    shutil.rmtree(tmp_path / "local")  # the node lost its local disk: the durable tier remains
    with lc.CheckpointManager(durable, local=local, persist_every=3) as mgr:
        assert mgr.latest_step() == 9
        assert_local(mgr.load(layout), 9, 0, 1)


def test_a_rollback_deletes_the_newer_steps_from_both_tiers(tmp_path):
    durable, local = tmp_path / "durable", tmp_path / "local" / "{rank}"
    layout = lc.Layout.replicated()
    with lc.CheckpointManager(durable, local=local, persist_every=2) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, local_state(step, 0, 1), layout)
        mgr.wait()
        assert (mgr.steps(), mgr.local_steps()) == ([2], [2, 3])
        with pytest.raises(ValueError, match="step 2 is older than step 3"):
            mgr.save(2, local_state(2, 0, 1), layout)
        mgr.delete(2, 3)
        assert (mgr.steps(), mgr.local_steps()) == ([], [])
        mgr.save(2, local_state(20, 0, 1), layout)  # the run, rolled back to step 1, saves step 2 again
        mgr.wait()
        assert mgr.latest_step() == 2
        assert_local(mgr.load(layout), 20, 0, 1)


def test_a_persist_stores_the_metadata_and_rank_state_of_its_save(tmp_path):
    """A persist starts saves later, from the host copy: what it stores of ``metadata`` and
    ``rank_state`` is what they were at the save's call, whatever the loop changed since."""
    durable = tmp_path / "durable"
    with lc.CheckpointManager(durable, local=tmp_path / "local" / "{rank}", persist_every=2) as mgr:
        metadata, position = {"losses": [1.0]}, {"seen": [10]}
        for step in (1, 2, 3):
            mgr.save(step, local_state(step, 0, 1), lc.Layout.replicated(), metadata=metadata, rank_state=position)
            metadata["losses"].append(float(step + 1))
            position["seen"].append(10 * (step + 1))
        mgr.wait()
        assert mgr.steps() == [2]
    assert lc.open(durable / "step_00000002").metadata == {"losses": [1.0, 2.0]}
    assert lc.load_rank_state(durable / "step_00000002") == {"seen": [10, 20]}


@pytest.mark.parametrize("local", ["memory://tiers-json-{uuid}", "dir"])
def test_json_leaves_equal_to_the_last_steps_but_in_type_or_sign_come_back_as_saved(tmp_path, local):
    """A save reuses the last save's structure where it is the same: ``True`` then ``1``,
    ``1`` then ``1.0`` and ``0.0`` then ``-0.0`` compare equal, yet each step restores its own."""
    local = str(tmp_path / "l") if local == "dir" else local.format(uuid=uuid.uuid4().hex)
    values = [True, 1, 1.0, 0.0, -0.0]
    with lc.CheckpointManager(tmp_path / "d", local=local, local_keep_last=5, persist_every=10**6) as mgr:
        for step, v in enumerate(values, 1):
            mgr.save(step, {"w": torch.ones(2), "v": v, "nest": {"v": v}}, lc.Layout.replicated())
        mgr.wait()
        for step, v in enumerate(values, 1):
            out = mgr.load(lc.Layout.replicated(), step=step)
            for got in (out["v"], out["nest"]["v"]):
                assert type(got) is type(v) and repr(got) == repr(v), (step, got, v)


@pytest.mark.parametrize(("packing", "expected"), [(None, "ocdbt"), ("auto", "ocdbt"), ("files", "files")])
def test_persists_are_packed_unless_the_manager_says_otherwise(tmp_path, packing, expected):
    """A persist's writer threads share the loop's GIL, which a few data files spare; a plain
    save of the same manager follows ``auto`` (three objects stay plain files)."""
    chosen = {} if packing is None else {"packing": packing}
    with lc.CheckpointManager(tmp_path / "d", local=tmp_path / "l", persist_every=1, **chosen) as mgr:
        mgr.save(1, local_state(1, 0, 1), lc.Layout.replicated())
        mgr.wait()
    assert lc.open(tmp_path / "d" / "step_00000001").meta.packing == expected
    assert_local(lc.load(tmp_path / "d" / "step_00000001"), 1, 0, 1)
    with lc.CheckpointManager(tmp_path / "plain", **chosen) as mgr:
        mgr.save(1, local_state(1, 0, 1), lc.Layout.replicated()).result()
    assert lc.open(tmp_path / "plain" / "step_00000001").meta.packing == "files"


def test_another_layout_reads_the_durable_tier(tmp_path):
    with lc.CheckpointManager(tmp_path / "d", local=tmp_path / "l", persist_every=2) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, local_state(step, 0, 1), lc.Layout.replicated())
            mgr.wait()
        other = lc.Layout(lc.Mesh({"tp": 1}), [(r"^w$", lc.P("tp", None)), (r".*", lc.P())])
        assert_local(mgr.load(other), 2, 0, 1)  # step 3 is a piece of another layout
        assert_local(mgr.load(lc.Layout.replicated()), 3, 0, 1)


def test_persist_failure_never_stops_training_and_is_reported(tmp_path):
    def fail(**_):
        raise OSError("the durable store is down")

    layout = lc.Layout.replicated()
    mgr = lc.CheckpointManager(tmp_path / "d", local="memory://" + uuid.uuid4().hex, persist_every=2)
    with _faults.hooks({"save.write": fail}):
        mgr.save(1, local_state(1, 0, 1), layout)
        mgr.save(2, local_state(2, 0, 1), layout).result()  # the fast tier commits; the persist fails
        with pytest.raises(lc.PersistError, match=r"persisting step 2 .* failed .* durable store is down"):
            mgr.wait()
    mgr.save(3, local_state(3, 0, 1), layout)  # wait() reported it: no warning now
    m = mgr.tier_metrics()
    assert m.persists_failed == 1 and "durable store is down" in m.last_persist_error
    mgr.save(4, local_state(4, 0, 1), layout)
    mgr.close()  # the persist of step 4 succeeds: nothing left to raise
    assert mgr.steps() == [4] and mgr.local_steps() == [3, 4]


def test_persist_failure_warns_at_the_next_save(tmp_path):
    def fail(**_):
        raise OSError("quota exceeded")

    layout = lc.Layout.replicated()
    with lc.CheckpointManager(tmp_path / "d", local=tmp_path / "l", persist_every=1) as mgr:
        with _faults.hooks({"save.write": fail}):
            mgr.save(1, local_state(1, 0, 1), layout)
            while mgr.tier_metrics().persists_failed == 0:
                mgr._tiers._persisting.exception()
        with pytest.warns(lc.PersistWarning, match=r"persisting step 1 .* quota exceeded"):
            mgr.save(2, local_state(2, 0, 1), layout)
        mgr.wait()
        assert mgr.steps() == [2]


def test_bad_tier_options_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="replicas must be 0 or 1"):
        lc.CheckpointManager(tmp_path / "d", local=tmp_path / "l", replicas=2)
    with pytest.raises(ValueError, match="persist_every must be a positive integer"):
        lc.CheckpointManager(tmp_path / "d", local=tmp_path / "l", persist_every=0)
    with pytest.raises(ValueError, match="give the fast tier too"):
        lc.CheckpointManager(tmp_path / "d", replicas=1)


# --- several ranks, S3 as the durable tier -----------------------------------------------------------


@pytest.fixture(scope="module")
def s3():
    with running(BUCKET) as server:
        yield server


def _train(rank, group, durable, local, env, steps, persist_every, lazy=False):
    os.environ.update(env)
    layout = layout_for(2)
    with lc.CheckpointManager(durable, local=local, persist_every=persist_every, replicas=1, group=group) as mgr:
        for step in steps:
            fut = mgr.save(step, local_state(step, rank, 2), layout, rank_state={"rank": rank, "step": step}, lazy=lazy)
            fut.wait_staged()
            mgr.wait()
        return mgr.local_steps(), mgr.steps()


def _restore(rank, group, durable, local, env, wipe=()):
    os.environ.update(env)
    if rank in wipe:
        shutil.rmtree(local.replace("{rank}", str(rank)), ignore_errors=True)
    with lc.CheckpointManager(durable, local=local, replicas=1, persist_every=5, group=group) as mgr:
        step = mgr.latest_step()
        out = mgr.load(layout_for(2))
        source = mgr.tier_metrics().restored_from
        assert_local(out, step, rank, 2)
        assert mgr.load_rank_state() == {"rank": rank, "step": step}
        return step, source


def _save_alone(rank, group, durable, local, env, step):
    """Only rank 0 saves ``step`` (no persist is due): its tier gets ahead of rank 1's."""
    os.environ.update(env)
    with lc.CheckpointManager(durable, local=local, persist_every=100, group=group) as mgr:
        if rank == 0:
            mgr.save(step, local_state(step, rank, 2), layout_for(2)).result()
    return True


def test_two_ranks_replicas_restore_from_peer_then_durable(ranks, s3, tmp_path):
    durable = f"s3://{BUCKET}/run-{uuid.uuid4().hex[:8]}"
    local = os.fspath(tmp_path / "node{rank}")
    got = ranks.run(_train, 2, durable, local, s3.env, range(1, 8), 5, True)
    assert got == [([6, 7], [5])] * 2
    # Each rank's own tier and its peer's replica serve step 7.
    assert ranks.run(_restore, 2, durable, local, s3.env) == [(7, "local")] * 2
    # Rank 1 loses its local disk: its piece comes from rank 0's replica, and heals its tier.
    assert ranks.run(_restore, 2, durable, local, s3.env, (1,)) == [(7, "local"), (7, "peer")]
    assert sorted(os.listdir(tmp_path / "node1")) == [".layoutckpt.lock", "step_00000007"]
    # Both lose theirs: the durable tier's step 5.
    assert ranks.run(_restore, 2, durable, local, s3.env, (0, 1)) == [(5, "durable")] * 2


def test_a_rank_ahead_of_the_others_does_not_resume_alone(ranks, s3, tmp_path):
    durable = f"s3://{BUCKET}/run-{uuid.uuid4().hex[:8]}"
    local = os.fspath(tmp_path / "node{rank}")
    ranks.run(_train, 2, durable, local, s3.env, range(1, 4), 2)
    ranks.run(_save_alone, 2, durable, local, s3.env, 4)
    assert (tmp_path / "node0" / "step_00000004").is_dir() and not (tmp_path / "node1" / "step_00000004").exists()
    # Rank 0 holds step 4, rank 1 (and rank 0's replica holder) does not: both resume from 3.
    assert ranks.run(_restore, 2, durable, local, s3.env) == [(3, "local")] * 2


def _memory_tier(rank, group, name, durable):
    layout = layout_for(2)
    local = f"memory://{name}/{{rank}}"
    with lc.CheckpointManager(durable, local=local, replicas=1, persist_every=4, group=group) as mgr:
        for step in range(1, 4):
            mgr.save(step, local_state(step, rank, 2), layout).wait_staged()
        mgr.wait()
    with lc.CheckpointManager(durable, local=local, replicas=1, persist_every=4, group=group) as mgr:
        assert_local(mgr.load(layout), 3, rank, 2)
        return mgr.tier_metrics().restored_from


def test_host_memory_tier_on_two_ranks(ranks, tmp_path):
    assert ranks.run(_memory_tier, 2, uuid.uuid4().hex, os.fspath(tmp_path / "d")) == ["local"] * 2


def _steady_replicas(rank, group, name, durable):
    from layoutckpt.tiers import _saver

    pieces = {}  # (step, whose) -> piece, this rank's own and the one it holds for its peer
    write = _saver.write_piece

    def recording(final, piece, *args, **kwargs):
        pieces[piece.meta.step, piece.meta.user_metadata[TIER_KEY]["rank"]] = piece
        return write(final, piece, *args, **kwargs)

    _saver.write_piece = recording
    try:
        local = f"memory://{name}/{{rank}}"
        with lc.CheckpointManager(durable, local=local, replicas=1, persist_every=100, group=group) as mgr:
            for step in range(1, 10):
                mgr.save(step, local_state(step, rank, 2), layout_for(2)).result()
    finally:
        _saver.write_piece = write
    peer = 1 - rank

    def views(steps: range) -> set[int]:
        return {id(a) for (s, _), p in pieces.items() if s in steps for a in p.arrays.values() if torch.is_tensor(a)}

    received = [pieces[step, peer] for step in range(3, 10)]
    return (
        all(p.meta.arrays is received[0].meta.arrays for p in received),
        # The tree differs only in the step's value: every other node is the last round's.
        all(p.meta.tree["dict"][0] is received[0].meta.tree["dict"][0] for p in received),
        {id(a) for p in received[4:] for a in p.arrays.values()} <= views(range(2, 7)),
    )


def test_a_replica_held_for_a_peer_reuses_its_documents_and_buffer_views(ranks, tmp_path):
    """A piece held for a peer lives for several steps, like the rank's own: each round's
    received document and arrays are the previous round's objects where they are the same (no
    new objects for the garbage collector to promote every step)."""
    assert ranks.run(_steady_replicas, 2, uuid.uuid4().hex, os.fspath(tmp_path / "d")) == [(True, True, True)] * 2


def _fast_write_fails_on_rank_1(rank, group, local, durable):
    from layoutckpt.tiers import _saver

    write = _saver.write_piece

    def flaky(final, *args, **kwargs):
        if rank == 1 and "00000002" in str(getattr(final, "url", final)):
            raise OSError(28, "No space left on device (injected)")
        return write(final, *args, **kwargs)

    _saver.write_piece = flaky
    got = []
    try:
        with lc.CheckpointManager(durable, local=local.format(rank=rank), persist_every=1, group=group) as mgr:
            for step in (1, 2, 3, 4):
                try:
                    fut = mgr.save(step, {"w": torch.full((8,), float(step))})
                    while step < 3 and not fut.done():  # unseen when step 3 starts, which raises it
                        time.sleep(0.01)
                    got.append("ok")
                except lc.SaveError:
                    got.append("SaveError")
            mgr.wait()
            return got, mgr.steps()
    finally:
        _saver.write_piece = write


def test_a_fast_tier_write_failing_on_one_rank_keeps_the_ranks_in_step(ranks, tmp_path):
    """Rank 1's step 2 fails: its step 3 raises, after that save's collectives, so the ranks'
    later saves still meet in the same collectives and persist the same steps."""
    local, durable = os.fspath(tmp_path / "fast{rank}"), os.fspath(tmp_path / "d")
    got = ranks.run(_fast_write_fails_on_rank_1, 2, local, durable, timeout=60)
    assert got[0] == (["ok"] * 4, [1, 4]) and got[1] == (["ok", "ok", "SaveError", "ok"], [1, 4]), got


# --- DTensor states (FSDP2 / tensor parallel) -------------------------------------------------------


def _tp_model(seed: int, style: str, group):
    """A two-layer model whose layers are split over a 2-rank mesh by ``parallelize_module``
    (``style`` "col": column-wise first layer, trained a step, so AdamW has state; "row": row-wise,
    as a template only)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    plan = {"0": ColwiseParallel(), "1": RowwiseParallel()} if style == "col" else {"0": RowwiseParallel()}
    parallelize_module(model, DeviceMesh.from_group(group, "cpu", mesh_dim_names=("tp",)), plan)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    if style == "col":
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
    return model, opt


def _locals(state: dict) -> dict:
    """Every leaf of a ``get_state`` tree as this rank holds it: a DTensor's local shard, copied."""
    from torch.distributed.tensor import DTensor

    out = {}
    for part in ("model", "optim"):
        for name, leaf in lc.layout._tree.flatten(state[part])[1].items():
            if isinstance(leaf, DTensor):
                leaf = leaf.to_local()
            out[f"{part}.{name}"] = leaf.detach().clone() if torch.is_tensor(leaf) else leaf
    return out


def _dtensor_tiers(rank, group, durable, local):
    """Steps 1-3 of a tensor-parallel model saved as DTensors (``get_state``), step 2 persisted;
    then restores from the fast tier into models sharded alike, and from the durable tier, or a
    typed error, into one sharded otherwise."""
    from torch.distributed.tensor import DTensor

    model, opt = _tp_model(0, "col", group)
    saved = {}
    with lc.CheckpointManager(durable, local=local, persist_every=2, group=group) as mgr:
        for step in (1, 2, 3):
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            state = lc.get_state(model, opt)
            saved[step] = _locals(state)
            mgr.save(step, state).result()
        mgr.wait()
    with lc.CheckpointManager(durable, local=local, persist_every=2, group=group) as mgr:
        fresh, fresh_opt = _tp_model(1, "col", group)
        result = mgr.load_state(fresh, fresh_opt)
        got = _locals(lc.get_state(fresh, fresh_opt))
        restored = (result.step, mgr.tier_metrics().restored_from)
        exact = all(same(got[n], v) if torch.is_tensor(v) else got[n] == v for n, v in saved[3].items())
        template = lc.get_state(*_tp_model(2, "col", group))
        loaded = mgr.load(like=template)
        dtensors = all(
            isinstance(loaded["model"][n], DTensor) and same(loaded["model"][n].to_local(), saved[3][f"model.{n}"])
            for n in ("0.weight", "1.weight")
        )
        filled = mgr.load(like=template, inplace=True)
        in_place = filled["model"]["0.weight"] is template["model"]["0.weight"] and same(
            template["model"]["0.weight"].to_local(), saved[3]["model.0.weight"]
        )
        # Sharded otherwise: step 3 is on the fast tiers only; step 2 comes from the durable tier.
        other = lc.get_state(*_tp_model(3, "row", group))
        try:
            mgr.load(like=other)
            refused = None
        except lc.TemplateMismatchError as err:
            refused = str(err)
        resharded = mgr.load(like=other, step=2)
        full = resharded["model"]["0.weight"].full_tensor()
        want = torch.cat([d["model.0.weight"] for d in _gathered(saved[2]["model.0.weight"], group)])
        return restored, exact, dtensors, in_place, refused, mgr.tier_metrics().restored_from, same(full, want)


def _gathered(t: torch.Tensor, group) -> list[dict]:
    import torch.distributed as dist

    out = [None, None]
    dist.all_gather_object(out, t, group=group)
    return [{"model.0.weight": x} for x in out]


@pytest.mark.parametrize("tier", ["dir", "memory"])
def test_dtensor_states_restore_from_the_fast_tier_and_reshard_from_the_durable_one(ranks, tmp_path, tier):
    local = os.fspath(tmp_path / "node{rank}") if tier == "dir" else f"memory://{uuid.uuid4().hex}/{{rank}}"
    got = ranks.run(_dtensor_tiers, 2, os.fspath(tmp_path / "durable"), local)
    for restored, exact, dtensors, in_place, refused, source, resharded in got:
        assert restored == (3, "local") and exact and dtensors and in_place
        assert refused is not None and "'model.0.weight'" in refused and "step 3" in refused
        assert source == "durable" and resharded


def test_a_fast_tier_whose_state_changes_shape_keeps_no_buffer_of_old_sizes(tmp_path):
    # A growing vocabulary or buffer: a new size every step. The tier's staging pool kept a
    # free buffer of every size it had seen (172 MiB for a 1.2 MiB state after 240 steps).
    mgr = lc.CheckpointManager(
        tmp_path / "d", keep_last=2, local="memory://" + uuid.uuid4().hex, local_keep_last=2, persist_every=10
    )
    for step in range(30):
        rows = 64 + step
        mgr.save(step, {"emb": torch.ones(rows, 256), "bias": torch.ones(rows)})
    mgr.wait()
    held = sum(pool.held_bytes for pool in mgr._tiers._pools.values())
    one_state = (93 * 256 + 93) * 4
    mgr.close()
    # the kept steps, the ones in flight to the durable tier and buffers to reuse: a few states
    assert held <= 8 * one_state, (held, one_state)
