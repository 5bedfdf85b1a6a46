"""The save side of a tiered ``CheckpointManager``: copy, commit to the fast tier, replicate,
persist to the durable tier in the background.

On the caller's thread: the copy into host buffers (``_stage``), and, every ``persist_every``
steps, the start of an ordinary async save of those host copies to the durable tier (its plan's
collectives must run there). On the tier's own thread, in save order: the piece is written and
committed on this rank's fast tier, sent to the peer rank (whose piece comes back the other
way, with the sends posted from the caller's thread), and the tier's retention runs. A persist
that falls due while the previous one still runs waits, its host copy kept, and starts at the
first later save that finds the previous done (a newer due step replaces it); so a slow durable
tier never holds up the loop, and no due step is lost to a short delay. A persist that fails is logged, counted, and reported by the next ``save`` (a
``PersistWarning``) and by ``wait()`` (a ``PersistError``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import logging
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import attrs

from .. import _rankstate
from .._save import SaveResult
from ..base._errors import PersistError, PersistWarning, SaveError
from ..base._futures import SaveFuture
from ..base._gc import collector_paused
from ..torch._dist import Comm
from ..torch._staging import HostBuffers
from ._local import LocalTier, Piece, layout_key, write_piece
from ._replica import Replicator, wait_all
from ._stage import Staging, Tree, stage

logger = logging.getLogger("layoutckpt")
# A persist: (step, state of host copies, layout, metadata, rank_state) -> the durable save's future.
Persist = Callable[[int, Any, Any, Any, Any], SaveFuture]


@attrs.frozen
class TierMetrics:
    """This rank's tiered checkpointing so far (``CheckpointManager.tier_metrics()``).

    ``copy_seconds`` is the last save's copy into host memory, the part a training step waits
    for (``blocked_seconds`` adds the checks around it); ``write_seconds`` the last piece's write
    and commit on the fast tier and ``replica_seconds`` its exchange with the peer, both in the
    background. A persist is the background save of a step to the durable tier: ``skipped`` when
    the previous one was still running where it was due, ``failed`` with ``last_persist_error``.
    ``restored_from`` says where the last restore read this rank's state: ``"local"``,
    ``"peer"`` (its replica on another rank) or ``"durable"``.
    """

    saves: int = 0
    last_local_step: int | None = None
    copy_seconds: float = 0.0
    blocked_seconds: float = 0.0
    write_seconds: float = 0.0
    replica_seconds: float = 0.0
    persists_started: int = 0
    persists_committed: int = 0
    persists_failed: int = 0
    persists_skipped: int = 0
    last_persisted_step: int | None = None
    last_persist_error: str | None = None
    restored_step: int | None = None
    restored_from: str | None = None


@attrs.define(eq=False)
class _Job:
    step: int
    staging: Staging
    fut: SaveFuture
    layout: Any
    copied: threading.Event = attrs.field(factory=threading.Event)
    error: BaseException | None = None
    persist: bool = False
    incoming: Piece | None = None  # the predecessor's piece, being received
    held: list[Any] = attrs.field(factory=list)  # the receive buffers
    works: list[Any] = attrs.field(factory=list)
    posted: threading.Event = attrs.field(factory=threading.Event)


class Tiers:
    """The fast tier of this rank and its link to the durable one (made by every rank)."""

    def __init__(
        self, tier: LocalTier, *, comm: Comm, keep_last: int, persist_every: int, replicas: int, persist: Persist
    ) -> None:
        self.comm = comm
        self.io = tier.io
        self.tier = tier
        self.keep_last = keep_last
        self.persist_every = persist_every
        self._persist_fn = persist
        self.metrics = TierMetrics()
        self._pools: dict[bool, HostBuffers] = {}
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="layoutckpt-tier")
        self._last: SaveFuture | None = None
        self._persisting: SaveFuture | None = None
        self._persist_failed: BaseException | None = None  # the latest persist's failure
        self._unreported: list[str] = []
        self._deferred: _Job | None = None
        self._pending: _Job | None = None  # a due persist that waits for the previous one
        self._last_tree: Tree | None = None  # the last save's structure and JSON leaves (``stage``)
        self._writing: collections.deque[SaveFuture] = collections.deque()  # saves not yet written, oldest first
        self._lock = threading.Lock()
        self.replicator = Replicator(comm) if replicas and comm.world > 1 else None

    def _record(self, **changes: Any) -> None:
        with self._lock:
            self.metrics = attrs.evolve(self.metrics, **changes)

    def _pool(self, pinned: bool) -> HostBuffers:
        return self._pools.setdefault(pinned, HostBuffers(None, pinned=pinned))

    # The caller's thread -------------------------------------------------------------------------
    @collector_paused()
    def save(self, step: int, state: Any, layout: Any, *, metadata: Any, rank_state: Any, lazy: bool) -> SaveFuture:
        """Copy ``state`` (now, or on a thread with ``lazy``), and queue its piece's write. A
        failure here (this rank's previous save, or this copy) is raised after this save's
        collectives, which every rank takes in the same order whatever failed where."""
        error: BaseException | None = None
        try:
            self._report()
        except SaveError as err:
            error = err
        self._start_deferred()
        t0 = time.perf_counter()
        self._throttle()
        info = {"rank": self.comm.rank, "world": self.comm.world, "layout": layout_key(layout)}
        try:
            if error is None:
                staging = stage(
                    state,
                    self._pool,
                    step=step,
                    metadata=metadata,
                    rank_state=rank_state,
                    info=info,
                    last=self._last_tree,
                )
                self._last_tree = Tree(staging.structure, staging.values)
        except Exception as err:  # noqa: BLE001 - raised below, after the ranks' persist agreement
            error = err
        decision = self._decide(step, error is not None)
        if error is not None:
            self._skip_replica_round()
            raise error
        job = _Job(step, staging, SaveFuture(self.tier.piece(step).url), layout, persist=decision == "start")
        if decision == "pend":
            self._pend(job)
        if self.replicator is not None:
            job.incoming = self.replicator.headers(staging.piece, self._acquire(job.held), self._pool(False).view)
        if lazy:
            threading.Thread(target=self._copy, args=(job,), name="layoutckpt-tier-stage", daemon=True).start()
            self._deferred = job  # sends and persist start with the next call, after the copy
        else:
            self._copy(job)
            job.fut.wait_staged()
            self._issue(job)
        self._worker.submit(self._write, job)
        self._writing.append(job.fut)
        job.fut._blocked_seconds = time.perf_counter() - t0
        self._record(saves=self.metrics.saves + 1, blocked_seconds=job.fut._blocked_seconds)
        self._last = job.fut
        return job.fut

    def _throttle(self) -> None:
        """Wait until at most one earlier save is still being written: a loop that saves faster
        than its tier writes (a slow disk, or a tier thread short of the GIL) then waits here,
        rather than holding a set of host buffers for every save queued behind the writer."""
        while len(self._writing) > 1:
            concurrent.futures.wait([self._writing.popleft()._future])
        while self._writing and self._writing[0].done():
            self._writing.popleft()

    def _report(self) -> None:
        """Raise the last save's failure if nobody saw it; warn of persists that failed since."""
        last = self._last
        if last is not None and last.done() and not last._observed and last._future.exception() is not None:
            last._observed = True
            raise SaveError(f"the previous save failed, and this one was not started: {last._future.exception()}")
        with self._lock:
            messages, self._unreported = self._unreported, []
        for message in messages:
            warnings.warn(message, PersistWarning, stacklevel=3)

    def _decide(self, step: int, failed: bool) -> str:
        """What every rank does about persisting at this save, agreed in one small collective
        where a persist is due or pending: ``"start"`` this step's; ``"pend"`` it, the previous
        one still running (it starts at a later save, replacing an older pending one); start the
        ``"pending"`` one, now that the previous is done; or ``"none"``."""
        due = step % self.persist_every == 0
        if not due and self._pending is None:
            return "none"
        busy = self._persisting is not None and not self._persisting.done()
        busy_any, failed_any = self.comm.all_reduce([int(busy), int(failed)], "max")
        if failed_any:
            return "none"
        if busy_any:
            return "pend" if due else "none"
        if due:
            self._drop_pending()
            return "start"
        pending, self._pending = self._pending, None
        assert pending is not None
        pending.copied.wait()
        self._start_persist(pending, held=True)
        return "none"

    def _pend(self, job: _Job) -> None:
        """Keep ``job``'s host copy for a later persist (replacing an older pending one)."""
        self._drop_pending()
        job.staging.hold()
        self._pending = job

    def _drop_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.staging.drop()
            self._record(persists_skipped=self.metrics.persists_skipped + 1)
            logger.info("layoutckpt: the persist of step %d was skipped for a newer one", pending.step)

    def _copy(self, job: _Job) -> None:
        start = time.perf_counter()
        try:
            job.staging.copy()
            job.staging.synchronize()
        except BaseException as err:  # noqa: BLE001 - the future and the writer report it
            job.error = err
        self._record(copy_seconds=time.perf_counter() - start)
        job.copied.set()
        job.fut._set_staged(job.error)

    def _start_deferred(self) -> None:
        job, self._deferred = self._deferred, None
        if job is not None:
            job.copied.wait()
            self._issue(job)

    def _issue(self, job: _Job) -> None:
        """Once the copy is done: start the replica sends and receives, and the persist."""
        if self.replicator is not None:
            job.works = self.replicator.post(job.staging.piece if job.error is None else None, job.incoming)
        job.posted.set()
        if job.persist:
            self._start_persist(job)

    def _acquire(self, held: list[Any]) -> Any:
        def acquire(nbytes: int) -> Any:
            held.append(self._pool(False).acquire(nbytes))
            return held[-1]

        return acquire

    def _skip_replica_round(self) -> None:
        """This rank has no piece to send: it still receives its predecessor's, and drops it."""
        if self.replicator is not None:
            held: list[Any] = []
            wait_all(self.replicator.post(None, self.replicator.headers(None, self._acquire(held))))
            for buf in held:
                self._pool(False).release(buf)

    def _start_persist(self, job: _Job, held: bool = False) -> None:
        """Start the ordinary async save of ``job``'s host copies to the durable tier."""
        if self._persisting is not None:
            self._persisting.exception()  # done on every rank (agreed): seen, so it is not raised again
        if not held:
            job.staging.hold()
        self._record(persists_started=self.metrics.persists_started + 1)
        try:
            if job.error is not None:
                raise job.error
            # A persist runs saves later: it stores the metadata and rank_state as staged at the save.
            doc = job.staging.piece.rank_doc
            rank_state = None if doc is None else _rankstate.parse(doc, "rank_state")
            fut = self._persist_fn(job.step, job.staging.tree(), job.layout, job.staging.metadata, rank_state)
        except Exception as err:  # noqa: BLE001 - never stops training: reported as a failed persist
            job.staging.drop()
            self._persisted(job.step, err)
            return
        self._persisting = fut
        fut.add_done_callback(lambda f: (job.staging.drop(), self._persisted(job.step, f.exception())))

    def _persisted(self, step: int, err: BaseException | None) -> None:
        if err is None:
            self._persist_failed = None
            self._record(persists_committed=self.metrics.persists_committed + 1, last_persisted_step=step)
            return
        message = (
            f"persisting step {step} to the durable tier failed on rank {self.comm.rank}: {err}; the fast "
            "tier still holds it, and training goes on (the next persist is tried as usual)"
        )
        logger.error("layoutckpt: %s", message)
        with self._lock:
            self._persist_failed = PersistError(message)
            self._unreported.append(message)
        self._record(persists_failed=self.metrics.persists_failed + 1, last_persist_error=str(err))

    def wait(self) -> SaveResult | None:
        """Wait for the last save and persist; raise the save's failure, or the persist's."""
        self._start_deferred()
        if self._pending is not None:  # every rank holds the same pending persist: start it now
            if self._persisting is not None:
                self._persisting.exception()
            pending, self._pending = self._pending, None
            pending.copied.wait()
            self._start_persist(pending, held=True)
        result = self._last.result() if self._last is not None else None
        if self._persisting is not None:
            self._persisting.exception()
            time.sleep(0)  # the done callback runs on the thread that finished the persist
        with self._lock:
            failed, self._persist_failed = self._persist_failed, None
            self._unreported.clear()
        if failed is not None:
            raise failed
        return result

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._worker.shutdown(wait=True)

    # The tier's thread ---------------------------------------------------------------------------
    def _write(self, job: _Job) -> None:
        """Write and commit the piece, exchange replicas with the peers, apply retention."""
        start = time.perf_counter()
        error: BaseException | None = None
        written = 0
        try:
            job.copied.wait()
            if job.error is not None:
                raise job.error
            # The piece's own hold on the host copy: a memory tier keeps the buffers themselves
            # until it retires the piece, when they go back to the pool for a later save.
            job.staging.hold()
            written = write_piece(self.tier.piece(job.step), job.staging.piece, self.io, done=job.staging.drop)
        except BaseException as err:  # noqa: BLE001 - settles the future below
            error = err
        self._record(write_seconds=time.perf_counter() - start)
        if self.replicator is not None:
            t = time.perf_counter()
            try:
                self._store_replica(job)
            except BaseException as err:  # noqa: BLE001 - settles the future below
                error = error or err
            self._record(replica_seconds=time.perf_counter() - t)
        job.staging.drop()
        try:
            if error is None:
                self.tier.retire(self.keep_last)
        except BaseException as err:  # noqa: BLE001 - settles the future below
            error = err
        if error is not None:
            where = f"rank {self.comm.rank}'s fast tier {self.tier.root.url!r}"
            job.fut._finish(
                error=SaveError(f"saving step {job.step} to {where} failed: {type(error).__name__}: {error}")
            )
            return
        self._record(last_local_step=job.step)
        seconds = time.perf_counter() - start
        job.fut._finish(
            SaveResult(job.fut.path, written, len(job.staging.piece.arrays), seconds, job.fut._blocked_seconds)
        )

    def _store_replica(self, job: _Job) -> None:
        """Wait for this round's sends and receives; keep the predecessor's piece on this tier."""
        assert self.replicator is not None
        job.posted.wait()
        received, job.held = job.held, []
        give_back = functools.partial(self._give_back, received)
        lent = False
        try:
            wait_all(job.works)
            if job.incoming is not None:
                pred = self.replicator.pred
                # Held as received (a memory tier): the receive buffers go back once it is retired.
                lent = True
                write_piece(self.tier.piece(job.step, pred), job.incoming, self.io, done=give_back)
                self.tier.retire(self.keep_last, pred)
        finally:
            if not lent:
                give_back()

    def _give_back(self, buffers: list[Any]) -> None:
        for buf in buffers:
            self._pool(False).release(buf)
