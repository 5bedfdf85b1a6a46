"""``CheckpointManager``: the checkpoints of one training run, under one root directory.

    root/
      .layoutckpt.lock              held (flock) by the manager's rank 0 while it lives
      step_00000100/                a committed checkpoint (its root zarr.json is the marker)
      step_00000200/
      .step_00000300.tmp-1f2e...    a save in progress, or the leftover of a crashed one

Only committed checkpoints exist for ``steps()``/``latest_step()``/``load``; a restart removes
the leftovers of uncommitted ones. Retention runs in the background after each commit and never
deletes the newest committed checkpoint. A second manager on the same root is refused, so two
jobs never interleave their saves and deletions.

On an object store (``s3://bucket/run``) the steps are prefixes committed by their marker
(``_location``). There is no lock to take there: give each run its own root. A step's leftover
objects are cleared by the next save of that step, and retention deletes a step's marker
first, so a step is never listed while it is being deleted.
"""

from __future__ import annotations

import concurrent.futures
import copy
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from . import _rankstate
from ._load import Select, load, load_rank_state, split_by_rank
from ._reader import Reader
from ._retention import check_retention, release_lock, take_lock
from ._save import SaveResult, start
from ._steps import (  # noqa: F401 - re-exported: cli/ and the tests import them from here
    STEP_PREFIX,
    committed_steps,
    leftovers,
    remove_leftovers,
    retire_step,
    step_dir,
    step_folders,
    step_of,
    to_delete,
)
from .base._errors import CheckpointNotFoundError, ManagerLockedError, TemplateMismatchError
from .base._futures import SaveFuture
from .base._options import IOConfig, SaveOptions
from .layout._layout import Layout
from .storage import _store
from .storage._location import KvPrefix, locate
from .tiers import (
    TIER_KEY,
    Choice,
    LocalTier,
    TierMetrics,
    Tiers,
    agree,
    fetch_missing,
    layout_key,
    load_piece,
    piece_misfit,
)
from .torch._dist import comm_for

_ANY = object()  # no layout given: a fast-tier piece of any layout will do


class CheckpointManager:
    """Save, list, load and retire the checkpoints of a training run; every rank creates one.

    ``keep_last`` and ``keep_every`` say which committed steps retention keeps (``to_delete``);
    saves are asynchronous (``lc.save_async``) unless ``async_save=False``. ``group``, ``io``
    and any other keyword of ``lc.save_async`` (``inner_chunk_bytes``, ``compression``,
    ``host_memory_budget``, ...) apply to every save, and ``save(..., **options)`` overrides
    them for one.

    With ``local=`` the manager keeps two tiers: every save commits to ``local`` (host memory
    ``"memory://run/{rank}"``, or a node-local directory such as ``"/nvme/run/{rank}"``; ``{rank}``
    is the rank in the group) on each rank, keeping its newest ``local_keep_last`` steps, and
    every ``persist_every``-th step is persisted to ``root`` (the durable tier) in the background,
    an ordinary checkpoint under ``keep_last``/``keep_every``. ``replicas=1`` also keeps each
    rank's piece on a peer rank's fast tier. ``load`` then restores the newest step that some
    tier holds for every rank, from the fastest (see "Multi-tier checkpoints" in the docs); with
    tiers, ``latest_step``, ``load``, ``load_rank_state``, ``load_state``, ``metadata`` and
    ``reader`` are collective (every rank calls them).

    >>> mgr = CheckpointManager("ckpts", keep_last=3, keep_every=1000)  # doctest: +SKIP
    >>> mgr.save(step, state, layout)        # async: returns once the state is staged
    >>> mgr.load(layout)                     # the latest committed step
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep_last: int | None = None,
        keep_every: int | None = None,
        async_save: bool = True,
        group: Any = None,
        io: IOConfig | None = None,
        local: str | os.PathLike[str] | None = None,
        local_keep_last: int = 2,
        persist_every: int = 1,
        replicas: int = 0,
        **save_options: Any,
    ) -> None:
        check_retention(keep_last, keep_every)
        _check_tiers(local, local_keep_last, persist_every, replicas)
        self._loc = locate(root)
        self._spec_root = isinstance(root, Mapping)
        # A local root stays a Path (its historical type); an object store's is its URL.
        self.root: Path | str = Path(self._loc.url) if self._loc.is_local else self._loc.url
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.async_save = async_save
        self._group = group
        # Every save's options but the step's own (step, metadata, rank_state, overwrite).
        self._defaults = _options(SaveOptions(group=group, io=io), save_options)
        self._comm = comm_for(group)
        self._lock_fd: int | None = None
        self._last: SaveFuture | None = None
        self._retention: concurrent.futures.ThreadPoolExecutor | None = None
        self._retiring: list[concurrent.futures.Future[None]] = []
        self._retire_for: SaveFuture | None = None  # the newest save a retention run waits for
        self._newest: int | None = None  # the newest step of the run, known from the first save on

        # Rank 0 takes the lock and cleans up; every rank learns whether it could.
        status = b""
        error: Exception | None = None
        if self._comm.rank == 0:
            try:
                if isinstance(self.root, Path):
                    self.root.mkdir(parents=True, exist_ok=True)
                    self._lock_fd = take_lock(self.root)
                    remove_leftovers(self.root)
                self._retention = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="layoutckpt-retain")
            except Exception as err:  # noqa: BLE001 - every rank raises below
                error = err
                kind = "locked" if isinstance(err, ManagerLockedError) else "failed"
                status = f"{kind}:{type(err).__name__}: {err}".encode()
        status = self._comm.broadcast_bytes(status if self._comm.rank == 0 else None)
        if status:
            self._release_lock()
            if error is not None:
                raise error
            kind, _, detail = status.decode().partition(":")
            message = f"cannot manage {os.fspath(self.root)!r}: rank 0 raised {detail}"
            raise ManagerLockedError(message) if kind == "locked" else RuntimeError(message)
        self._tiers: Tiers | None = None
        self._local_fd: int | None = None
        if local is not None:
            self._open_tiers(os.fspath(local), local_keep_last, persist_every, replicas)

    def _open_tiers(self, local: str, keep_last: int, persist_every: int, replicas: int) -> None:
        """Every rank locks and cleans its own fast tier (a directory); all learn whether all could."""
        error: Exception | None = None
        try:
            tier = LocalTier(local.replace("{rank}", str(self._comm.rank)), self._defaults.io)
            if tier.root.is_local:
                self._local_fd = take_lock(Path(tier.root.url))
            tier.clean()
        except Exception as err:  # noqa: BLE001 - every rank raises below
            error = err
        (failed,) = self._comm.all_reduce([int(error is not None)], "max")
        if failed:
            self._release_lock()
            if error is not None:
                raise error
            raise ManagerLockedError(f"cannot manage the fast tier {local!r}: another rank could not open its own")
        self._tiers = Tiers(
            tier,
            comm=self._comm,
            keep_last=keep_last,
            persist_every=persist_every,
            replicas=replicas,
            persist=self._persist,
        )

    def __repr__(self) -> str:
        return f"CheckpointManager({os.fspath(self.root)!r}, keep_last={self.keep_last}, keep_every={self.keep_every})"

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Listing ------------------------------------------------------------------------------------
    def path(self, step: int) -> Path | str | dict[str, Any]:
        """Where ``step`` is (or would be) saved: a ``Path`` under a local root, a kvstore spec
        under a root given as one (every member of it kept: an endpoint, credentials), else a URL.

        Whether a checkpoint is committed there is not checked; ``steps()`` lists those.
        """
        if isinstance(self.root, Path):
            return self.root / step_dir(step)
        child = self._loc.child(step_dir(step))
        return child.kvstore() if self._spec_root and isinstance(child, KvPrefix) else child.url

    def steps(self) -> list[int]:
        """The committed steps, oldest first. A save still in progress is not among them."""
        return committed_steps(self._loc)

    def latest_step(self) -> int | None:
        """The newest committed step, or None if there is none yet (a save in progress is not one).

        With tiers: the step ``load`` restores (under the layout the run saved with), agreed by
        every rank (collective).
        """
        if self._tiers is not None:
            try:
                return self._choose(None, None).step
            except CheckpointNotFoundError:
                return None
        steps = self.steps()
        return steps[-1] if steps else None

    def local_steps(self) -> list[int]:
        """The steps committed on this rank's fast tier, oldest first (empty without tiers)."""
        return committed_steps(self._tiers.tier.where()) if self._tiers is not None else []

    def tier_metrics(self) -> TierMetrics:
        """This rank's tiered checkpointing so far: copy and write times, persists started,
        committed, skipped and failed, where the last restore read from (``lc.TierMetrics``)."""
        return self._tiers.metrics if self._tiers is not None else TierMetrics()

    def _choose(self, step: int | None, layout_key: str | None) -> Choice:
        assert self._tiers is not None
        self._tiers._start_deferred()  # a collective of every rank, as this call is
        return agree(self._tiers.tier, self._comm, self._loc, step, layout_key)

    def _restorable(
        self, step: int | None, layout: Any = _ANY, like: Any = _ANY, *, collective: bool = True
    ) -> tuple[Path | str, bool]:
        """Where ``step`` (default: the newest every rank can restore) is read on this rank, and
        whether that is its fast-tier piece; a piece only a peer holds is fetched first. For a
        load into ``like``, the pieces serve only where every rank's fits the template
        (``piece_misfit``); the durable tier serves otherwise. ``collective``: every rank asks
        (a load), and where the ranks load different parts (``split_by_rank``) they agree on the
        newest step; a tiered manager's ranks always agree."""
        if self._tiers is None:
            split = split_by_rank(None if layout is _ANY else layout, None if like is _ANY else like)
            if step is None and collective and split and self._comm.world > 1:
                step = self._newest_on_every_rank()
            return self._resolve(step), False
        choice = self._choose(step, None if layout is _ANY else layout_key(layout))
        if choice.tier == "local":
            source = fetch_missing(self._tiers.tier, self._comm, choice)
            piece = self._tiers.tier.piece(choice.step).url
            misfit = None if like is _ANY else self._misfit(piece, like, layout not in (None, _ANY))
            if misfit is None:
                self._tiers._record(restored_step=choice.step, restored_from=source)
                return piece, True
            if not choice.durable:
                raise TemplateMismatchError(
                    f"step {choice.step} is on the fast tiers only, which hold array {misfit!r} as a DTensor's "
                    "shard, sharded otherwise than the template asks (or wanted whole, without a template); "
                    "load it into a template sharded as it was saved (like=, or load_state with the same "
                    "parallelism), or restore a step the durable tier holds (steps()), which reshards"
                )
        self._tiers._record(restored_step=choice.step, restored_from="durable")
        return self.path(choice.step), False

    def _misfit(self, piece: str, like: Any, by_layout: bool) -> str | None:
        """The first leaf, on any rank, that this step's pieces do not hold as a load into ``like``
        wants it (collective); None where every rank's piece fits."""
        info = _store.read_meta(piece).user_metadata.get(TIER_KEY, {})
        found = piece_misfit(info, like, by_layout=by_layout)
        everyone = self._comm.all_gather_bytes((found or "").encode())
        return next((name.decode() for name in everyone if name), None)

    def _newest_on_every_rank(self) -> int | None:
        """The newest step every rank lists: a save committing while the ranks list the root
        (or a file system slow to show it) would have them restore different steps."""
        steps = self.steps()
        _, (newest,) = self._comm.all_max_min([steps[-1] if steps else -1])
        if newest < 0:
            raise CheckpointNotFoundError(
                2,
                f"no committed checkpoint under {os.fspath(self.root)!r} on some rank; save one first",
                os.fspath(self.root),
            )
        return newest

    def _resolve(self, step: int | None) -> Path | str:
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointNotFoundError(
                    2, f"no committed checkpoint under {os.fspath(self.root)!r}; save one first", os.fspath(self.root)
                )
        return self.path(step)

    # Saving -------------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        state: Any,
        layout: Layout | None = None,
        *,
        metadata: Mapping[str, Any] | None = None,
        rank_state: Any = None,
        overwrite: bool = False,
        **options: Any,
    ) -> SaveFuture:
        """Save ``state`` as ``step``; asynchronous unless the manager was made with ``async_save=False``.

        Returns a ``SaveFuture`` (already done for a synchronous save). Retention runs after the
        commit, in the background. ``layout`` may be left out for a state of DTensors (such as
        ``lc.get_state(model, optimizer)``) or of whole tensors.
        """
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        self._check_order(step)
        if self._tiers is not None:
            lazy = bool(options.pop("lazy", self._defaults.lazy))
            _options(self._defaults, options)  # unknown keywords raise as without tiers
            fut = self._tiers.save(step, state, layout, metadata=metadata, rank_state=rank_state, lazy=lazy)
            self._newest = step  # a save refused for its input does not move the run on
            if not self.async_save:
                fut.result()
            return fut
        mine = dict(step=step, metadata=metadata, rank_state=rank_state, overwrite=overwrite)
        fut = start(self.path(step), state, layout, _options(self._defaults, {**options, **mine}), copy=self.async_save)
        self._newest = step
        if not self.async_save:
            fut.result()  # a synchronous save raises its failure here
        self._last = fut
        if self._retention is not None:
            # Queued now (so wait() sees it), run once this save has committed.
            self._retire_later(fut)
        return fut

    def _check_order(self, step: int) -> None:
        """Refuse a step older than the run's newest: a restart resumes from the newest step
        and retention keeps the highest ones, so after a rollback the abandoned newer steps
        would outlive every new save. The newest is the durable tier's, listed at the first save
        (every rank lists the same), then the saves'. A fast tier's own steps are left out: they
        may differ from rank to rank, and every rank must decide alike."""
        if self._newest is None:
            self._newest = max(self.steps(), default=-1)
        if step < self._newest:
            raise ValueError(
                f"step {step} is older than step {self._newest}, which this run has saved: a restart resumes "
                "from the newest step, and retention keeps the highest. To go on from an older step (a "
                "rollback), first delete the newer ones on every rank: "
                f"mgr.delete(*[s for s in mgr.steps() + mgr.local_steps() if s > {step}])"
            )

    def delete(self, *steps: int) -> None:
        """Delete ``steps`` from every tier: what a rollback needs before saving older steps again.

        Waits for the saves and retention in flight first. Every rank calls it: rank 0 deletes
        the durable checkpoints, each rank its fast tier's pieces (and the replicas it holds)."""
        if not all(isinstance(s, int) and not isinstance(s, bool) for s in steps):
            raise TypeError(f"delete() takes step numbers (ints), got {steps!r}")
        self.wait()
        if self._comm.rank == 0:
            for step in set(steps) & set(self.steps()):
                retire_step(self._loc, step)
        if self._tiers is not None:
            tier = self._tiers.tier
            for src in [None, *tier.replica_sources()]:
                for step in set(steps) & set(committed_steps(tier.where(src))):
                    retire_step(tier.where(src), step)
        self._comm.all_reduce([0], "max")  # no rank lists the steps before every rank is done
        self._newest = None

    def _persist(self, step: int, state: Any, layout: Layout | None, metadata: Any, rank_state: Any) -> SaveFuture:
        """The durable tier's save of a fast-tier step: an ordinary async save written straight
        from its host copy, which the tier keeps unchanged until the save ends (``private``),
        with this manager's retention after it.

        Packed unless the manager was told otherwise: its writer threads share the training
        loop's GIL, and every file of a plain checkpoint is a dozen system calls, each of which
        hands the GIL back and forth with the loop, where a packed one's few data files are not
        (``docs/design/multi-tier.md``)."""
        mine = dict(step=step, metadata=metadata, rank_state=rank_state, lazy=True)
        if self._defaults.packing == "auto":
            mine["packing"] = "ocdbt"
        fut = start(self.path(step), state, layout, _options(self._defaults, mine), copy=True, private=True)
        if self._retention is not None:
            self._retire_later(fut)
        return fut

    def _retire_later(self, fut: SaveFuture) -> None:
        """Queue retention to run once ``fut`` has committed. A run already queued and not yet
        started serves: it waits for the newest save when it starts, and lists the steps then.
        Saves that come faster than deletions (two ranks' writer threads contend with them)
        would otherwise queue a run per save and keep every step on disk meanwhile. Runs that
        ended well are forgotten here; ``wait()`` raises the failure of one that did not."""
        assert self._retention is not None
        self._retire_for = fut
        self._retiring = [f for f in self._retiring if not f.done() or f.exception() is not None]
        if self._retiring and not self._retiring[-1].running() and not self._retiring[-1].done():
            return
        self._retiring.append(self._retention.submit(self._retire_after))

    def _retire_after(self) -> None:
        fut = self._retire_for
        assert fut is not None
        if fut._future.exception() is not None:
            return  # a failed save changes nothing; the checkpoints we have stay
        for step in to_delete(self.steps(), self.keep_last, self.keep_every):
            retire_step(self._loc, step)

    def wait(self) -> SaveResult | None:
        """Wait for the last save (raising its failure) and for retention; the save's result.

        Retention runs on rank 0 only: on other ranks, ``steps()`` may list a step that rank 0
        is retiring until a barrier after ``wait()`` on every rank.
        """
        result = self._last.result() if self._last is not None else None
        if self._tiers is not None:
            result = self._tiers.wait()  # raises PersistError if the latest persist failed
        # Each retention failure is raised once: a loop that calls wait() goes on after it.
        retiring, self._retiring = self._retiring, []
        failed = next((err for err in (f.exception() for f in retiring) if err is not None), None)
        if failed is not None:
            raise failed
        return result

    def close(self) -> None:
        """Wait for pending work, then release the root for another manager."""
        try:
            self.wait()
        finally:
            if self._tiers is not None:
                self._tiers.close()
            if self._retention is not None:
                self._retention.shutdown(wait=True)
                self._retention = None
            self._release_lock()

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            release_lock(self._lock_fd)
            self._lock_fd = None
        if getattr(self, "_local_fd", None) is not None:
            release_lock(self._local_fd)
            self._local_fd = None

    # Loading ------------------------------------------------------------------------------------
    def load(
        self,
        layout: Layout | None = None,
        *,
        step: int | None = None,
        like: Any = None,
        select: Select = None,
        strict: bool = True,
        **options: Any,
    ) -> Any:
        """Load ``step`` (default: the latest committed) under ``layout``; see ``lc.load``.

        With tiers, from the fastest tier that holds the step for every rank: a fast-tier piece
        holds this rank's shards as saved under ``layout``, so it serves only the layout and
        world size that saved it (another one reads the durable tier, which reshards).
        """
        path, piece = self._restorable(step, layout, like)
        options.setdefault("io", self._defaults.io)
        if piece:
            return load_piece(path, like, select=select, strict=strict, group=self._group, **options)
        return load(path, layout, like=like, select=select, strict=strict, group=self._group, **options)

    def load_state(
        self,
        model: Any,
        optimizer: Any = None,
        layout: Layout | None = None,
        *,
        step: int | None = None,
        strict: bool = True,
        options: Any = None,
    ) -> Any:
        """Restore ``model`` (and ``optimizer``) from ``step`` (default: the latest); see ``lc.load_state``,
        whose ``LoadStateResult`` it returns."""
        from ._training import get_state, restore_state

        template = get_state(model, optimizer, options=options)
        path, piece = self._restorable(step, layout, template)
        kw = dict(strict=False, group=self._group, io=self._defaults.io)

        def read(like: Any) -> Any:
            return load_piece(path, like, **kw) if piece else load(path, layout, like=like, **kw)

        names = None if piece else layout  # a piece holds this rank's own names
        return restore_state(
            path, model, optimizer, template, read, strict=strict, options=options, layout=names, group=self._group
        )

    def load_rank_state(self, step: int | None = None, *, redistribute: Any = None) -> Any:
        """This rank's ``rank_state=`` of ``step`` (default: the latest); see ``lc.load_rank_state``.

        ``redistribute(states, rank, world)`` maps the saved ranks' documents to this rank's when
        the world size changed. Raises ``CheckpointNotFoundError`` if there is no such step.
        """
        path, piece = self._restorable(step)
        if piece:  # this rank's own piece of a fast tier, its one document as rank 0's
            root = locate(path)
            _rankstate.saved_world(_store.read_meta(root), root.url)
            return _rankstate.read_one(root, 0)
        return load_rank_state(path, group=self._group, redistribute=redistribute)

    def metadata(self, step: int | None = None) -> dict[str, Any]:
        """The user metadata of ``step`` (default: latest), read without loading any array."""
        path, _ = self._restorable(step, collective=False)
        found = _store.read_meta(path).user_metadata
        return copy.deepcopy({k: v for k, v in found.items() if k != TIER_KEY})  # the parsed document is shared

    def reader(self, step: int | None = None) -> Reader:
        """A ``Reader`` (as ``lc.open`` returns) of ``step`` (default: the latest committed).

        Raises ``CheckpointNotFoundError`` if there is no such step. Use it as
        ``with mgr.reader() as rd:``.
        """
        return Reader(self._restorable(step, collective=False)[0], io=self._defaults.io)


def _check_tiers(local: Any, keep_last: Any, persist_every: Any, replicas: Any) -> None:
    for name, value in (("local_keep_last", keep_last), ("persist_every", persist_every)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if replicas not in (0, 1) or isinstance(replicas, bool):
        raise ValueError(f"replicas must be 0 or 1 (copies of each rank's fast tier on a peer), got {replicas!r}")
    if local is None and replicas:
        raise ValueError("replicas=1 copies the fast tier to a peer: give the fast tier too, as local=")


def _options(base: SaveOptions, changes: Mapping[str, Any]) -> SaveOptions:
    """``base`` with ``changes`` (keywords of ``lc.save_async``); unknown ones raise ``TypeError``."""
    unknown = sorted(set(changes) - {f.name for f in attrs.fields(SaveOptions)} | ({"group"} & set(changes)))
    if unknown:
        raise TypeError(
            f"CheckpointManager takes the keywords of lc.save_async besides group (given to the manager), not {unknown}"
        )
    return attrs.evolve(base, **changes)
