"""SIGKILL at moments drawn uniformly over the *measured* duration of an operation, in three
places beside the manager saves of ``test_crash.py``:

- a world of one: ``lc.save`` and ``lc.save_async`` without a manager, killed over the measured
  save (from ``SAVING`` to ``COMMITTED`` of an unkilled one);
- a manager's retention deletes: ``keep_last=2`` over a root of six committed steps of many
  files each, killed over the measured deletes (from the first ``manager.retire`` to the end of
  retention);
- a manager starting: killed while it takes the lock and removes (or puts back) the leftovers of
  earlier crashes, over the measured start.

Each trial checks what the kill left before anything touches it: every committed checkpoint loads
bit-exact and passes ``verify`` (what ``layoutckpt verify`` runs), the last good checkpoint is
intact, and nothing was lost that must not be; then a restart must start, remove the leftovers
and list only committed, readable steps. Each case runs a few trials here; ``tools/stress_kill.py
--mode save|retain|restart`` runs many.
"""

from __future__ import annotations

import random

import pytest

from tests.support import crash_harness as ch

MB = 4.0
ARRAYS = 32  # arrays per step of the retention and restart roots: about 70 files each
TRIALS = 3


def measured(server, base, tmp_path, start: str, end: str, **job) -> float:
    """The duration from ``start`` to ``end`` of an unkilled job on a copy of ``base``."""
    root = ch.copy_root(base, tmp_path / "measure")
    result = ch.run_job(server, root, job.pop("step"), 1, tmp_path / "jobs", mb=MB, **job)
    assert result.returncodes == [0], result.describe()
    return result.span(start, end)


def problems_text(problems: list[str], job: ch.JobResult) -> str:
    return "\n".join(problems) + "\n" + job.describe()


# --- a world of one: lc.save, lc.save_async ----------------------------------------------------


@pytest.fixture(scope="module")
def one_base(server, tmp_path_factory):
    """A root holding step 1; the measured durations of an unkilled save of step 2, per mode."""
    work = tmp_path_factory.mktemp("one-base")
    root = work / "root"
    ch.seed_root(root, [1], MB)
    horizons = {
        mode: measured(server, root, work / mode, "SAVING", "COMMITTED", step=2, mode=mode)
        for mode in ("save", "save_async")
    }
    return root, horizons


@pytest.mark.parametrize("mode", ["save", "save_async"])
@pytest.mark.parametrize("trial", range(TRIALS))
def test_world_of_one_killed_during_a_save(server, one_base, tmp_path, mode, trial):
    base, horizons = one_base
    rng = random.Random(f"{mode}-{trial}")
    kill = ch.RandomKill([0], rng.uniform(0.0, horizons[mode]))
    root = ch.copy_root(base, tmp_path / "root")
    job = ch.run_job(server, root, 2, 1, tmp_path / "jobs", mb=MB, mode=mode, random_kill=kill)
    assert not job.timed_out, job.describe()
    verdict = ch.verify(root, 2, 1, MB, job)
    problems = list(verdict.problems)
    for k in verdict.scan.committed:
        problems += ch.check_committed(ch.step_path(root, k), k)
    assert problems == [], problems_text(problems, job)
    if not verdict.committed:
        # The interrupted save is redone at the same path, beside its leftover.
        redo = ch.run_job(server, root, 2, 1, tmp_path / "jobs", mb=MB, mode=mode)
        assert redo.returncodes == [0], redo.describe()
    problems = ch.restart_in_process(root, [1, 2])
    assert problems == [], problems_text(problems, job)


# --- retention deletes -------------------------------------------------------------------------

KEEP = 2
NEW = 7  # the step whose save sets off retention of steps 1-5


@pytest.fixture(scope="module")
def retain_base(server, tmp_path_factory):
    """Steps 1-6 committed; the measured duration of the deletes a save of step 7 sets off."""
    work = tmp_path_factory.mktemp("retain-base")
    root = work / "root"
    ch.seed_many(root, list(range(1, NEW)), ARRAYS)
    extra = ["--keep-last", str(KEEP), "--arrays", str(ARRAYS)]
    horizon = measured(server, root, work, "retire", "RETAINED", step=NEW, mode="retain", extra=extra)
    return root, horizon, extra


@pytest.mark.parametrize("trial", range(TRIALS + 1))
def test_manager_killed_during_retention_deletes(server, retain_base, tmp_path, trial):
    base, horizon, extra = retain_base
    rng = random.Random(f"retain-{trial}")
    kill = ch.RandomKill([0], rng.uniform(0.0, horizon), after="retire")
    root = ch.copy_root(base, tmp_path / "root")
    job = ch.run_job(server, root, NEW, 1, tmp_path / "jobs", mb=MB, mode="retain", extra=extra, random_kill=kill)
    assert not job.timed_out and job.committed_on(0), job.describe()
    s = ch.scan(root)
    problems = []
    # Retention never touches the steps it keeps, and a step it deletes is listed whole or not at all.
    if not {NEW - 1, NEW} <= set(s.committed) or not set(s.committed) <= set(range(1, NEW + 1)):
        problems.append(f"committed after the kill: {s.committed}")
    if s.uncommitted:
        problems.append(f"step folders without their marker: {s.uncommitted}")
    for k in s.committed:
        problems += ch.check_committed(ch.step_path(root, k), k)
    assert problems == [], problems_text(problems, job)
    # A restart removes what the deletes left, lists what is committed, and retention goes on.
    problems = ch.restart_in_process(root, s.committed, keep_last=KEEP)
    rerun = ch.run_job(server, root, NEW + 1, 1, tmp_path / "jobs", mb=MB, mode="retain", extra=extra)
    assert rerun.returncodes == [0], rerun.describe()
    problems += ch.restart_in_process(root, [NEW, NEW + 1])
    assert problems == [], problems_text(problems, job)


# --- a manager starting on a root with leftovers -----------------------------------------------


@pytest.fixture(scope="module")
def restart_base(server, tmp_path_factory):
    """Steps 1-3 committed and a leftover of each kind (``ch.seed_leftovers``); the measured
    duration of a manager's start there."""
    work = tmp_path_factory.mktemp("restart-base")
    root = work / "root"
    ch.seed_many(root, [1, 2, 3], ARRAYS)
    ch.seed_leftovers(root, ARRAYS)
    horizon = measured(server, root, work, "STARTING", "STARTED", step=0, mode="restart")
    return root, horizon


@pytest.mark.parametrize("trial", range(TRIALS + 1))
def test_manager_killed_while_starting(server, restart_base, tmp_path, trial):
    base, horizon = restart_base
    rng = random.Random(f"restart-{trial}")
    kill = ch.RandomKill([0], rng.uniform(0.0, horizon), after="STARTING")
    root = ch.copy_root(base, tmp_path / "root")
    job = ch.run_job(server, root, 0, 1, tmp_path / "jobs", mb=MB, mode="restart", random_kill=kill)
    assert not job.timed_out, job.describe()
    s = ch.scan(root)
    problems = []
    # Steps 1-3 stay; step 4 is back or still set aside whole; 5-7 are never listed.
    set_aside = [n for n in s.leftovers if n.startswith(".step_00000004.old-")]
    if s.committed not in ([1, 2, 3], [1, 2, 3, 4]) or (4 not in s.committed and len(set_aside) != 1):
        problems.append(f"after the kill: committed {s.committed}, leftovers {s.leftovers}")
    for k in s.committed:
        problems += ch.check_committed(ch.step_path(root, k), k)
    assert problems == [], problems_text(problems, job)
    # The next start succeeds (here a worker again, then this process) and puts step 4 back.
    rerun = ch.run_job(server, root, 0, 1, tmp_path / "jobs", mb=MB, mode="restart")
    assert rerun.returncodes == [0], rerun.describe()
    problems = ch.restart_in_process(root, [1, 2, 3, 4])
    assert problems == [], problems_text(problems, job)
