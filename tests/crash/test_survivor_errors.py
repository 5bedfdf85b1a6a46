"""A rank killed (SIGKILL) where gloo's own error would name only a network address, at the two
agreements of a save over the process group: before the ranks agree on what to save (the rank
dies right before its save call, ``before-plan``) and before they agree to commit (it dies with
its writes durable, ``at-agree``; a synchronous save agrees over the process group). Every rank
still alive must end on its own, within seconds, with ``lc.SaveError`` (``RankLostError``)
naming the killed rank, gloo's error as its ``__cause__``, and nothing committed: the step is
invisible and the step committed before it intact.

Real 2-rank gloo jobs of ``tests/support/crash_worker.py`` forked from a server; under a
``tcp://`` rendezvous the job's store lives in rank 0's process and dies with it, so a survivor
names rank 0 as the store's host. The job is not torn down when a rank dies (a long ``grace``),
so a survivor that hung would show.
"""

from __future__ import annotations

import pytest

from tests.support import crash_harness as ch

MB = 4.0
WORLD = 2
PREVIOUS = 1
# A survivor learns of the loss at once and waits ROLL_CALL_SECONDS (3 s) for the roll call;
# the rest is slack for a loaded machine of two cores shared with other tests.
LIMIT = 25.0
GRACE = LIMIT + 10

# (mode, extra worker arguments, killed rank, phase, tcp rendezvous)
CASES = [
    ("manager", [], 1, "before-plan", False),
    ("manager", [], 0, "before-plan", False),
    ("manager", ["--sync"], 1, "at-agree", False),
    ("manager", ["--sync"], 0, "at-agree", False),
    ("save", [], 1, "at-agree", False),
    ("save", [], 0, "at-agree", False),
    ("save", [], 1, "before-plan", False),
    ("manager", [], 1, "before-plan", True),
    ("manager", [], 0, "before-plan", True),
]


def case_id(case: tuple) -> str:
    mode, extra, rank, phase, tcp = case
    return f"{mode}{'-sync' if extra else ''}-rank{rank}-{phase}{'-tcp' if tcp else ''}"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("survivor-base") / "root"
    ch.seed_root(root, [PREVIOUS], MB)
    return root


@pytest.mark.parametrize(("mode", "extra", "killed", "phase", "tcp"), CASES, ids=[case_id(c) for c in CASES])
def test_the_survivor_names_the_killed_rank(server, base, tmp_path, mode, extra, killed, phase, tcp):
    root = ch.copy_root(base, tmp_path / "root")
    job = ch.run_job(
        server, root, 2, WORLD, tmp_path / "jobs", mb=MB, mode=mode, extra=extra, tcp=tcp,
        kill_at=phase, kill_rank=killed, grace=GRACE, timeout=GRACE + 30,
    )  # fmt: skip
    assert job.returncodes[killed] == -9, job.describe()
    assert not job.torn_down and not job.timed_out, job.describe()
    # Nothing committed: the step is invisible, the one before it there and bit-exact.
    verdict = ch.verify(root, 2, PREVIOUS, MB, job, expect="invisible")
    assert verdict.problems == [] and verdict.scan.committed == [PREVIOUS], job.describe()
    died = max(job.events[killed].values())  # the last event the killed rank printed
    for r in set(range(WORLD)) - {killed}:
        assert job.returncodes[r] not in (0, -9), job.describe()
        assert ch.survivor_error(job, r, killed) == "typed", job.describe()
        message = job.failures[r]
        assert message.strip("'\"").startswith("RankLostError: ") and "left the world" in message, message
        if tcp and killed == 0:
            assert "rank 0 (which hosts the job's key-value store)" in message, message
        # gloo's error, which names only the peer's address, is kept as the cause.
        cause = ch.survivor_cause(job, r)
        assert cause.startswith("RuntimeError: ") and "by peer" in cause, cause
        assert job.events[r]["FAILED"] - died < LIMIT, job.describe()
