"""The read engine: every read of stored arrays in layoutckpt goes through ``read_boxes``.

``load``, ``open().read``, ``verify``, the CLI's ``read``, safetensors export and the JAX loader
describe what they want as ``BoxRead`` requests (a box of a stored array and where it goes);
the engine cuts each box into the pieces its storage reads best (``BoxReader.pieces``), keeps at
most ``IOConfig.budget_bytes`` of TensorStore's pieces in flight (reads on threads: up to 16
batches of pieces per thread), places every piece straight into the request's destination, and
reports damage as ``IntegrityError`` naming the array. The same pieces are what ``_readplan`` counts, so
``layoutckpt plan`` shows what a load does.

Readers whose reads block (a local checkpoint's shard files) run on ``IOConfig.threads`` threads
(``read_streams`` for a streamed single read); TensorStore's reads are asynchronous and need none.
A request that is one piece in all is read on the caller's thread: a small partial read pays for
no hand-off. The one box not read here is one that goes to a GPU and that its reader already
holds in host memory (a memory tier's pinned buffers, ``BoxReader.lend``): ``load`` copies it
to the device from there.
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
from ..layout._plan import Box, box_shape, box_size, box_view
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
    # Taken from the left as the reads go: a request (and the destination it holds) is let go
    # once yielded, so a caller that drops each array after it is done holds one at a time.
    planned = deque((r, reader.pieces(r.meta, r.box, stream=stream) if box_size(r.box) else []) for r in requests)
    reader.expect([(r.meta, r.box) for r, pieces in planned if pieces])
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
    return box_view(out, piece, [o for o, _ in box])


def _inline(
    reader: BoxReader,
    planned: deque[tuple[BoxRead, list[tuple[Box, bool]]]],
    stats: ReadStats,
    on_damage: OnDamage | None,
) -> Iterator[tuple[BoxRead, np.ndarray]]:
    while planned:
        r, pieces = planned.popleft()
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


# Batches queued per reading thread, at most: enough that a thread done with small pieces
# finds more while the others read a large one.
_WINDOW = 16
# Pieces handed to a reading thread at once, up to this many or this many bytes, once the
# threads have enough queued: each hand-off wakes a thread and makes a future, which costs more
# than reading a small piece warm.
_BATCH_PIECES = 16
_BATCH_BYTES = 4 << 20


@attrs.frozen
class _Item:
    """One piece of a request to read (None: the request's box is empty, nothing to read)."""

    request: BoxRead
    out: np.ndarray = attrs.field(eq=False)
    piece: Box | None
    prefetch: bool
    nbytes: int
    last: bool  # the request's last piece: it is done once this one is


class _Scheduler:
    """Batches of pieces in flight, oldest first: the next is issued once the bytes in flight
    allow it. Readers that block take batches on threads; others start each piece at once."""

    def __init__(
        self, reader: BoxReader, io: IOConfig, threads: int, stats: ReadStats, on_damage: OnDamage | None
    ) -> None:
        self.reader, self.io, self.stats, self.on_damage = reader, io, stats, on_damage
        self.nthreads = threads
        self.threads = ThreadPoolExecutor(threads, thread_name_prefix="layoutckpt-read") if threads else None
        self.pending: deque[tuple[Any, list[_Item]]] = deque()
        self.batch: list[_Item] = []
        self.batch_bytes = 0
        self.in_flight = 0
        self.fresh = 0  # bytes in flight into destinations the engine made (not the caller's)
        self.damaged: set[int] = set()

    def run(self, planned: deque[tuple[BoxRead, list[tuple[Box, bool]]]]) -> Iterator[tuple[BoxRead, np.ndarray]]:
        try:
            while planned:
                r, pieces = planned.popleft()
                out = _destination(r)
                if not pieces:
                    self.add(_Item(r, out, None, False, 0, True))
                for i, (piece, prefetch) in enumerate(pieces):
                    nbytes = box_size(piece) * out.dtype.itemsize
                    while self.pending and self.full(nbytes, fresh=r.out is None):
                        self.flush()  # the threads keep reading while this one waits
                        yield from self.settle_some()
                    self.add(_Item(r, out, piece, prefetch, nbytes, i == len(pieces) - 1))
            self.flush()
            while self.pending:
                yield from self.settle_some()
        finally:
            self.stop()

    def full(self, nbytes: int, *, fresh: bool) -> bool:
        """Whether issuing ``nbytes`` more must wait for reads in flight.

        Reads on threads fill their destinations in place, holding no buffer of their own:
        twice the threads always go, so that none waits for the next batch, and up to
        ``_WINDOW`` batches per thread while the destinations the engine made for them stay
        within ``budget_bytes`` (a caller's own destinations cost nothing more in flight).
        TensorStore's reads decode into buffers of their own: their bytes are what is bounded.
        """
        if self.threads is None:
            return self.in_flight + nbytes > self.io.budget_bytes
        queued = len(self.pending)
        if queued < 2 * self.nthreads:
            return False
        return queued >= _WINDOW * self.nthreads or (fresh and self.fresh + nbytes > self.io.budget_bytes)

    def add(self, item: _Item) -> None:
        self.stats.in_flight.start(item.nbytes)
        self.in_flight += item.nbytes
        self.fresh += item.nbytes if item.request.out is None else 0
        self.batch.append(item)
        self.batch_bytes += item.nbytes
        # Pieces go one by one while the threads could run short of work (a thread done with
        # small pieces then finds more while another reads a large one); in batches beyond.
        short = self.threads is None or len(self.pending) < 2 * self.nthreads
        if short or len(self.batch) >= _BATCH_PIECES or self.batch_bytes >= _BATCH_BYTES:
            self.flush()

    def flush(self) -> None:
        """Put the batch gathered so far in flight."""
        if not self.batch:
            return
        items, self.batch, self.batch_bytes = self.batch, [], 0
        if self.threads is not None:
            pending: Any = self.threads.submit(self.read_batch, items)
        else:
            (item,) = items
            r = item.request
            view = _view(item.out, r.box, item.piece) if item.piece is not None else None
            pending = (
                _NOTHING
                if view is None
                else self.reader.start(r.name, r.meta, item.piece, view, prefetch=item.prefetch)
            )
        self.pending.append((pending, items))

    def read_batch(self, items: list[_Item]) -> list[IntegrityError | None]:
        """Read a batch on a reading thread: each piece's damage, or None. Damage to one piece
        leaves the others to be read; any other failure ends the batch and the load."""
        found: list[IntegrityError | None] = []
        for item in items:
            r = item.request
            try:
                if item.piece is not None:
                    view = _view(item.out, r.box, item.piece)
                    self.reader.read(r.name, r.meta, item.piece, view, prefetch=item.prefetch)
                found.append(None)
            except IntegrityError as err:
                found.append(err)
        return found

    def settle_some(self) -> Iterator[tuple[BoxRead, np.ndarray]]:
        """Settle the oldest batch; with reads on threads, every batch up to the middle of the
        queue at once. Waking for each batch done would hand the GIL from a reading thread to
        this one and back for every batch, which costs more than a small read."""
        count = 1 if self.threads is None else len(self.pending) // 2 + 1
        middle = self.pending[count - 1][0]
        if isinstance(middle, Future):
            wait([middle])
        for _ in range(count):
            yield from self.settle()

    def settle(self) -> Iterator[tuple[BoxRead, np.ndarray]]:
        """Wait for the oldest batch; yield each request whose last piece is in it."""
        pending, items = self.pending.popleft()
        try:
            found = pending.result() if isinstance(pending, Future) else [_damage_of(pending)]
        finally:
            for item in items:
                self.stats.in_flight.done(item.nbytes)
                self.in_flight -= item.nbytes
                self.fresh -= item.nbytes if item.request.out is None else 0
        # Each item is let go as it is yielded: a caller that frees a destination once it is
        # done with it must not find the rest of the batch holding it.
        held: list[_Item | None] = list(items)
        del items
        for i, err in enumerate(found):
            item, held[i] = held[i], None
            assert item is not None
            r = item.request
            if err is None:
                self.stats.bytes += item.nbytes
            elif self.on_damage is None:
                raise err
            elif id(r) not in self.damaged:  # one report per request, however many pieces fail
                self.damaged.add(id(r))
                self.on_damage(r, err)
            if item.last and id(r) not in self.damaged:
                yield r, item.out

    def stop(self) -> None:
        """Cancel what has not started and wait for what has: no read may still write into a
        destination after the engine returns."""
        self.batch.clear()
        for pending, _ in self.pending:
            pending.cancel()
        if self.threads is not None:
            self.threads.shutdown(wait=True, cancel_futures=True)
        for pending, _ in self.pending:
            if not isinstance(pending, Future):
                try:
                    pending.result()
                except Exception:  # noqa: BLE001 - the first failure is already being raised
                    pass
        self.pending.clear()


def _damage_of(pending: Any) -> IntegrityError | None:
    """Wait for a read started on its own; its damage, or None (other failures raise)."""
    try:
        pending.result()
    except IntegrityError as err:
        return err
    return None


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
