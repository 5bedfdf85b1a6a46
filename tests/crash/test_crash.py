"""A job killed (SIGKILL) in the middle of a save never leaves a checkpoint that is listed but
wrong: the previously committed step survives bit-exact, the interrupted one is committed only if
the kill came after the point of no return (and then loads bit-exact), and a restart cleans up
the leftovers and commits the next step.

Each case runs real 2-rank gloo jobs of ``tests/support/crash_worker.py`` (forked from a server with torch
already imported, so a job costs well under a second; one case starts them cold with ``Popen``),
on a copy of a root that already holds steps 1 and 2. ``tools/stress_kill.py`` runs many more
randomized kills.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

import layoutckpt as lc
from tests.support import crash_harness as ch
from tests.support import crash_worker as cw

MB = 20.0
WORLD = 2
PREVIOUS = 2  # the newest step committed before each interrupted save


@pytest.fixture(scope="module")
def base(server, tmp_path_factory):
    """A root with step 1 (saved by one process) and step 2 (saved by a 2-rank job), and the
    measured duration of that job's save."""
    work = tmp_path_factory.mktemp("crash-base")
    root = work / "root"
    ch.seed_root(root, [1], MB)
    job = ch.run_job(server, root, 2, WORLD, work / "jobs", mb=MB)
    assert job.returncodes == [0, 0], job.describe()
    assert ch.scan(root).committed == [1, 2]
    assert ch.check_step(ch.step_path(root, 2), 2, MB) == []
    return root, job.save_seconds()


def crash(launcher, base_root: Path, tmp_path: Path, step: int, expect=None, **kill):
    """Copy the base root, run a job that gets killed, verify what it left; (job, verdict, root)."""
    root = ch.copy_root(base_root, tmp_path / "root")
    job = ch.run_job(launcher, root, step, WORLD, tmp_path / "jobs", mb=MB, **kill)
    assert not job.timed_out, job.describe()
    if "kill_at" in kill:
        assert -9 in job.returncodes, job.describe()  # somebody really died
    verdict = ch.verify(root, step, PREVIOUS, MB, job, expect=expect)
    assert verdict.problems == [], "\n".join(verdict.problems) + "\n" + job.describe()
    return job, verdict, root


def restart(launcher, root: Path, tmp_path: Path, step: int) -> None:
    problems = ch.verify_restart(launcher, root, step, tmp_path / "jobs", world=WORLD, mb=MB)
    assert problems == [], "\n".join(problems)


PHASE_KILLS = [
    (1, "stage"),
    (1, "write"),
    (1, "before-marker"),
    (1, "after-marker"),
    (1, "after-rename"),
    (0, "stage"),
    (0, "write"),
    (0, "before-marker"),
    (0, "after-marker"),
    (0, "after-rename"),
]


# The last event the killed rank prints before dying at a phase: (rank 0, other ranks).
REACHED = {
    "stage": ("stage", "stage"),
    "write": ("write", "write"),
    "before-marker": ("marker", "agree"),
    "after-marker": ("rename", "agree"),
    "after-rename": ("renamed", "agree"),
}


@pytest.mark.parametrize(("kill_rank", "phase"), PHASE_KILLS, ids=[f"rank{r}-{p}" for r, p in PHASE_KILLS])
def test_phase_kill(server, base, tmp_path, kill_rank, phase):
    base_root, _ = base
    expect = cw.expected_outcome(phase, kill_rank)
    job, verdict, root = crash(server, base_root, tmp_path, 3, expect=expect, kill_at=phase, kill_rank=kill_rank)
    assert job.returncodes[kill_rank] == -9
    # It died where it was meant to: the last landmark it printed.
    assert job.progress(kill_rank) == REACHED[phase][kill_rank != 0], job.describe()
    tmp_dirs = [n for n in verdict.scan.tmp_dirs if n.startswith(".step_00000003.tmp-")]
    if expect == "committed":
        # Rank 0 may have gone on to retention (keep_last=2) before it was torn down.
        assert verdict.scan.committed in ([1, 2, 3], [2, 3]) and tmp_dirs == []
    else:
        assert verdict.scan.committed == [1, 2]
    if phase == "write":
        # The killed rank's first writes landed in the temporary directory, and nowhere else.
        (tmp,) = tmp_dirs
        chunks = [f for _, _, files in os.walk(root / tmp) for f in files if f != "zarr.json"]
        assert chunks, "no chunk file was written before the kill"
    if phase == "after-marker" and kill_rank == 0:
        # The marker is complete inside the temporary directory, yet the step is not committed.
        (tmp,) = tmp_dirs
        assert ch.check_step(root / tmp, 3, MB) == []
    restart(server, root, tmp_path, 4)


@pytest.mark.parametrize("seed", range(4))
def test_random_kill(server, base, tmp_path, seed):
    base_root, save_seconds = base
    kill = ch.random_kill(random.Random(seed), WORLD, horizon=save_seconds)
    job, verdict, root = crash(server, base_root, tmp_path, 3, random_kill=kill)
    if job.killed:
        assert job.killed == kill.targets
    else:  # the save finished before the random delay ran out
        assert job.returncodes == [0] * WORLD, job.describe()
    if all(rc == 0 for rc in job.returncodes):  # the kill came after the save had finished
        assert verdict.committed
    restart(server, root, tmp_path, 4)


PACKED_KILLS = [(1, "write"), (0, "before-marker"), (1, "after-marker"), (0, "after-rename")]


@pytest.mark.parametrize(("kill_rank", "phase"), PACKED_KILLS, ids=[f"rank{r}-{p}" for r, p in PACKED_KILLS])
def test_packed_phase_kill(server, base, tmp_path, kill_rank, phase):
    """The same kills of a packed save (``packing="ocdbt"``): rank 0 merges the ranks' databases
    before the marker, so a kill before it leaves nothing visible, and one after it a step
    that loads bit for bit."""
    base_root, _ = base
    expect = cw.expected_outcome(phase, kill_rank)
    job, verdict, root = crash(
        server, base_root, tmp_path, 3, expect=expect, kill_at=phase, kill_rank=kill_rank, extra=["--packing", "ocdbt"]
    )
    assert job.returncodes[kill_rank] == -9
    if expect == "committed":
        assert lc.open(ch.step_path(root, 3)).meta.packing == "ocdbt"
    else:
        assert verdict.scan.committed == [1, 2]
    restart(server, root, tmp_path, 4)


def test_cold_started_job_killed_mid_write(server, base, tmp_path):
    """The same, with ranks started by ``subprocess.Popen`` as a launcher starts them."""
    base_root, _ = base
    job, _, root = crash(ch.PopenLauncher(), base_root, tmp_path, 3, expect="invisible", kill_at="write", kill_rank=1)
    assert job.returncodes[1] == -9
    restart(server, root, tmp_path, 4)
