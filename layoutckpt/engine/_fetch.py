"""Reading many boxes with a bound on the memory in flight.

TensorStore reads a request that covers a whole shard as one value: the shard's bytes are held
next to the decoded array until it is done, so a 260 MB shard peaks at twice its size, and many
reads in flight at once add up. A load would then peak far above the bytes it returns. Here

- a box larger than ``piece_bytes`` is read in pieces of whole inner-chunk rows, each copied
  into the box's array as it arrives (one more copy, of those boxes only), and
- no more than ``budget_bytes`` of requests are in flight at once: the next is issued when an
  earlier one is done.

A background thread drives this, so ``load_async`` still returns with the reads under way.

A request with its own reader (``read_into``: a local checkpoint's shard files, ``_shardfile``)
skips TensorStore: a few threads fill each box's array in place, holding one inner chunk each,
so neither pieces nor a budget are needed.

Freed read buffers stay in the C allocator's per-thread arenas, where the next reads do not
always reuse them: without handing them back (``malloc_trim``, every ``TRIM_BYTES`` read) a
0.46 GB load peaked at 1.25x its bytes; with it, at its bytes. The same holds for the arrays a
load returns, allocated on its reading thread: once the caller drops them, the next load hands
them back before it allocates. Without that, 4 ranks loading their 0.5 GB ten times over grew
to 2.06 GB resident each; with it, they stay at 1.21-1.28 GB: the interpreter with the state
it saved (0.76 GB), and the last load's arrays until the next load starts.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs
import numpy as np

from ..base._metrics import InFlight
from ..layout._plan import Box
from ..storage._shardfile import THREADS
from ..storage._store import linux_call

PIECE_BYTES = 16 << 20
BUDGET_BYTES = 96 << 20
TRIM_BYTES = 64 << 20


# glibc's ``malloc_trim(0)``, or nothing where the C library has no such call.
_trim = linux_call("malloc_trim") or (lambda *_: None)


@attrs.frozen
class Request:
    """Read ``box`` of ``store`` (of inner chunk rows ``rows``) as ``dtype``; report as ``name``."""

    key: Hashable
    store: Any
    box: Box
    dtype: np.dtype
    rows: int
    name: str
    # Fills an array of the box's shape in place (no TensorStore); ``store`` is unused then.
    read_into: Callable[[Box, np.ndarray], Any] | None = None


def _pieces(r: Request, piece_bytes: int) -> list[Box]:
    """``r.box`` cut along its first dimension at inner chunk boundaries, about ``piece_bytes`` each."""
    shape = [b - a for a, b in r.box]
    nbytes = r.dtype.itemsize * math.prod(shape)
    if not r.box or nbytes <= piece_bytes or shape[0] <= r.rows:
        return [r.box]
    row_bytes = max(1, nbytes // shape[0])
    per_piece = max(r.rows, piece_bytes // row_bytes // r.rows * r.rows)
    start, stop = r.box[0]
    cuts = [start]
    at = start // r.rows * r.rows + per_piece  # on the chunk grid, so no chunk is read twice
    while at < stop:
        cuts.append(at)
        at += per_piece
    cuts.append(stop)
    return [((a, b), *r.box[1:]) for a, b in itertools.pairwise(cuts)]


class Fetcher:
    """Reads ``requests`` on a thread; ``result(key)`` gives each box's array once ``join`` returns."""

    def __init__(
        self,
        requests: list[Request],
        check: Callable[[Any, str], np.ndarray],
        *,
        piece_bytes: int | None = None,
        budget_bytes: int | None = None,
    ) -> None:
        self._check = check
        self._results: dict[Hashable, np.ndarray] = {}
        self._error: BaseException | None = None
        self.in_flight = InFlight()
        self._lock = threading.Lock()
        self.bytes = 0  # requested from storage
        self.seconds = 0.0  # from the first read issued to the last settled
        self._thread = threading.Thread(
            target=self._run,
            args=(requests, piece_bytes or PIECE_BYTES, budget_bytes or BUDGET_BYTES),
            name="layoutckpt-read",
            daemon=True,
        )
        self._thread.start()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Whether every read finished within ``timeout`` seconds."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def join(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error

    def result(self, key: Hashable) -> np.ndarray:
        return self._results[key]

    def _run(self, requests: list[Request], piece_bytes: int, budget_bytes: int) -> None:
        pending: deque[tuple[Request, Box, int, Any]] = deque()
        in_flight = settled = 0
        start = time.perf_counter()
        direct = [r for r in requests if r.read_into is not None]
        # What was freed since the last load (the arrays it gave, once dropped) goes back to the
        # system before this one allocates: repeated loads grew the process otherwise (docstring).
        _trim(0)
        threads = ThreadPoolExecutor(THREADS, thread_name_prefix="layoutckpt-read") if direct else None
        filled = []
        try:
            for r in direct:
                assert threads is not None
                out = self._results[r.key] = np.empty([b - a for a, b in r.box], dtype=r.dtype)
                filled.append(threads.submit(self._fill, r, out))
            for r in requests:
                if r.read_into is not None:
                    continue
                pieces = _pieces(r, piece_bytes)
                if len(pieces) > 1:
                    self._results[r.key] = np.empty([b - a for a, b in r.box], dtype=r.dtype)
                for piece in pieces:
                    nbytes = r.dtype.itemsize * math.prod(b - a for a, b in piece)
                    while pending and in_flight + nbytes > budget_bytes:
                        done = self._settle(*pending.popleft())
                        in_flight -= done
                        settled += done
                        if settled >= TRIM_BYTES:
                            _trim(0)
                            settled = 0
                    view = r.store[tuple(slice(a, b) for a, b in piece)] if piece else r.store
                    self.in_flight.start(nbytes)
                    pending.append((r, piece, nbytes, view.read()))
                    in_flight += nbytes
                    with self._lock:
                        self.bytes += nbytes
            while pending:
                self._settle(*pending.popleft())
            for f in filled:
                f.result()
        except BaseException as err:  # noqa: BLE001 - raised by join() on the caller's thread
            self._error = err
            for *_, future in pending:
                future.cancel()
        finally:
            if threads is not None:
                threads.shutdown(wait=True, cancel_futures=True)
        self.seconds = time.perf_counter() - start

    def _fill(self, r: Request, out: np.ndarray) -> None:
        assert r.read_into is not None
        self.in_flight.start(out.nbytes)
        try:
            r.read_into(r.box, out)
        finally:
            self.in_flight.done(out.nbytes)
        with self._lock:
            self.bytes += out.nbytes

    def _settle(self, r: Request, piece: Box, nbytes: int, future: Any) -> int:
        data = self._check(future, r.name)
        self.in_flight.done(nbytes)
        if piece == r.box:
            self._results[r.key] = data
        else:
            offset = piece[0][0] - r.box[0][0]
            self._results[r.key][offset : offset + data.shape[0]] = data
        return nbytes
