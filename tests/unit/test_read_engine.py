"""The read engine's queue of reads on threads (``engine._read``): a large read does not hold
up the small ones behind it, and destinations the engine makes stay within the budget."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import layoutckpt as lc
from layoutckpt.engine._read import BoxRead, ReadStats, read_into
from layoutckpt.format._format import ArrayMeta
from layoutckpt.layout._spec import P
from layoutckpt.storage._readers import BoxReader

KB = 1 << 10


class _Reader(BoxReader):
    """Fills each box with its first index; the array ``big`` waits until ``small_done`` is set."""

    def __init__(self, io: lc.IOConfig, smalls: int) -> None:
        super().__init__("test", True, io)
        self.left = smalls
        self.lock = threading.Lock()
        self.small_done = threading.Event()

    def pieces(self, meta, box, *, stream):
        return [(box, False)]

    def read(self, name, meta, box, out, *, prefetch=False):
        if name == "big":
            assert self.small_done.wait(10), "the small reads queued behind the large one never ran"
        else:
            with self.lock:
                self.left -= 1
                if not self.left:
                    self.small_done.set()
        out[...] = box[0][0]
        return out.nbytes


def _request(name: str, n: int, out: np.ndarray | None = None) -> BoxRead:
    meta = ArrayMeta(name, (n,), "uint8", (n,), (n,), P(None))
    return BoxRead(name, meta, ((0, n),), out=out, key=name)


def test_small_reads_go_on_while_a_large_one_is_read():
    """A read that lasts until the 20 reads queued after it are done completes: the queue holds
    more than twice the threads, so the other thread finds them while one reads the large box."""
    io = lc.IOConfig(threads=2)
    reader = _Reader(io, smalls=20)
    requests = [_request("big", 64 * KB, np.empty(64 * KB, np.uint8))]
    requests += [_request(f"s{i}", KB, np.empty(KB, np.uint8)) for i in range(20)]
    out = read_into(reader, requests, io=io)
    assert len(out) == 21 and all((o == 0).all() for o in out)


def test_destinations_the_engine_makes_stay_within_the_budget():
    """Into the caller's arrays, up to 16 reads per thread are queued; into arrays the engine
    makes, no more than ``budget_bytes`` of them beyond the first two per thread."""
    io = lc.IOConfig(threads=2, budget_bytes=3 * KB)
    given, made = ReadStats(), ReadStats()
    reader = _Reader(io, smalls=100)
    reader.small_done.set()
    read_into(reader, [_request(f"a{i}", KB, np.empty(KB, np.uint8)) for i in range(100)], io=io, stats=given)
    read_into(reader, [_request(f"b{i}", KB) for i in range(100)], io=io, stats=made)
    assert made.in_flight.most_bytes <= 4 * KB  # the first four, then the budget
    assert given.in_flight.most > 4


def test_small_pieces_go_to_the_threads_in_batches(monkeypatch):
    """Once each thread has work queued, small pieces are handed over in batches (a future and
    a wake-up per batch, not per piece), and every request still comes back, in order."""
    io = lc.IOConfig(threads=2)
    reader = _Reader(io, smalls=200)
    submitted = []
    real = ThreadPoolExecutor.submit
    monkeypatch.setattr(
        ThreadPoolExecutor, "submit", lambda pool, fn, items: submitted.append(len(items)) or real(pool, fn, items)
    )
    requests = [_request(f"s{i}", KB, np.empty(KB, np.uint8)) for i in range(200)]
    out = read_into(reader, requests, io=io)
    assert [int(o[0]) for o in out] == [0] * 200 and [o is r.out for o, r in zip(out, requests)] == [True] * 200
    assert sum(submitted) == 200 and len(submitted) <= 200 // 8, submitted
