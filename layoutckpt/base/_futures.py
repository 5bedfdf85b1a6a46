"""Futures of asynchronous saves and loads, and the rule of one save in flight per process.

A failed background save must never go unnoticed: its future raises it, and if nobody asked the
future, the next ``save_async`` raises it before doing anything else.
"""

from __future__ import annotations

import concurrent.futures
import concurrent.futures.thread  # registers its exit hook, before ours below
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class _Future(Generic[T]):
    def __init__(self) -> None:
        self._future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def done(self) -> bool:
        """Whether the work has finished (successfully or not)."""
        return self._future.done()


class SaveFuture(_Future[Any]):
    """A save running in the background: staging, then the writes, then the commit.

    ``wait_staged()`` returns once the state has been copied out of the live tensors (call it
    before the optimizer mutates them); ``result()`` returns the ``SaveResult`` once the
    checkpoint is committed on every rank, or raises the error of whichever rank failed.
    ``path`` is where it saves.
    """

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self._staged = threading.Event()
        self._staging_error: BaseException | None = None
        self._wait_staged_hook: Callable[[], None] | None = None
        self._observed = False
        self._blocked_seconds = 0.0

    def __repr__(self) -> str:
        state = "done" if self.done() else "staged" if self._staged.is_set() else "staging"
        return f"SaveFuture({self.path!r}, {state})"

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until the state is copied out of the live tensors (device copies included)."""
        if not self._staged.wait(timeout):
            raise TimeoutError(f"staging of the save to {self.path!r} did not finish within {timeout}s")
        if self._staging_error is not None:
            raise self._staging_error
        if self._wait_staged_hook is not None:
            self._wait_staged_hook()

    def staged(self) -> bool:
        """Whether staging has finished (the live tensors may be mutated); never blocks."""
        return self._staged.is_set()

    def add_done_callback(self, fn: Callable[[SaveFuture], None]) -> None:
        """Call ``fn(self)`` once the save has finished, on the thread that finished it."""
        self._future.add_done_callback(lambda _: fn(self))

    def result(self, timeout: float | None = None) -> Any:
        """The ``SaveResult`` once committed; re-raises a failure of any rank."""
        try:
            return self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"the save to {self.path!r} did not finish within {timeout}s") from None
        except BaseException:
            self._observed = True
            raise

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait for the save (up to ``timeout`` seconds); its failure, or None if it committed.

        A failure returned here counts as seen: the next ``save_async`` does not raise it.
        Raises ``TimeoutError`` if the save is still running after ``timeout``.
        """
        err = self._future.exception(timeout)
        if err is not None:
            self._observed = True
        return err

    # Used by the save pipeline.
    def _set_staged(self, error: BaseException | None = None) -> None:
        self._staging_error = error
        self._staged.set()

    def _finish(self, result: Any = None, error: BaseException | None = None) -> None:
        if not self._staged.is_set():
            self._set_staged(error)
        if error is not None:
            self._future.set_exception(error)
        else:
            self._future.set_result(result)


class LoadFuture(_Future[T]):
    """A load whose reads are all in flight; ``result()`` waits for them and builds the state.

    After ``result()``, ``metrics`` holds this rank's phases (plan, read, place), bytes and reads.
    """

    def __init__(self, finish: Callable[[], T], reads: Any) -> None:
        super().__init__()
        self.metrics: Any = None
        self._finish = finish
        self._reads = reads  # anything with done() and wait(timeout) -> bool: the reads under way
        self._lock = threading.Lock()

    def done(self) -> bool:
        """Whether every read has finished (``result()`` then only assembles the state)."""
        return self._future.done() or self._reads is None or self._reads.done()

    def result(self, timeout: float | None = None) -> T:
        """Wait for the reads, build the loaded state and return it (what ``load`` returns).

        Raises the load's failure (e.g. ``IntegrityError`` for a damaged chunk), again on every
        call. Once it has returned, ``metrics`` holds this rank's phases. With ``timeout``
        (seconds), ``TimeoutError`` if the reads are not all done by then; the load goes on, and
        a later call may still return it.
        """
        reads = self._reads
        if timeout is not None and reads is not None and not reads.wait(timeout):
            raise TimeoutError(f"the load's reads were not done within {timeout} s; they go on")
        with self._lock:
            if not self._future.done():
                try:
                    self._future.set_result(self._finish())
                except BaseException as err:  # noqa: BLE001 - kept for every caller of result()
                    self._future.set_exception(err)
                # ``finish`` closes over this future: dropped, the load's plan is freed with the
                # future by reference counting, not left to the cyclic collector
                self._reads = self._finish = None
        return self._future.result(timeout)


_IN_FLIGHT: SaveFuture | None = None
_IN_FLIGHT_LOCK = threading.Lock()


def swap_in_flight(new: SaveFuture | None) -> SaveFuture | None:
    global _IN_FLIGHT
    with _IN_FLIGHT_LOCK:
        old, _IN_FLIGHT = _IN_FLIGHT, new
        return old


def wait_previous() -> BaseException | None:
    """Wait for the save in flight, if any; its failure if nobody has seen it yet."""
    with _IN_FLIGHT_LOCK:
        prev = _IN_FLIGHT
    if prev is None:
        return None
    err = prev._future.exception()
    if err is None or prev._observed:
        return None
    prev._observed = True
    return err


def _finish_at_exit() -> None:
    """At interpreter exit, finish the save in flight, and log its failure if nobody saw it.

    Registered after ``concurrent.futures``' own hook, so it runs first (hooks run newest
    first): theirs refuses new work to every thread pool, and a save still writing through
    one would fail, unseen, leaving its checkpoint uncommitted."""
    err = wait_previous()
    if err is not None:
        logging.getLogger("layoutckpt").error("a save still in flight at exit failed: %s", err)


threading._register_atexit(_finish_at_exit)  # type: ignore[attr-defined]  # what concurrent.futures uses
# A forked child (a DataLoader worker) inherits the parent's save in flight without the threads
# that finish it: it must not wait for it at its own exit.
os.register_at_fork(after_in_child=lambda: swap_in_flight(None))
