"""A rank that loses a peer in the middle of an asynchronous manager save ends on its own: it
reports the commit if the checkpoint was committed, and otherwise raises ``SaveError`` naming the
rank it lost (at the agreement over the process group too, where gloo's own error names only an
address), within the save's ``timeout=`` (here short); it never waits for the job's teardown.
And a committed save reports success on every rank, even when rank 0, which hosts the store of a
``tcp://`` rendezvous, ends the moment its own save has returned.

Real 2-rank gloo jobs of ``tests/support/crash_worker.py``, forked from a server with torch
imported, on a copy of a root holding steps 1 and 2. Unlike ``test_crash.py``, the job is not torn
down when a rank dies (``grace`` longer than any save), so a survivor that hung would show.
"""

from __future__ import annotations

import random

import pytest

from tests.support import crash_harness as ch
from tests.support import crash_worker as cw

MB = 8.0
WORLD = 2
PREVIOUS = 2
SAVE_TIMEOUT = 1.5
# A survivor waits at most twice the timeout for rank 0, plus the start of its process.
GRACE = 4 * SAVE_TIMEOUT + 10


@pytest.fixture(scope="module")
def base(server, tmp_path_factory):
    work = tmp_path_factory.mktemp("rank-loss-base")
    root = work / "root"
    ch.seed_root(root, [1], MB)
    job = ch.run_job(server, root, 2, WORLD, work / "jobs", mb=MB)
    assert job.returncodes == [0, 0], job.describe()
    return root, job.save_seconds()


def survivors_report(job: ch.JobResult, killed: int, committed: bool) -> list[str]:
    """Problems with what the ranks that were not killed reported (empty: each ended on its own,
    with success if the step is committed, else with a ``SaveError`` naming ``killed``)."""
    return ch.survivor_problems(job, killed, committed, limit=GRACE)


KILLS = [
    (1, "write"),
    (1, "before-marker"),
    (1, "after-marker"),
    (0, "write"),
    (0, "before-marker"),
    (0, "after-rename"),
]


@pytest.mark.parametrize(("kill_rank", "phase"), KILLS, ids=[f"rank{r}-{p}" for r, p in KILLS])
def test_the_survivor_of_a_phase_kill_ends_on_its_own(server, base, tmp_path, kill_rank, phase):
    root = ch.copy_root(base[0], tmp_path / "root")
    kill = dict(kill_at=phase, kill_rank=kill_rank, grace=GRACE, save_timeout=SAVE_TIMEOUT)
    job = ch.run_job(server, root, 3, WORLD, tmp_path / "jobs", mb=MB, **kill)
    assert job.returncodes[kill_rank] == -9, job.describe()
    expect = cw.expected_outcome(phase, kill_rank)
    verdict = ch.verify(root, 3, PREVIOUS, MB, job, expect=expect)
    problems = verdict.problems + survivors_report(job, kill_rank, verdict.committed)
    assert problems == [], "\n".join(problems) + "\n" + job.describe()


@pytest.mark.parametrize("seed", range(4))
def test_a_rank_killed_at_a_random_moment_leaves_no_survivor_hanging(server, base, tmp_path, seed):
    """One rank killed a delay uniform over the measured duration of an unkilled save."""
    rng = random.Random(1000 + seed)
    kill = ch.RandomKill([rng.randrange(WORLD)], rng.uniform(0.0, base[1]))
    root = ch.copy_root(base[0], tmp_path / "root")
    job = ch.run_job(
        server, root, 3, WORLD, tmp_path / "jobs", mb=MB, random_kill=kill, grace=GRACE, save_timeout=SAVE_TIMEOUT
    )
    verdict = ch.verify(root, 3, PREVIOUS, MB, job)
    problems = verdict.problems
    if job.returncodes[kill.targets[0]] == -9:  # else the kill came after that rank had finished
        problems += survivors_report(job, kill.targets[0], verdict.committed)
    assert problems == [], "\n".join(problems) + "\n" + job.describe()


def test_a_commit_is_reported_on_every_rank_when_rank0_exits_at_once(server, tmp_path):
    """Rank 0 hosts the store (``tcp://``) and exits as soon as its save returns, while rank 1's
    main thread holds the GIL, starving its commit thread: rank 1 still reports the commit."""
    for trial in range(3):
        root = tmp_path / f"root{trial}"
        job = ch.run_job(server, root, 1, WORLD, tmp_path / "jobs", mb=1.0, tcp=True, busy=[0.0, 0.5], grace=GRACE)
        assert job.returncodes == [0, 0] and all(job.committed_on(r) for r in range(WORLD)), job.describe()
        assert ch.scan(root).committed == [1]
