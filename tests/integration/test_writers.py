"""``_workers.Workers``: the threads a save writes its shard files (and documents) on.

A save relies on three things: every call runs and their results add up; the first error is the
one ``join`` raises, and once a call has failed the calls not yet started never run (a failed save
must not go on writing); and ``close`` stops at once without raising, whatever happened.
"""

from __future__ import annotations

import threading
import time

import pytest

from layoutckpt.base._workers import Workers

THREADS = 2


def test_every_call_runs_and_the_results_add_up():
    seen: list[int] = []
    lock = threading.Lock()

    def call(n: int) -> int:
        with lock:
            seen.append(n)
        return n

    writers = Workers("test-write", THREADS)
    for n in range(200):
        writers.submit(call, n)
    assert writers.join() == sum(range(200))
    assert sorted(seen) == list(range(200))
    assert writers.join() == sum(range(200))  # a second join waits for nothing


def test_after_a_failure_the_calls_not_started_are_dropped():
    started = threading.Event()
    release = threading.Event()
    ran: list[str] = []

    def blocker() -> int:
        started.set()
        release.wait(10)
        ran.append("blocker")
        return 1

    def failing() -> int:
        ran.append("failing")
        raise OSError("disk full")

    def later() -> int:
        ran.append("later")
        return 1

    writers = Workers("test-write", THREADS)
    # Every thread but one is held, so the failing call runs before any later one is taken.
    holds = [threading.Event() for _ in range(THREADS - 1)]
    for hold in holds:
        writers.submit(lambda hold=hold: (hold.wait(10), 0)[1])
    writers.submit(blocker)
    assert started.wait(10)
    writers.submit(failing)
    for _ in range(50):
        writers.submit(later)
    release.set()  # one thread is free: it takes the failing call, then finds the rest dropped
    _wait_for(lambda: writers._dropping)
    for hold in holds:
        hold.set()
    with pytest.raises(OSError, match="disk full"):
        writers.join()
    assert "failing" in ran and "blocker" in ran
    assert "later" not in ran


def test_close_drops_what_is_queued_and_never_raises():
    gate = threading.Event()
    ran: list[int] = []

    def call(n: int) -> int:
        gate.wait(10)
        ran.append(n)
        if n == 0:
            raise ValueError("first call fails")
        return n

    writers = Workers("test-write", THREADS)
    for n in range(100):
        writers.submit(call, n)
    closer = threading.Thread(target=writers.close)
    closer.start()
    _wait_for(lambda: writers._dropping)
    gate.set()
    closer.join(10)
    assert not closer.is_alive()
    # Only the calls already running when close() came may have finished.
    assert len(ran) <= THREADS
    if 0 in ran:
        with pytest.raises(ValueError, match="first call fails"):
            writers.join()
    else:
        assert writers.join() == sum(ran)


def _wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)
