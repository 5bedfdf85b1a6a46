"""What one save or load did on this rank, phase by phase: a value for the caller, a log record.

A save's phases are ``plan`` (checks, agreement between ranks, the write plan), ``stage`` (the
copy of an async save; zero for ``save``, which writes from the live tensors), ``write`` (every
write issued until all are durable) and ``commit`` (the ranks agree, rank 0 writes the marker).
A load's are ``plan`` (metadata and boxes), ``read`` (the storage reads) and ``place`` (arrays
built or copied into the template). Phases may overlap with the caller's work, never with each
other.

Each finished operation also goes to the ``layoutckpt`` logger at INFO, with the same values
under ``record.layoutckpt`` (a dict), so a job can export them without parsing the message.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import attrs

logger = logging.getLogger("layoutckpt")


@attrs.frozen
class Metrics:
    """One operation on this rank. ``bytes`` are the array bytes written or read from storage;
    ``requests`` the TensorStore reads or writes issued; ``max_in_flight`` the most of them
    outstanding at once (``max_in_flight_bytes`` their bytes)."""

    operation: str
    path: str
    rank: int
    world: int
    phases: tuple[tuple[str, float], ...]
    bytes: int
    arrays: int
    requests: int
    max_in_flight: int
    max_in_flight_bytes: int
    seconds: float

    def phase(self, name: str) -> float:
        """Seconds spent in phase ``name``."""
        for n, s in self.phases:
            if n == name:
                return s
        raise KeyError(f"{self.operation} has no phase {name!r}; it has {[n for n, _ in self.phases]}")

    @property
    def gb_per_s(self) -> float:
        """Array bytes per second over the whole operation (10**9 bytes per GB)."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = attrs.asdict(self, recurse=False)
        out["phases"] = dict(self.phases)
        out["gb_per_s"] = self.gb_per_s
        return out

    def __str__(self) -> str:
        phases = ", ".join(f"{n} {s:.3f} s" for n, s in self.phases)
        return (
            f"{self.operation} {self.path} (rank {self.rank}/{self.world}): {self.bytes / 1e9:.3f} GB of "
            f"{self.arrays} arrays in {self.seconds:.3f} s ({self.gb_per_s:.2f} GB/s); {phases}; "
            f"{self.requests} requests, at most {self.max_in_flight} in flight"
        )


def report(m: Metrics) -> Metrics:
    if logger.isEnabledFor(logging.INFO):
        logger.info("%s", m, extra={"layoutckpt": m.to_dict()})
    return m


class InFlight:
    """Counts requests outstanding at once; ``done`` may be called from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._now = self._now_bytes = 0
        self.issued = self.most = self.most_bytes = 0

    def start(self, nbytes: int) -> None:
        with self._lock:
            self.issued += 1
            self._now += 1
            self._now_bytes += nbytes
            self.most = max(self.most, self._now)
            self.most_bytes = max(self.most_bytes, self._now_bytes)

    def done(self, nbytes: int) -> None:
        with self._lock:
            self._now -= 1
            self._now_bytes -= nbytes


class Phases:
    """Durations by name, in the order they were first recorded."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}

    def add(self, name: str, seconds: float) -> None:
        self._seconds[name] = self._seconds.get(name, 0.0) + seconds

    def since(self, name: str, start: float) -> float:
        """Record the time since ``start`` (a ``perf_counter`` reading) as ``name``; now."""
        now = time.perf_counter()
        self.add(name, now - start)
        return now

    def items(self, order: tuple[str, ...]) -> tuple[tuple[str, float], ...]:
        return tuple((n, self._seconds.get(n, 0.0)) for n in order)


SAVE_PHASES = ("plan", "stage", "write", "commit")
LOAD_PHASES = ("plan", "read", "place")
