"""The read engine: every read of stored arrays in layoutckpt goes through ``read_boxes``.

``load``, ``open().read``, ``verify``, the CLI's ``read``, safetensors export and the JAX loader
describe what they want as ``BoxRead`` requests (a box of a stored array and where it goes);
the engine cuts each box into the pieces its storage reads best (``BoxReader.pieces``), keeps at
most ``IOConfig.budget_bytes`` of TensorStore's pieces in flight (reads on threads: up to 16
pieces per thread), places every piece straight into the request's destination, and reports damage as
``IntegrityError`` naming the array. The same pieces are what ``_readplan`` counts, so
``layoutckpt plan`` shows what a load does.

Readers whose reads block (a local checkpoint's shard files) run on ``IOConfig.threads`` threads
(``read_streams`` for a streamed single read); TensorStore's reads are asynchronous and need none.
A request that is one piece in all is read on the caller's thread: a small partial read pays for
no hand-off.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import attrs
import numpy as np

from ..base._errors import IntegrityError
from ..base._metrics import InFlight
from ..base._options import DEFAULT_IO, IOConfig
from ..format._dtypes import numpy_dtype
from ..format._format import ArrayMeta
from ..layout._plan import Box, box_shape, box_size
from ..storage import _os
from ..storage._readers import BoxReader


@attrs.frozen
class BoxRead:
    """Read ``box`` of the array ``meta``, stored as ``name``, into ``out`` (an array of the
    box's shape, or a view into a larger one); with no ``out``, into a new array made when the
    read is issued. ``key`` identifies the request to its caller."""

    name: str
    meta: ArrayMeta
    box: Box
    out: np.ndarray | None = attrs.field(default=None, eq=False)
    key: Hashable = None

    @property
    def nbytes(self) -> int:
        return box_size(self.box) * numpy_dtype(self.meta.dtype).itemsize


@attrs.define
class ReadStats:
    """What a run of the engine did: the array bytes it placed, seconds, reads in flight."""

    bytes: int = 0
    seconds: float = 0.0
    in_flight: InFlight = attrs.field(factory=InFlight)


OnDamage = Callable[[BoxRead, IntegrityError], None]


def read_boxes(
    reader: BoxReader,
    requests: Iterable[BoxRead],
    *,
    io: IOConfig = DEFAULT_IO,
    stream: bool = False,
    stats: ReadStats | None = None,
    on_damage: OnDamage | None = None,
) -> Iterator[tuple[BoxRead, np.ndarray]]:
    """Read every request; yield each with its filled array, in the order given, as soon as it
    and those before it are done.

    ``stream`` reads a large box as one sequential stream per file where the storage can (a
    single large read). With ``on_damage``, a request whose bytes are damaged is reported there
    and not yielded, and the others go on; without it, damage raises ``IntegrityError``.
    """
    stats = stats if stats is not None else ReadStats()
    # An empty box reads nothing but still yields its (empty) destination, in its place.
    planned = [(r, reader.pieces(r.meta, r.box, stream=stream) if box_size(r.box) else []) for r in requests]
    start = time.perf_counter()
    try:
        if sum(len(pieces) for _, pieces in planned) <= 1:
            yield from _inline(reader, planned, stats, on_damage)
        else:
            threads = (io.read_streams if stream else io.threads) if reader.blocking else 0
            yield from _Scheduler(reader, io, threads, stats, on_damage).run(planned)
    finally:
        stats.seconds += time.perf_counter() - start


def read_into(reader: BoxReader, requests: Iterable[BoxRead], **options: Any) -> list[np.ndarray]:
    """``read_boxes`` run to its end: every request's array, in order."""
    return [out for _, out in read_boxes(reader, requests, **options)]


def _destination(r: BoxRead) -> np.ndarray:
    return r.out if r.out is not None else np.empty(box_shape(r.box), dtype=numpy_dtype(r.meta.dtype))


def _view(out: np.ndarray, box: Box, piece: Box) -> np.ndarray:
    """The part of ``out`` (which holds ``box``) that ``piece`` fills."""
    if piece == box:
        return out
    return out[tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(piece, box))]


def _inline(
    reader: BoxReader,
    planned: list[tuple[BoxRead, list[tuple[Box, bool]]]],
    stats: ReadStats,
    on_damage: OnDamage | None,
) -> Iterator[tuple[BoxRead, np.ndarray]]:
    for r, pieces in planned:
        out = _destination(r)
        stats.in_flight.start(r.nbytes)
        try:
            for piece, prefetch in pieces:
                reader.read(r.name, r.meta, piece, _view(out, r.box, piece), prefetch=prefetch)
                stats.bytes += box_size(piece) * out.dtype.itemsize
        except IntegrityError as err:
            if on_damage is None:
                raise
            on_damage(r, err)
            continue
        finally:
            stats.in_flight.done(r.nbytes)
        yield r, out


# Pieces queued per reading thread, at most: enough that a thread done with small pieces
# finds more while the others read a large one.
_WINDOW = 16


class _Scheduler:
    """Pieces in flight, oldest first: the next is issued once the bytes in flight allow it."""

    def __init__(
        self, reader: BoxReader, io: IOConfig, threads: int, stats: ReadStats, on_damage: OnDamage | None
    ) -> None:
        self.reader, self.io, self.stats, self.on_damage = reader, io, stats, on_damage
        self.nthreads = threads
        self.threads = ThreadPoolExecutor(threads, thread_name_prefix="layoutckpt-read") if threads else None
        self.pending: deque[tuple[BoxRead, np.ndarray, Any, int, bool]] = deque()
        self.in_flight = 0
        self.fresh = 0  # bytes in flight into destinations the engine made (not the caller's)
        self.damaged: set[int] = set()

    def run(self, planned: list[tuple[BoxRead, list[tuple[Box, bool]]]]) -> Iterator[tuple[BoxRead, np.ndarray]]:
        try:
            for r, pieces in planned:
                out = _destination(r)
                if not pieces:
                    self.pending.append((r, out, _NOTHING, 0, True))
                for i, (piece, prefetch) in enumerate(pieces):
                    nbytes = box_size(piece) * out.dtype.itemsize
                    while self.pending and self.full(nbytes, fresh=r.out is None):
                        yield from self.settle_some()
                    self.issue(r, out, piece, prefetch, nbytes, last=i == len(pieces) - 1)
            while self.pending:
                yield from self.settle_some()
        finally:
            self.stop()

    def full(self, nbytes: int, *, fresh: bool) -> bool:
        """Whether issuing ``nbytes`` more must wait for reads in flight.

        Reads on threads fill their destinations in place, holding no buffer of their own:
        twice the threads always go, so that none waits for the next piece, and up to
        ``_WINDOW`` pieces per thread while the destinations the engine made for them stay
        within ``budget_bytes`` (a caller's own destinations cost nothing more in flight).
        TensorStore's reads decode into buffers of their own: their bytes are what is bounded.
        """
        if self.threads is None:
            return self.in_flight + nbytes > self.io.budget_bytes
        queued = len(self.pending)
        if queued < 2 * self.nthreads:
            return False
        return queued >= _WINDOW * self.nthreads or (fresh and self.fresh + nbytes > self.io.budget_bytes)

    def issue(self, r: BoxRead, out: np.ndarray, piece: Box, prefetch: bool, nbytes: int, *, last: bool) -> None:
        view = _view(out, r.box, piece)
        if self.threads is not None:
            pending: Any = self.threads.submit(self.reader.read, r.name, r.meta, piece, view, prefetch=prefetch)
        else:
            pending = self.reader.start(r.name, r.meta, piece, view, prefetch=prefetch)
        self.stats.in_flight.start(nbytes)
        self.pending.append((r, out, pending, nbytes, last))
        self.in_flight += nbytes
        self.fresh += nbytes if r.out is None else 0

    def settle_some(self) -> Iterator[tuple[BoxRead, np.ndarray]]:
        """Settle the oldest piece; with reads on threads, every piece up to the middle of the
        queue at once. Waking for each piece done would hand the GIL from a reading thread to
        this one and back for every piece, which costs more than a small read."""
        count = 1 if self.threads is None else len(self.pending) // 2 + 1
        middle = self.pending[count - 1][2]
        if isinstance(middle, Future):
            wait([middle])
        for _ in range(count):
            yield from self.settle()

    def settle(self) -> Iterator[tuple[BoxRead, np.ndarray]]:
        """Wait for the oldest piece; yield its request once its last piece is in."""
        r, out, pending, nbytes, last = self.pending.popleft()
        try:
            pending.result()
            self.stats.bytes += nbytes
        except IntegrityError as err:
            if self.on_damage is None:
                raise
            if id(r) not in self.damaged:  # one report per request, however many pieces fail
                self.damaged.add(id(r))
                self.on_damage(r, err)
        finally:
            self.stats.in_flight.done(nbytes)
            self.in_flight -= nbytes
            self.fresh -= nbytes if r.out is None else 0
        if last and id(r) not in self.damaged:
            yield r, out

    def stop(self) -> None:
        """Cancel what has not started and wait for what has: no read may still write into a
        destination after the engine returns."""
        for _, _, pending, _, _ in self.pending:
            pending.cancel()
        if self.threads is not None:
            self.threads.shutdown(wait=True, cancel_futures=True)
        for _, _, pending, _, _ in self.pending:
            if not isinstance(pending, Future):
                try:
                    pending.result()
                except Exception:  # noqa: BLE001 - the first failure is already being raised
                    pass
        self.pending.clear()


class _Nothing:
    """The read of an empty box: done before it starts."""

    def result(self) -> int:
        return 0

    def cancel(self) -> None:
        pass


_NOTHING = _Nothing()


class BackgroundReads:
    """``read_boxes`` on a thread of its own (``load_async`` returns with reads under way);
    ``result(key)`` gives each request's array once ``join`` returns."""

    def __init__(self, reader: BoxReader, requests: list[BoxRead], io: IOConfig) -> None:
        self.stats = ReadStats()
        self._results: dict[Hashable, np.ndarray] = {}
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(reader, requests, io), name="layoutckpt-read", daemon=True
        )
        self._thread.start()

    def _run(self, reader: BoxReader, requests: list[BoxRead], io: IOConfig) -> None:
        # What the last load gave (its arrays, once the caller dropped them) goes back to the
        # system before this one allocates: repeated loads would grow the process otherwise.
        _os.release_free_memory()
        try:
            for r, out in read_boxes(reader, requests, io=io, stats=self.stats):
                self._results[r.key] = out
        except BaseException as err:  # noqa: BLE001 - raised by join() on the caller's thread
            self._error = err
        finally:
            reader.close()  # the files it kept open: the load is its only user

    @property
    def in_flight(self) -> InFlight:
        return self.stats.in_flight

    @property
    def bytes(self) -> int:
        return self.stats.bytes

    @property
    def seconds(self) -> float:
        return self.stats.seconds

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
