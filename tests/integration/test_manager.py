"""``CheckpointManager``: only committed checkpoints are listed and loaded, retention keeps exactly
what its rule says (never the newest, never after a failed save), a restart removes the leftovers of
a crash and puts back a checkpoint an interrupted overwrite had set aside, one root has one manager
at a time (in this process, in another, or in another multi-rank job), and multi-rank saves
through a manager load under another mesh.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

import layoutckpt as lc
from layoutckpt import _manager, _retention
from layoutckpt.base import _faults
from layoutckpt.storage._location import PENDING
from tests.support.oracle import local_shard

LAYOUT = lc.Layout.replicated()


def state_of(step: int) -> dict:
    g = torch.Generator().manual_seed(1000 + step)
    return {
        "model": {"w": torch.randn(64, 48, generator=g), "b": torch.randn(48, generator=g).to(torch.bfloat16)},
        "step": step,
    }


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_state(out: dict, step: int) -> None:
    """``out`` is the state of ``step``, bit for bit."""
    want = state_of(step)
    for k in ("w", "b"):
        got = out["model"][k]
        assert got.dtype == want["model"][k].dtype and got.shape == want["model"][k].shape
        assert torch.equal(bits(got), bits(want["model"][k])), (step, k)
    assert out["step"] == step


def entries(root: Path) -> list[str]:
    return sorted(os.listdir(root))


def dot_leftovers(root: Path) -> list[str]:
    return [n for n in entries(root) if n.startswith(".") and n != _retention.LOCK_FILE]


def save_steps(mgr: lc.CheckpointManager, steps) -> None:
    for s in steps:
        mgr.save(s, state_of(s), LAYOUT, metadata={"step": s})
    mgr.wait()


def retained(saved: list[int], keep_last: int | None, keep_every: int | None) -> list[int]:
    """The tests' own retention: after every save, drop each step that is neither among the
    ``keep_last`` newest, nor a multiple of ``keep_every``, nor the newest."""
    live: list[int] = []
    for s in saved:
        live.append(s)
        newest = sorted(live, reverse=True)[: keep_last if keep_last is not None else len(live)]
        live = [x for x in live if x in newest or (keep_every and x % keep_every == 0) or x == max(live)]
    return sorted(live)


# --- listing -----------------------------------------------------------------------------------


def test_steps_lists_only_committed_checkpoints(tmp_path):
    root = tmp_path / "run"
    with lc.CheckpointManager(root) as mgr:
        assert mgr.steps() == [] and mgr.latest_step() is None
        with pytest.raises(lc.CheckpointNotFoundError, match="no committed checkpoint"):
            mgr.load()
        save_steps(mgr, [1, 2])
        # What an in-progress or crashed save looks like, made while this manager lives: a
        # temporary directory (even one that already holds its marker) and a step directory
        # without the marker.
        tmp = root / ".step_00000009.tmp-abc123"
        shutil.copytree(mgr.path(2), tmp)
        (root / "step_00000010" / "model" / "w").mkdir(parents=True)
        (root / "step_00000010" / "model" / "w" / "c.0").write_bytes(b"\0" * 64)
        assert mgr.steps() == [1, 2]
        assert mgr.latest_step() == 2
        assert_state(mgr.load(), 2)
        assert mgr.metadata() == {"step": 2}
        with pytest.raises(lc.CheckpointNotFoundError, match="no commit marker"):
            mgr.load(step=10)
        with pytest.raises(lc.CheckpointNotFoundError):
            mgr.load(step=9)


def test_a_save_in_flight_is_not_listed_until_renamed(tmp_path):
    """Held right before the commit rename (its marker written in the temporary directory), an
    async save is invisible; once released it is listed and loads."""
    at_rename, release = threading.Event(), threading.Event()

    def held(**_):
        at_rename.set()
        assert release.wait(30)

    root = tmp_path / "run"
    with lc.CheckpointManager(root, keep_last=1) as mgr, _faults.hooks({"commit.publish": held}):
        fut = mgr.save(1, state_of(1), LAYOUT)
        try:
            assert at_rename.wait(30)
            (tmp,) = dot_leftovers(root)
            assert tmp.startswith(".step_00000001.tmp-") and (root / tmp / "zarr.json").is_file()
            assert mgr.steps() == [] and mgr.latest_step() is None and not fut.done()
            with pytest.raises(lc.CheckpointNotFoundError):
                mgr.load()
            # A second manager is refused, and does not remove the save's temporary directory.
            with pytest.raises(lc.ManagerLockedError):
                lc.CheckpointManager(root)
            assert (root / tmp / "zarr.json").is_file()
        finally:
            release.set()
        fut.result(timeout=30)
        mgr.wait()
        assert mgr.steps() == [1] and dot_leftovers(root) == []
        assert_state(mgr.load(), 1)


# --- retention ---------------------------------------------------------------------------------


def test_retention_keep_last_and_keep_every(tmp_path):
    root = tmp_path / "run"
    expected = retained(list(range(1, 10)), keep_last=2, keep_every=4)
    assert expected == [4, 8, 9]
    with lc.CheckpointManager(root, keep_last=2, keep_every=4) as mgr:
        save_steps(mgr, range(1, 10))
        assert mgr.steps() == expected
        for s in expected:
            assert_state(mgr.load(step=s), s)
    # Deletion is complete: no renamed-aside directory is left, only the kept checkpoints.
    assert entries(root) == sorted([_retention.LOCK_FILE, *(f"step_{s:08d}" for s in expected)])


def test_a_long_run_keeps_no_record_of_retention_that_ended_well(tmp_path):
    with lc.CheckpointManager(tmp_path / "run", keep_last=1) as mgr:
        for s in range(1, 21):
            mgr.save(s, state_of(s), LAYOUT).result()
            mgr._retiring[-1].result()  # this save's retention
        assert len(mgr._retiring) == 1  # the last one: earlier ones are forgotten, not kept per save
        assert mgr.steps() == [20]


def test_retention_slower_than_the_saves_queues_one_run_not_one_per_save(tmp_path, monkeypatch):
    # Two ranks' writer threads slowed deletions below the save rate: a run per save queued up
    # (130 after 150 saves), each holding its save's future, and every step stayed on disk.
    started, go = threading.Event(), threading.Event()
    retire = _manager.retire_step

    def slow(loc, step):
        started.set()
        go.wait()
        retire(loc, step)

    monkeypatch.setattr(_manager, "retire_step", slow)
    with lc.CheckpointManager(tmp_path / "run", keep_last=1) as mgr:
        mgr.save(1, state_of(1), LAYOUT).result()
        mgr.save(2, state_of(2), LAYOUT).result()
        assert started.wait(10)  # the first run is deleting step 1, held here
        for s in range(3, 21):
            mgr.save(s, state_of(s), LAYOUT).result()
        assert len(mgr._retiring) == 2  # the running one, and one queued for all later saves
        go.set()
    with lc.CheckpointManager(tmp_path / "run", keep_last=1) as again:
        assert again.steps() == [20]


def test_a_rollback_deletes_the_newer_steps_before_saving_older_ones(tmp_path):
    """After a rollback the abandoned newer steps would stay the newest: a restart would resume
    from them, and retention would keep them over every new save. Saving an older step is
    refused until they are deleted, also by a manager made later on the same root."""
    with lc.CheckpointManager(tmp_path / "run", keep_last=2) as mgr:
        for s in (100, 200, 300):
            mgr.save(s, state_of(s), LAYOUT)
        mgr.wait()
        with pytest.raises(ValueError, match=r"step 210 is older than step 300.*mgr\.delete"):
            mgr.save(210, state_of(210), LAYOUT)
        mgr.delete(300)
        assert mgr.steps() == [200]
        mgr.save(210, state_of(210), LAYOUT)
        mgr.wait()
        assert mgr.steps() == [200, 210] and mgr.latest_step() == 210
    with lc.CheckpointManager(tmp_path / "run") as mgr:
        with pytest.raises(ValueError, match="step 205 is older than step 210"):
            mgr.save(205, state_of(205), LAYOUT)
        with pytest.raises(TypeError, match="step numbers"):
            mgr.delete("210")


def test_a_retention_failure_is_raised_once_and_retention_goes_on(tmp_path, monkeypatch):
    """A delete that fails once (a transient EIO) is raised by the next wait(); later waits and
    close() report later work, and the next retention deletes what this one left."""
    real, calls = _manager.retire_step, []

    def flaky(loc, step):
        calls.append(step)
        if len(calls) == 1:
            raise OSError(5, "transient EIO while deleting")
        real(loc, step)

    monkeypatch.setattr(_manager, "retire_step", flaky)
    mgr = lc.CheckpointManager(tmp_path / "run", keep_last=1)
    for s in (1, 2):
        mgr.save(s, state_of(s), LAYOUT).result()
    with pytest.raises(OSError, match="transient EIO"):
        mgr.wait()
    for s in (3, 4):
        mgr.save(s, state_of(s), LAYOUT)
        mgr.wait()
    assert mgr.steps() == [4]
    mgr.close()


@pytest.mark.parametrize(
    ("keep_last", "keep_every", "saved"), [(1, None, [1, 2, 3]), (1, 2, [1, 2, 3, 4, 5]), (1, 10, [3, 7])]
)
def test_retention_always_keeps_the_newest(tmp_path, keep_last, keep_every, saved):
    with lc.CheckpointManager(tmp_path / "run", keep_last=keep_last, keep_every=keep_every) as mgr:
        for s in saved:
            mgr.save(s, state_of(s), LAYOUT)
            mgr.wait()
            assert mgr.latest_step() == s
            assert_state(mgr.load(), s)
        assert mgr.steps() == retained(saved, keep_last, keep_every)
        assert saved[-1] in mgr.steps()


def test_no_retention_keeps_everything(tmp_path):
    with lc.CheckpointManager(tmp_path / "run") as mgr:
        save_steps(mgr, [1, 2, 3, 5, 8])
        assert mgr.steps() == [1, 2, 3, 5, 8]


steps_st = st.lists(st.integers(0, 300), unique=True, max_size=30)
keep_st = st.none() | st.integers(1, 12)


@given(steps=steps_st, keep_last=keep_st, keep_every=keep_st)
def test_to_delete_follows_the_rule(steps, keep_last, keep_every):
    deleted = _manager.to_delete(list(steps), keep_last, keep_every)
    assert deleted == sorted(set(deleted)) and set(deleted) <= set(steps)
    if steps:
        assert max(steps) not in deleted
    newest_first = sorted(steps, reverse=True)
    spec = set(newest_first if keep_last is None else newest_first[:keep_last])
    spec |= {s for s in steps if keep_every is not None and s % keep_every == 0}
    spec |= set(newest_first[:1])
    assert set(steps) - set(deleted) == spec


@given(steps=steps_st, keep_last=keep_st, keep_every=keep_st)
def test_to_delete_is_idempotent(steps, keep_last, keep_every):
    """Retention applied again to what it kept deletes nothing more."""
    kept = sorted(set(steps) - set(_manager.to_delete(steps, keep_last, keep_every)))
    assert _manager.to_delete(kept, keep_last, keep_every) == []


@pytest.mark.parametrize("async_save", [True, False])
def test_failed_save_deletes_nothing(tmp_path, async_save):
    """A root holding more than ``keep_last`` checkpoints (from an earlier run): a failing save
    must not trigger retention; the next successful one does."""
    root = tmp_path / "run"
    with lc.CheckpointManager(root) as mgr:
        save_steps(mgr, [1, 2, 3])
    before = entries(root)

    def disk_full(**_):
        raise OSError(28, "No space left on device")

    with lc.CheckpointManager(root, keep_last=1, async_save=async_save) as mgr:
        with _faults.hooks({"save.write": disk_full}):
            with pytest.raises(lc.SaveError, match="No space left on device"):
                mgr.save(4, state_of(4), LAYOUT)
                mgr.wait()
        if async_save:
            with pytest.raises(lc.SaveError):
                mgr.wait()  # the failure stays the last save's result
        assert mgr.steps() == [1, 2, 3]
        assert entries(root) == before
        for s in (1, 2, 3):
            assert_state(mgr.load(step=s), s)
        mgr.save(5, state_of(5), LAYOUT)
        mgr.wait()
        assert mgr.steps() == [5]
        assert_state(mgr.load(), 5)


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_bad_retention_arguments(tmp_path, bad):
    with pytest.raises(ValueError, match="keep_last"):
        lc.CheckpointManager(tmp_path, keep_last=bad)
    with pytest.raises(ValueError, match="keep_every"):
        lc.CheckpointManager(tmp_path, keep_every=bad)
    lc.CheckpointManager(tmp_path).close()  # a refused constructor holds no lock


@pytest.mark.parametrize("bad", [-1, True, 2.0, "3"])
def test_bad_step(tmp_path, bad):
    with lc.CheckpointManager(tmp_path) as mgr:
        with pytest.raises(ValueError, match="step"):
            mgr.save(bad, state_of(1), LAYOUT)
        assert entries(tmp_path) == [_retention.LOCK_FILE]


# --- restart -----------------------------------------------------------------------------------


def test_restart_removes_leftovers_and_restores_an_interrupted_overwrite(tmp_path):
    root = tmp_path / "run"
    with lc.CheckpointManager(root) as mgr:
        save_steps(mgr, [1, 3, 4])
    # The leftovers of a crash:
    shutil.copytree(root / "step_00000001", root / ".step_00000005.tmp-0123abcd")  # a save, marker and all
    shutil.copytree(root / "step_00000001", root / ".step_00000002.del-0123abcd")  # a deletion, still whole
    uncommitted = root / "step_00000007"
    shutil.copytree(root / "step_00000001", uncommitted)  # a step dir under way, without its marker
    (uncommitted / "zarr.json").unlink()
    (uncommitted / PENDING).write_bytes(b"")
    assert any(files for _, _, files in os.walk(uncommitted / "model"))
    # An overwrite of step 3 that crashed between its two renames: the old checkpoint aside,
    # the new one never renamed in.
    os.rename(root / "step_00000003", root / ".step_00000003.old-0123abcd")
    # An overwrite of step 4 that crashed after both renames: the old one is garbage.
    shutil.copytree(root / "step_00000001", root / ".step_00000004.old-0123abcd")
    # Things that are not the manager's are left alone: names like its own included.
    (root / "notes.txt").write_text("mine")
    (root / ".hidden").mkdir()
    (root / ".cache.tmp-0123abcd").mkdir()
    for foreign in ("step_00000008", "step_9"):
        (root / foreign).mkdir()
        (root / foreign / "results.txt").write_text("mine")

    with lc.CheckpointManager(root) as mgr:
        assert entries(root) == [
            ".cache.tmp-0123abcd",
            ".hidden",
            _retention.LOCK_FILE,
            "notes.txt",
            "step_00000001",
            "step_00000003",
            "step_00000004",
            "step_00000008",
            "step_9",
        ]
        assert mgr.steps() == [1, 3, 4]
        assert_state(mgr.load(step=3), 3)
        assert_state(mgr.load(step=4), 4)
        assert mgr.metadata(step=3) == {"step": 3}
        # The crashed steps can be saved again.
        save_steps(mgr, [5, 7])
        assert mgr.steps() == [1, 3, 4, 5, 7]
        assert_state(mgr.load(), 7)


def test_overwrite_through_the_manager(tmp_path):
    with lc.CheckpointManager(tmp_path / "run") as mgr:
        save_steps(mgr, [1])
        with pytest.raises(lc.CheckpointExistsError):
            mgr.save(1, state_of(2), LAYOUT)
        mgr.save(1, state_of(2), LAYOUT, overwrite=True)
        mgr.wait()
        assert mgr.steps() == [1]
        out = mgr.load()
        assert torch.equal(bits(out["model"]["w"]), bits(state_of(2)["model"]["w"]))
        assert dot_leftovers(tmp_path / "run") == []


# --- loading through the manager ---------------------------------------------------------------


def test_load_latest_step_metadata_rank_state(tmp_path):
    rng = {s: torch.Generator().manual_seed(s).get_state() for s in (1, 2)}
    with lc.CheckpointManager(tmp_path / "run", keep_last=5) as mgr:
        for s in (1, 2):
            mgr.save(s, state_of(s), LAYOUT, metadata={"step": s, "loss": 1.0 / s}, rank_state={"rng": rng[s], "s": s})
        mgr.wait()
        assert_state(mgr.load(), 2)
        assert_state(mgr.load(LAYOUT), 2)
        assert_state(mgr.load(step=1), 1)
        assert mgr.metadata() == {"step": 2, "loss": 0.5}
        assert mgr.metadata(step=1) == {"step": 1, "loss": 1.0}
        latest = mgr.load_rank_state()
        assert latest["s"] == 2 and torch.equal(latest["rng"], rng[2])
        assert mgr.load_rank_state(step=1)["s"] == 1
        assert mgr.reader().step == 2 and mgr.reader(1).step == 1
        only_w = mgr.load(select=r"\.w$", step=1)
        assert set(only_w["model"]) == {"w"}
        assert mgr.path(2) == (tmp_path / "run" / "step_00000002").absolute()


def test_sync_manager(tmp_path):
    with lc.CheckpointManager(tmp_path / "run", keep_last=1, async_save=False) as mgr:
        fut = mgr.save(1, state_of(1), LAYOUT)
        assert fut.done() and fut.staged()  # returned after the commit
        assert fut.result().path == os.fspath(mgr.path(1))
        assert mgr.steps() == [1]
        mgr.save(2, state_of(2), LAYOUT)
        assert mgr.wait().path == os.fspath(mgr.path(2))
        assert mgr.steps() == [2]
        assert_state(mgr.load(), 2)


# --- one manager per root ----------------------------------------------------------------------


_HELD: dict[str, lc.CheckpointManager] = {}


def _hold(rank, group, root):
    _HELD[root] = lc.CheckpointManager(root, group=group)
    return os.getpid()


def _release(rank, group, root):
    _HELD.pop(root).close()


def _try_manager(rank, group, root):
    try:
        lc.CheckpointManager(root, group=group).close()
        return "ok"
    except lc.ManagerLockedError as err:
        return f"locked: {err}"


def _open_manager(rank, group, root):
    lc.CheckpointManager(root, group=group).close()


def test_second_manager_in_this_process_is_refused(tmp_path):
    mgr = lc.CheckpointManager(tmp_path)
    try:
        with pytest.raises(lc.ManagerLockedError, match=f"pid {os.getpid()}"):
            lc.CheckpointManager(tmp_path)
        link = tmp_path.parent / f"{tmp_path.name}-link"
        link.symlink_to(tmp_path)
        with pytest.raises(lc.ManagerLockedError):
            lc.CheckpointManager(link)  # the same directory, by another name
    finally:
        mgr.close()
    lc.CheckpointManager(tmp_path).close()
    with lc.CheckpointManager(tmp_path):
        pass
    lc.CheckpointManager(tmp_path).close()


def test_second_manager_in_another_process_is_refused(ranks, tmp_path):
    root = os.fspath(tmp_path)
    # This process holds it: another process is refused, until it is closed.
    mgr = lc.CheckpointManager(root)
    try:
        (answer,) = ranks.run(_try_manager, 1, root)
        assert answer.startswith("locked:") and f"pid {os.getpid()}" in answer
    finally:
        mgr.close()
    assert ranks.run(_try_manager, 1, root) == ["ok"]
    # Another process holds it: this one is refused, until it is closed.
    (pid,) = ranks.run(_hold, 1, root)
    try:
        with pytest.raises(lc.ManagerLockedError, match=f"pid {pid}"):
            lc.CheckpointManager(root)
    finally:
        ranks.run(_release, 1, root)
    lc.CheckpointManager(root).close()


def test_lock_is_released_by_close_even_after_a_fork(tmp_path):
    """A process that forks after creating its manager (DataLoader workers do) still frees the
    root on ``close()``: the lock belongs to the manager, not to whoever shares its descriptor."""
    mgr = lc.CheckpointManager(tmp_path)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a child that outlives the manager, and does nothing
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    try:
        mgr.close()
        lc.CheckpointManager(tmp_path).close()
    finally:
        os.close(w)
        os.waitpid(pid, 0)


def _second_job_on_ranks_2_3(rank, group, root):
    sub = dist.new_group([2, 3])
    return _try_manager(rank, sub, root) if rank in (2, 3) else None


def test_second_multirank_job_is_refused_on_every_rank(ranks, tmp_path):
    root = os.fspath(tmp_path)
    ranks.run(_hold, 2, root)
    try:
        # Another job of two other processes: both of its ranks are refused, none hangs.
        answers = ranks.run(_second_job_on_ranks_2_3, 4, root, timeout=60)
        assert answers[:2] == [None, None]
        assert all(a.startswith("locked:") for a in answers[2:]), answers
        # A second manager job on the same processes: every rank raises ManagerLockedError.
        tracebacks = ranks.run_expecting_errors(_open_manager, 2, root)
        assert all("ManagerLockedError" in tb for tb in tracebacks), tracebacks
    finally:
        ranks.run(_release, 2, root)
    ranks.run(_open_manager, 2, root)


# --- multi-rank saves and loads through the manager --------------------------------------------


MESH4 = lc.Mesh({"dp": 2, "tp": 2})
LAYOUT4 = lc.Layout(MESH4, [(r"\.w$", lc.P("tp", None)), (r"\.e$", lc.P(("dp", "tp"))), (r".*", lc.P())])
MESH3 = lc.Mesh({"tp": 3})
LAYOUT3 = lc.Layout(MESH3, [(r"\.w$", lc.P(None, "tp")), (r".*", lc.P("tp"))])


def full_of(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + step)
    return {
        "w": torch.randn(10, 6, generator=g),
        "e": torch.randint(-(2**40), 2**40, (7,), generator=g, dtype=torch.int64),
        "b": torch.randn(3, generator=g).to(torch.bfloat16),
    }


def local_state(step: int, layout: lc.Layout, rank: int) -> dict:
    full = full_of(step)
    return {
        "m": {k: local_shard(v, layout.spec_for(f"m.{k}"), layout.mesh.shape, rank).clone() for k, v in full.items()},
        "step": step,
    }


def check_local(out: dict, step: int, layout: lc.Layout, rank: int) -> None:
    want = local_state(step, layout, rank)
    for k, v in want["m"].items():
        got = out["m"][k]
        assert got.dtype == v.dtype and got.shape == v.shape and torch.equal(bits(got), bits(v)), (step, k, rank)
    assert out["step"] == step


def _mr_save(rank, group, root, async_save):
    with lc.CheckpointManager(root, keep_last=2, async_save=async_save, group=group) as mgr:
        for step in (1, 2, 3):
            mgr.save(
                step,
                local_state(step, LAYOUT4, rank),
                LAYOUT4,
                metadata={"step": step},
                rank_state={"rank": rank, "s": step},
            )
        mgr.wait()
        dist.barrier(group)  # rank 0's wait() covered retention
        steps = mgr.steps()
        check_local(mgr.load(LAYOUT4), 3, LAYOUT4, rank)
        assert mgr.load_rank_state() == {"rank": rank, "s": 3}
    return steps


def _mr_load_other_mesh(rank, group, root):
    with lc.CheckpointManager(root, group=group) as mgr:
        steps = mgr.steps()
        check_local(mgr.load(LAYOUT3), 3, LAYOUT3, rank)
        check_local(mgr.load(LAYOUT3, step=2), 2, LAYOUT3, rank)
        whole = mgr.load(step=2)  # no layout: every array whole on every rank
        for k, v in full_of(2).items():
            assert torch.equal(bits(whole["m"][k]), bits(v))
        assert mgr.metadata() == {"step": 3}
        with pytest.raises(lc.WorldSizeError):
            mgr.load_rank_state()
        moved = mgr.load_rank_state(redistribute=lambda states, r, world: states[r + 1])
        return steps, moved


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_multirank_save_dp2_tp2_load_tp3(ranks, tmp_path, async_save):
    root = os.fspath(tmp_path / "run")
    assert ranks.run(_mr_save, 4, root, async_save) == [[2, 3]] * 4
    results = ranks.run(_mr_load_other_mesh, 3, root)
    assert [r[0] for r in results] == [[2, 3]] * 3
    assert [r[1] for r in results] == [{"rank": r + 1, "s": 3} for r in range(3)]
    assert sorted(os.listdir(root)) == [_retention.LOCK_FILE, "step_00000002", "step_00000003"]


def _load_newest(rank, group, root):
    with lc.CheckpointManager(root, group=group, async_save=False) as mgr:
        if rank == 1:
            mgr.steps = lambda: [1]  # step 2 not yet listed here: it commits while the ranks list the root
        return mgr.load(lc.Layout(lc.Mesh({"dp": 2}), [(".*", lc.P())]))["w"].tolist()  # a load split by rank


def test_ranks_that_list_different_newest_steps_restore_the_same_one(ranks, tmp_path):
    root = str(tmp_path / "run")
    with lc.CheckpointManager(root, async_save=False) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": torch.full((2,), float(step))})
    assert ranks.run(_load_newest, 2, root) == [[1.0, 1.0]] * 2
