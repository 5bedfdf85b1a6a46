"""A few threads for many small calls, with little for the garbage collector to track."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any


class Workers:
    """``threads`` threads that run the calls given to ``submit`` in turn and add up the
    numbers they return (``None`` counts as 0).

    Not a ``ThreadPoolExecutor``: its ``Future`` per call is about 15 objects the garbage
    collector tracks (a ``Condition`` with its lock, bound methods and lists). Thousands of them
    alive for a whole save are promoted to the oldest generation, which brings on full
    collections that walk all of torch's objects. Here a call is one queued tuple. Once a call
    has raised, the calls not yet started are dropped.
    """

    def __init__(self, name: str, threads: int) -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[..., int | None], tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._total = 0
        self._error: BaseException | None = None
        self._dropping = False
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}") for i in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[..., int | None], *args: Any) -> None:
        self._calls.put((fn, args))

    def _run(self) -> None:
        while (call := self._calls.get()) is not None:
            if self._dropping:
                continue
            fn, args = call
            try:
                result = fn(*args)
            except BaseException as err:  # noqa: BLE001 - handed to join()
                with self._lock:
                    self._error = self._error or err
                    self._dropping = True
                continue
            with self._lock:
                self._total += result or 0

    def join(self) -> int:
        """Wait for every call; the sum of their results, or the first error one raised."""
        self._stop()
        if self._error is not None:
            raise self._error
        return self._total

    def close(self) -> None:
        """Drop the calls not yet started and wait for those running; ``join`` reports errors."""
        self._dropping = True
        self._stop()

    def _stop(self) -> None:
        for _ in self._threads:
            self._calls.put(None)
        for t in self._threads:
            t.join()
        self._threads = []
