"""``save`` and ``save_async``: every rank writes the boxes it was assigned, then one rank commits.

On the caller's thread: state -> flatten -> check (local, then agreed across ranks) -> plan
(pure) -> stage (``save_async``: copy the shards this rank writes into reused host buffers).
In the background: write (the location's ``BoxWriter``, all writes in flight together; this
rank's share of the Zarr documents) -> one sync -> agree on success (over the rendezvous store)
-> commit (root metadata last, rename: ``Location.commit``). ``save`` runs the same steps on the
caller's thread, from the live tensors. What one call was asked for travels as one
``SaveOptions``, its I/O knobs as its ``IOConfig``.
"""

from __future__ import annotations

import collections
import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Unpack

import attrs
import numpy as np

from . import _rankstate
from ._agreement import agree, call_of, describe_call_disagreement, describe_disagreement
from ._commit import commit_everywhere
from ._flatsave import check_flat, expand_flats, flat_names, flat_writes
from ._pieces import Piece, localize, padded_shard, source_of, tie, tree_nodes, uses_views
from ._stages import join, reconcile
from .base import _faults
from .base._arguments import check_save_arguments
from .base._errors import InconsistentShardsError, SaveError
from .base._futures import SaveFuture, swap_in_flight, wait_previous
from .base._gc import collector_paused
from .base._metrics import SAVE_PHASES, InFlight, Metrics, Phases, report
from .base._options import SaveAsyncKeywords, SaveKeywords, SaveOptions, options_of
from .base._version import __version__
from .format import _hierarchy as hierarchy
from .format._format import ArrayMeta, CheckpointMeta, check_readable
from .format._hierarchy import user_metadata
from .layout import _flat, _plan
from .layout._flat import Flat
from .layout._layout import Layout
from .layout._spec import Mesh, P, check_spec
from .layout._tree import check_no_prefix_clash, flatten, name_to_path, tree_of
from .storage import _packs
from .storage._commit import new_token
from .storage._location import Location, locate
from .storage._writers import BoxWriter
from .torch._dist import Comm, StoreComm, background_comm, check_mesh, comm_for, digest
from .torch._dtensor import default_mesh, sharding_of
from .torch._staging import Staged, side_stream, stage_all

DEFAULT_INNER_CHUNK_BYTES = 2 << 20


@attrs.frozen
class SaveResult:
    """What this rank did: the committed path, bytes and arrays it wrote, and the time it took.

    ``arrays_written`` counts the boxes this rank wrote (a box is one shard of an array, or one
    row block of a flat buffer's parameter), so an array split into several boxes counts once
    per box; ``metrics.arrays`` counts distinct arrays. ``seconds`` runs from the call to the
    commit; ``blocked_seconds`` is how long the call held the caller (for ``save_async``,
    checks, planning and staging; for ``save``, all of it).
    ``metrics`` has the time of each phase (plan, stage, write, commit) and the writes in flight.
    ``staged_bytes`` are the bytes copied into staging buffers (``save_async``; 0 for ``save``).
    """

    path: str
    bytes_written: int
    arrays_written: int
    seconds: float
    blocked_seconds: float = 0.0
    staged_bytes: int = 0
    metrics: Metrics | None = attrs.field(default=None, repr=False)


@attrs.frozen
class _Job:
    """Everything the background part of a save needs; planned before the call returns."""

    tmp: Location
    final: Location
    meta: CheckpointMeta
    mine: list[tuple[str, _plan.Box]]
    rank_doc: bytes | None
    options: SaveOptions
    started: float
    operation: str
    phases: Phases = attrs.field(factory=Phases)
    in_flight: InFlight = attrs.field(factory=InFlight)


def save(
    path: str | os.PathLike[str], state: Any, layout: Layout | None = None, **options: Unpack[SaveKeywords]
) -> SaveResult:
    """Save this rank's shards of ``state`` under ``layout``; every rank of the group calls it.

    ``path`` is where the checkpoint goes: a local directory (or ``file:///dir``),
    ``s3://bucket/prefix``, ``gs://bucket/prefix``, ``memory://prefix`` (this process's memory),
    or a TensorStore kvstore spec as a dict (see "Object storage" in the how-to guides).
    ``state`` is a nested dict/list of local shards (``torch.Tensor``, ``DTensor`` or NumPy
    arrays; the global shape is recovered from all ranks' local shapes) and JSON values.
    ``layout`` says how each array is split; ``None`` means a DTensor's own placements, and
    every other array whole on every rank.

    ``step`` and ``metadata`` (a JSON-serializable dict) are stored with the checkpoint and
    read back by ``Reader.step`` and ``Reader.metadata``. ``rank_state`` is this rank's own
    JSON-like state (see ``load_rank_state``). A committed checkpoint at ``path`` raises
    ``CheckpointExistsError`` unless ``overwrite=True``, which replaces it atomically on a
    local path; object stores refuse to overwrite (save to a new prefix instead). ``group`` is
    the ``torch.distributed`` process group whose ranks save together (default: the default
    group, or a world of one without ``torch.distributed``). ``inner_chunk_bytes`` is the target
    size in bytes of an inner chunk, the unit a partial read fetches (default 2 MiB);
    ``compression`` is ``None`` (default), ``"zstd"`` or ``"blosc"``. ``io`` (an
    ``lc.IOConfig``) sets how bytes move: ``concurrency`` bounds the storage requests in flight
    (file operations, or S3/GCS requests), ``threads`` the threads that write a local
    checkpoint's shard files, and ``direct_io`` (default True) writes the large uncompressed
    shards of a local save past the page cache (``O_DIRECT``) where the file system allows it,
    and through it where not; ``None`` takes the defaults. ``timeout`` (seconds, default 600)
    bounds each wait of ``save_async``'s commit for the other ranks: a rank that died or is
    stuck is named in a ``SaveError`` on every rank still alive, within twice that (the
    collectives of ``save`` run on the process group, under its own timeout). ``packing`` says
    how the objects are stored: ``"files"``, one file per shard and document (plain zarr-python
    reads it); ``"ocdbt"``, all of them in TensorStore's OCDBT database, a data file per
    writing thread of each rank whatever the number of arrays (``io.threads``; more only past
    ``io.pack_bytes`` each, 1 GiB by default; plain TensorStore reads it, ``export_zarr`` makes
    it plain); ``"auto"`` (default) packs above 1,000 objects. Loads read either alike.

    Returns this rank's ``SaveResult`` (path, bytes and arrays written, seconds, and
    ``.metrics`` with the time of each phase) after the checkpoint is committed on every rank.
    Bad input raises before anything is written, on every rank: ``TypeError`` for arguments in
    the wrong order (the path comes first, unlike ``torch.save``), ``LayoutError`` for a spec that
    does not fit an array, ``InconsistentShardsError`` when ranks disagree, ``InvalidNameError``
    for a name that cannot be stored. A failed write raises ``SaveError`` and commits nothing.
    The caller is blocked throughout, so the live tensors are written without a staging copy.
    """
    check_save_arguments("save", path, state, layout, Layout)
    return start(path, state, layout, options_of(SaveOptions, options, "save", SaveKeywords), copy=False).result()


def save_async(
    path: str | os.PathLike[str], state: Any, layout: Layout | None = None, **options: Unpack[SaveAsyncKeywords]
) -> SaveFuture:
    """Start saving; return once the state is staged (copied out of the live tensors).

    Takes the keywords of ``save``, and returns a ``SaveFuture``. Writing and the commit run on
    a background thread; ``fut.result()`` waits for the commit, returns the ``SaveResult`` (its
    ``.metrics`` has the plan, stage, write and commit phases) and raises any rank's failure.
    With ``lazy=True`` the call returns before the copy is done: call ``fut.wait_staged()``
    before mutating the state (e.g. before ``optimizer.step()``). Staging buffers are reused
    from save to save; ``host_memory_budget`` (bytes, default unlimited) caps them, and a larger
    state is staged in waves as writes free buffers. One save is in flight at a time: this call
    first waits for the previous one, and raises its failure (as ``SaveError``) if nobody has
    seen it. Bad input raises here, before anything is written, as for ``save``.
    """
    check_save_arguments("save_async", path, state, layout, Layout)
    return start(path, state, layout, options_of(SaveOptions, options, "save_async", SaveAsyncKeywords), copy=True)


@collector_paused()
def start(
    path: str | os.PathLike[str] | Location,
    state: Any,
    layout: Layout | None,
    options: SaveOptions,
    *,
    copy: bool,
    private: bool = False,
) -> SaveFuture:
    """The save ``options`` describe: with ``copy``, as ``save_async`` (staged, then written in
    the background); without, as ``save`` (written from the live tensors before this returns).
    ``private`` (with ``copy``) says that ``state`` is a host copy nothing changes until the save
    ends, such as a fast tier's: it is written in the background straight from that copy."""
    t0 = time.perf_counter()
    comm = comm_for(options.group)
    final = locate(path)
    # One save in flight: its buffers come back, and its failure is not lost.
    previous = wait_previous()
    # 1. Local checks. An error is held until every rank has reported, so no rank hangs.
    checked = _check_locally(comm, final, state, layout, options, previous)
    # Under stage axes, the one exchange along them: every rank learns every array.
    checked = _with_views(comm, checked, layout)
    # 2. Agree on the state, and plan (or reuse the plan of an earlier save of the same state).
    planned, token, save_id = _agree_on_plan(comm, final, checked, layout, options)
    # 3. The token also keys the commit's store exchanges, so they never mix with another save's.
    # Copies that must agree are checked (or averaged) now: their values change from save to save.
    checked = attrs.evolve(checked, arrays=reconcile(comm, checked.arrays, checked.shardings, checked.holders, layout))
    job, sources = _job(comm, final, layout, options, checked, planned, (token, save_id), copy, t0)
    job.phases.since("plan", t0)
    items = [Staged(source) for source in sources]
    writer_comm = comm if not copy else background_comm(comm, f"save-{token:012x}", options.timeout)
    # 4. Stage and write. A synchronous save writes straight from the live tensors.
    if not copy:
        return _run_now(job, items, writer_comm)
    return _run_in_background(job, items, writer_comm, options, private)


@attrs.frozen
class _Checked:
    """This rank's part of a save, checked on its own; ``error`` is held until all ranks agree."""

    mesh: Mesh
    structure: Any = None
    arrays: list[Piece] = attrs.field(factory=list)
    shardings: list[tuple[Mesh, P]] = attrs.field(factory=list)
    flats: list[tuple[Piece, Flat]] = attrs.field(factory=list)
    rank_doc: bytes | None = None
    error: BaseException | None = None
    # Under a layout with views, the stored tree's leaves by global name (the tree is built from
    # them once every stage's are known); and, with stage axes, which coordinates hold each array.
    nodes: dict[str, Any] | None = None
    holders: list[tuple[tuple[int, ...], ...]] | None = None
    flat_holders: list[tuple[tuple[int, ...], ...]] | None = None
    metadata: dict[str, Any] = attrs.field(factory=dict)  # the user's, as of the call


def _check_locally(
    comm: Comm,
    final: Location,
    state: Any,
    layout: Layout | None,
    options: SaveOptions,
    previous: BaseException | None,
) -> _Checked:
    """Flatten and check ``state`` against ``layout`` on this rank, and (rank 0, or every rank
    of a local save) check and claim the destination; a failure is returned, not raised."""
    mesh = layout.mesh if layout is not None else Mesh({})
    try:
        if previous is not None:
            raise SaveError(f"the previous save_async failed, and this save was not started: {previous}") from previous
        structure, leaves = tie(*flatten(state))
        if layout is None:
            mesh = default_mesh(leaves, comm.world, comm.global_ranks)
        check_mesh(mesh, comm)
        pieces = localize(leaves, layout, mesh, comm.rank)
        arrays, shardings, flats = _shardings(comm, pieces, layout, mesh)
        nodes = None
        if uses_views(layout):
            assert layout is not None
            nodes = tree_nodes(structure, pieces, flats, layout, mesh, comm.rank)
        elif flats:
            structure = expand_flats(structure, flats)
        if flats:
            check_no_prefix_clash((*(a.name for a in arrays), *(n for f, spec in flats for n in flat_names(f, spec))))
        metadata = user_metadata(options.metadata)
        rank_doc = None
        if options.rank_state is not None:
            rank_doc = _rankstate.document(options.rank_state, comm.rank, comm.world)
        # An object store's prefix is checked and claimed by rank 0 alone: it may clear the
        # leftovers of an unfinished save there, which other ranks must not see half done.
        if final.is_local or comm.rank == 0:
            final.check_destination(options.overwrite)
        if comm.rank == 0:
            final.prepare()
    except Exception as err:  # noqa: BLE001 - re-raised by agree() on every rank
        return _Checked(mesh, error=err)
    return _Checked(mesh, structure, arrays, shardings, flats, rank_doc, nodes=nodes, metadata=metadata)


def _shardings(
    comm: Comm, pieces: list[Piece], layout: Layout | None, mesh: Mesh
) -> tuple[list[Piece], list[tuple[Mesh, P]], list[tuple[Piece, Flat]]]:
    """This rank's pieces with how each is split (a flat buffer's apart), each checked."""
    arrays: list[Piece] = []
    shardings: list[tuple[Mesh, P]] = []
    flats: list[tuple[Piece, Flat]] = []
    for a in pieces:
        if a.dtensor is not None:
            shardings.append(sharding_of(a.dtensor, a.name, comm.rank, comm.global_ranks, layout))
            arrays.append(a)
            continue
        spec = a.spec
        if isinstance(spec, Flat):
            flats.append((a, check_flat(a, spec, mesh, comm.rank)))
            continue
        check_spec(spec, mesh, len(a.shape), a.name, a.shape)
        shardings.append((mesh, spec))
        arrays.append(a)
    return arrays, shardings, flats


def _with_views(comm: Comm, checked: _Checked, layout: Layout | None) -> _Checked:
    """Under a layout with views, the stored tree built from global names; with stage axes,
    after the one exchange along them, every stored array of the state (stand-ins where this
    rank holds none) and which coordinates hold each. A failure is held, as local ones are."""
    if layout is None or not uses_views(layout):
        return checked
    try:
        if not layout.stage_axes:
            return checked if checked.error else attrs.evolve(checked, structure=tree_of(checked.nodes or {}))
        if checked.mesh.size != comm.world:
            return checked  # every rank fails check_mesh alike: no exchange to take part in
        failed = checked.error is not None
        j = join(
            comm, checked.mesh, layout, checked.arrays, checked.shardings, checked.flats, checked.nodes or {}, failed
        )
        if failed:
            return checked
        tree = tree_of(j.nodes)
    except Exception as err:  # noqa: BLE001 - re-raised by agree() on every rank
        return checked if checked.error else attrs.evolve(checked, error=err)
    return attrs.evolve(
        checked,
        structure=tree,
        arrays=j.arrays,
        shardings=j.shardings,
        holders=j.holders,
        flats=j.flats,
        flat_holders=j.flat_holders,
    )


def _stage_plan(checked: _Checked, layout: Layout | None) -> Any:
    """For ``_ToPlan.stages``: the stage axes and who may write each array."""
    if checked.holders is None or layout is None:
        return None
    writers = tuple(
        held[:1] if layout.replica_policy(a.name) == "first" else held
        for a, held in zip(checked.arrays, checked.holders)
    )
    return layout.stage_axes, tuple(checked.holders), writers


def _agree_on_plan(
    comm: Comm, final: Location, checked: _Checked, layout: Layout | None, options: SaveOptions
) -> tuple[_Planned, int, str]:
    """Check in one collective that every rank passed the same state to the same place with the
    same options, and plan the save unless every rank holds the plan of one earlier save of it;
    the plan, the save's token and its id (``CheckpointMeta.save_id``)."""
    arrays, flats, mesh = checked.arrays, checked.flats, checked.mesh
    # The mesh is part of each spec: ranks that order or size the mesh axes differently would
    # place their shards at different boxes.
    signature = [(a.name, a.dtype, len(a.shape), f"{s!r} on {m!r}") for a, (m, s) in zip(arrays, checked.shardings)]
    if checked.holders is not None:
        signature = [(*sig, held) for sig, held in zip(signature, checked.holders)]
    flat_signature = [(a.name, a.dtype, 1, f"{spec!r} on {mesh!r}") for a, spec in flats]
    if checked.flat_holders is not None:
        flat_signature = [(*sig, held) for sig, held in zip(flat_signature, checked.flat_holders)]
    signature += flat_signature
    agreed = (signature, checked.structure, checked.rank_doc is not None)
    what = _ToPlan(
        mesh,
        arrays,
        checked.shardings,
        flats,
        options.inner_chunk_bytes,
        options.compression,
        _stage_plan(checked, layout),
    )
    key = None if checked.error else what.key(comm)
    cached = _PLANS.get(key)
    call = call_of(final, options)
    words = [*digest(agreed), sum(len(a.shape) for a in arrays), *digest(sorted(call.items()))]
    # Three more words ride on this collective: the save that made each rank's cached plan (-1
    # for none), and rank 0's two random words: the token, which names the temporary directory,
    # and the rest of the save's id, which every shard's binding block names (96 random bits).
    rank0 = comm.rank == 0
    id_words = [new_token() if rank0 else 0, new_token() if rank0 else 0]
    hi, lo = agree(comm, checked.error, [*words, cached.token if cached else -1, *id_words])
    if hi[: len(words) - 2] != lo[: len(words) - 2]:
        raise InconsistentShardsError(describe_disagreement(comm, signature))
    if hi[len(words) - 2 : len(words)] != lo[len(words) - 2 : len(words)]:
        raise InconsistentShardsError(describe_call_disagreement(comm, call))
    token, save_id = hi[-2], f"{hi[-2]:012x}{hi[-1]:012x}"
    if cached is None or hi[-3] != lo[-3]:
        cached = _plan_globally(comm, what, token)
    # The tree lives as long as the save. The last save's, where equal, is already old to the
    # garbage collector; a new one (two containers per node) would be promoted with every save.
    if cached.tree != checked.structure:
        cached = attrs.evolve(cached, tree=checked.structure)
    _remember(key, cached)
    return cached, token, save_id


def _job(
    comm: Comm,
    final: Location,
    layout: Layout | None,
    options: SaveOptions,
    checked: _Checked,
    planned: _Planned,
    ids: tuple[int, str],
    copy: bool,
    started: float,
) -> tuple[_Job, list[Any]]:
    """What the write and the commit need, and the sources of this rank's boxes in their order.
    ``ids`` are the save's token and id: every shard is bound to the id (the cached plan's array
    documents are another save's, so they are bound afresh)."""
    token, save_id = ids
    packing = _packs.choose(options.packing, planned.metas.values())
    meta = CheckpointMeta(
        arrays=dict(planned.metas),
        tree=planned.tree,
        mesh=checked.mesh,
        rules=layout.spec_rules if layout is not None else (),
        step=options.step,
        user_metadata=checked.metadata,
        library_version=__version__,
        rank_state_world=comm.world if checked.rank_doc is not None else None,
        all_chunks_stored=True,
        packing=packing,
        # Rules only help a reader of a packed checkpoint of several ranks' databases.
        writers=planned.writers if packing != "files" and comm.world > 1 else {},
    ).bound(save_id)
    mine = [(checked.arrays[i].name, box) for i, box, _ in planned.regular]
    sources = [_part(source_of(checked.arrays[i]), where) for i, _, where in planned.regular]
    # Boundary fragments travel now, on the caller's thread: the process group is free, and
    # each rank sends at most one row block's fragment per flat buffer.
    stages = None if layout is None or checked.flat_holders is None else (layout.stage_axes, checked.flat_holders)
    for name, box, data in flat_writes(comm, checked.flats, planned.flat_shards, checked.mesh, stages):
        mine.append((name, box))
        sources.append(data)
    operation = "save_async" if copy else "save"
    job = _Job(final.staging(token), final, meta, mine, checked.rank_doc, options, started, operation)
    return job, sources


def _part(source: Any, where: tuple[slice, ...] | None) -> Any:
    """The shard at ``where`` in this rank's piece (all of it for None), contiguous."""
    if where is None:
        return source
    part = source[where]
    if hasattr(part, "is_contiguous"):
        return part if part.is_contiguous() else part.contiguous()
    return np.ascontiguousarray(part)


def _run_now(job: _Job, items: list[Staged], comm: Comm | StoreComm) -> SaveFuture:
    """``save``: write from the live tensors and commit on the caller's thread."""
    fut = SaveFuture(job.final.url)

    def view() -> None:  # inside the write's failure handling: the other ranks must hear of it
        for s in items:
            s.view()
        fut._set_staged()

    _write_and_commit(job, items, comm, fut, None, None, view)
    return fut


def _run_in_background(
    job: _Job, items: list[Staged], comm: Comm | StoreComm, options: SaveOptions, private: bool
) -> SaveFuture:
    """``save_async``: stage (here, or on a thread with ``lazy``) while a thread writes and commits.
    A ``private`` state is its own staging: a second copy would only take memory and cores."""
    fut = SaveFuture(job.final.url)
    stream = side_stream(s.source for s in items)
    if stream is not None:
        fut._wait_staged_hook = stream.synchronize
    returned = threading.Event()  # the result reports how long this call blocked
    budget = options.host_memory_budget
    # Within the budget the writer starts once everything is staged: writing meanwhile would
    # only compete with the copy for the GIL and the cores. Over it, writes must free buffers.
    waves = budget is not None and sum(s.nbytes for s in items) > budget
    gate = None if waves else fut._staged
    swap_in_flight(fut)
    threading.Thread(
        target=_write_and_commit, args=(job, items, comm, fut, returned, gate), name="layoutckpt-save"
    ).start()

    def stage() -> None:
        start = time.perf_counter()
        try:
            if private:
                for s in items:
                    s.view()
            else:
                stage_all(items, budget, stream)
        except BaseException as err:
            for s in items:  # the writer may be waiting for any of them: it gets the error
                s.fail(err)
            fut._set_staged(err)
            raise
        job.phases.since("stage", start)
        fut._set_staged()

    try:
        if options.lazy:
            threading.Thread(target=_quietly(stage), name="layoutckpt-stage", daemon=True).start()
        else:
            try:
                stage()
                fut.wait_staged()
            except BaseException:
                fut._observed = True  # raised here; the next save must not raise it again
                raise
    finally:
        fut._blocked_seconds = time.perf_counter() - job.started
        returned.set()
    return fut


@attrs.frozen
class _Planned:
    """What a save plans from every rank's shapes; the next save of the same state reuses it."""

    token: int  # the token of the save that planned it: the same on every rank
    metas: dict[str, ArrayMeta]
    # (index into the arrays, box) of each shard this rank writes, and where in its piece it lies.
    regular: list[tuple[int, _plan.Box, tuple[slice, ...] | None]]
    flat_shards: list[list[tuple[int, ...]]]
    # Each regular array's writer rule, where one holds (a packed checkpoint records them).
    writers: dict[str, tuple[int, int]]
    tree: Any = None  # the tree of the last save that used the plan


# The plans of the last few states this process saved, by everything they depend on that this
# rank knows alone: a cache, never a setting. A training loop saves one state again and again:
# its global shapes, array documents and write assignment are planned once, and later saves run
# one collective, not four.
_PLANS: collections.OrderedDict[Any, _Planned] = collections.OrderedDict()
_PLANS_KEPT = 4


@attrs.frozen
class _ToPlan:
    """What a save plans from: this rank's arrays, how each is split, and the chunking."""

    mesh: Mesh
    arrays: list[Piece]
    shardings: list[tuple[Mesh, P]]
    flats: list[tuple[Piece, Flat]]
    inner_chunk_bytes: int
    compression: str | None
    # With stage axes: those axes, and for each array the stage coordinates holding it and those
    # whose ranks may write it (the first alone where the layout's replica policy says "first").
    stages: tuple[tuple[str, ...], tuple[Any, ...], tuple[Any, ...]] | None = None

    def key(self, comm: Comm) -> Any:
        """Everything the plan depends on that this rank knows alone (hashable)."""
        local = tuple(
            (a.name, a.dtype, a.shape, a.itemsize, a.kind, m, spec, a.dtensor.shape if a.dtensor is not None else None)
            for a, (m, spec) in zip(self.arrays, self.shardings)
        )
        flat = tuple((a.name, a.dtype, a.shape, a.itemsize, a.kind, repr(spec)) for a, spec in self.flats)
        where = (comm.rank, tuple(comm.global_ranks), self.mesh, self.stages)
        return (*where, local, flat, self.inner_chunk_bytes, self.compression)

    def holders(self, index: int) -> int | None:
        """How many ranks hold array ``index`` (None: all of them)."""
        if self.stages is None:
            return None
        axes, held, _ = self.stages
        return len(held[index]) * self.mesh.size // math.prod(self.mesh.axis_size(a) for a in axes)

    def meta(self, name: str, a: Piece, shape: tuple[int, ...], outer: tuple[int, ...], **more: Any) -> ArrayMeta:
        """The document of the array ``name`` (of ``a``'s dtype), stored in shards of ``outer``."""
        inner = _plan.chunk_shape_for(outer, a.itemsize, self.inner_chunk_bytes)
        check_readable(name, shape, outer, inner, a.itemsize, self.inner_chunk_bytes)
        return ArrayMeta(
            path=name_to_path(name),
            shape=shape,
            dtype=a.dtype,
            shard_shape=outer,
            inner_chunk_shape=inner,
            kind=a.kind,
            compression=self.compression,
            **more,
        )


# What to change where an array's geometry is past a reader's limit (``geometry_problem``).
def _remember(key: Any, planned: _Planned) -> None:
    """Keep ``planned`` as the newest plan; the oldest of more than ``_PLANS_KEPT`` goes.

    A key already stored stays the stored one: the new, equal key (a tuple per array) then dies
    young instead of joining the garbage collector's oldest generation (``_workers.Workers``).
    """
    if key in _PLANS:
        _PLANS.move_to_end(key)
    _PLANS[key] = planned
    while len(_PLANS) > _PLANS_KEPT:
        _PLANS.popitem(last=False)


def _plan_globally(comm: Comm, what: _ToPlan, token: int) -> _Planned:
    """Global shapes from every rank's local shapes, the array documents, and this rank's
    writes; this rank's shards are checked against them on every rank."""
    metas, plan_arrays = _array_metas(comm, what)
    flat_shards = _flat_metas(what, metas)
    error = None
    try:
        _check_shards(comm.rank, what, plan_arrays)
    except InconsistentShardsError as err:
        error = err
    agree(comm, error, [])
    # Rank 0 writes the root document, the rules' one reader: at 16,384 ranks they cost it
    # about 0.15 s (once per state, with the plan).
    rules = _plan.writer_rules(plan_arrays, what.mesh) if comm.rank == 0 else []
    writers = {a.name: rule for a, rule in zip(plan_arrays, rules) if rule is not None}
    return _Planned(token, metas, _writes(plan_arrays, what.mesh, comm.rank), flat_shards, writers)


def _writes(
    arrays: list[_plan.ArraySpec], mesh: Mesh, rank: int
) -> list[tuple[int, _plan.Box, tuple[slice, ...] | None]]:
    """The shards this rank writes, each with where it lies in the piece the rank holds (None
    where it is the whole piece; a part where replicas share the piece's write)."""
    out = []
    for i, box in _plan.writes_of(arrays, mesh, rank):
        a = arrays[i]
        held = _plan.shard_box(a.shape, a.spec, a.mesh or mesh, rank, a.piece)
        where = None if box == held else tuple(slice(b0 - h0, b1 - h0) for (b0, b1), (h0, _) in zip(box, held))
        out.append((i, box, where))
    return out


def _array_metas(comm: Comm, what: _ToPlan) -> tuple[dict[str, ArrayMeta], list[_plan.ArraySpec]]:
    """The document and the plan entry of each regular array, its global shape recovered from
    the local shapes of the ranks holding it (or its DTensor's)."""
    # A padded array's rows per piece ride along: every rank must pad to the same length.
    local_dims = [d for a in what.arrays for d in (*a.shape, a.pad[1] if a.pad is not None else 0)]
    sums = comm.all_reduce(local_dims, "sum")
    # A rank holding no piece of an array (another stage's) takes no part in its extremes.
    held = [a.source is not None for a in what.arrays for _ in range(len(a.shape) + 1)]
    hi = comm.all_reduce([*local_dims, *(-d if h else -_NONE for d, h in zip(local_dims, held))], "max")
    maxs, mins = hi[: len(local_dims)], [-v for v in hi[len(local_dims) :]]
    plan_arrays: list[_plan.ArraySpec] = []
    offset = 0
    for index, (a, (m, spec)) in enumerate(zip(what.arrays, what.shardings)):
        sl = slice(offset, offset + len(a.shape))
        offset += len(a.shape) + 1
        if a.pad is not None and mins[sl.stop] != maxs[sl.stop]:
            raise InconsistentShardsError(
                f"array {a.name!r}: the ranks pad their pieces to different lengths ({mins[sl.stop]} to "
                f"{maxs[sl.stop]} rows along dimension {a.pad[0]}); every rank must hold the same number of "
                "rows, padded as the model pads its vocabulary (the last rank's tail is the padding)"
            )
        holders = what.holders(index)
        if a.dtensor is not None:
            shape = tuple(a.dtensor.shape)
        else:
            shape = _plan.global_shape_from_sums(a.name, spec, m, sums[sl], mins[sl], maxs[sl], holders)
        own_mesh = m if m != what.mesh else None
        piece = padded_shard(a, shape, spec, m)
        stage_axes, stages = ((), None) if what.stages is None else (what.stages[0], what.stages[2][index])
        plan_arrays.append(_plan.ArraySpec(a.name, shape, spec, a.itemsize, own_mesh, piece, stage_axes, stages))
    metas = {
        a.name: what.meta(a.name, a, pa.shape, outer, spec=pa.spec, mesh=pa.mesh)
        for a, pa, outer in zip(what.arrays, plan_arrays, _plan.stored_shards(plan_arrays, what.mesh))
    }
    return metas, plan_arrays


# What a rank that holds no piece of an array gives to the minimum of its sizes: past any size.
_NONE = 1 << 62


def _flat_metas(what: _ToPlan, metas: dict[str, ArrayMeta]) -> list[list[tuple[int, ...]]]:
    """Add the document of each flat buffer's parameters to ``metas``; their shard shapes."""
    flat_shards: list[list[tuple[int, ...]]] = []
    for a, spec in what.flats:
        flat_shards.append([])
        for index, (stored, (param, shape)) in enumerate(zip(flat_names(a, spec), spec.params)):
            outer = spec.stored_shard(index, a.itemsize, what.mesh, _flat.DEFAULT_SHARD_BYTES)
            flat_shards[-1].append(outer)
            metas[stored] = what.meta(stored, a, shape, outer, spec=spec.spec_of(param))
    return flat_shards


def _check_shards(rank: int, what: _ToPlan, plan_arrays: list[_plan.ArraySpec]) -> None:
    """Each local shard has the shape its rank's box of the recovered global shape has."""
    for a, pa in zip(what.arrays, plan_arrays):
        if a.source is None:
            continue  # another stage's array
        mesh = pa.mesh or what.mesh
        expected = _plan.box_shape(_plan.shard_box(pa.shape, pa.spec, mesh, rank, pa.piece))
        if a.shape != expected:
            raise InconsistentShardsError(
                f"array {a.name!r}: rank {rank} holds a shard of shape {a.shape}, but "
                f"the global shape {pa.shape} recovered from all ranks, split by {pa.spec!r} on "
                f"{mesh!r} (as torch.chunk would), gives this rank {expected}; check that every "
                "rank passes its own shard of the same tensor"
            )


def _quietly(fn: Any) -> Any:
    """Run ``fn`` on a thread whose exception is reported by a future, not printed."""

    def run() -> None:
        try:
            fn()
        except BaseException:  # noqa: BLE001 - the future carries it
            pass

    return run


def _write_and_commit(
    job: _Job,
    items: list[Staged],
    comm: Comm | StoreComm,
    fut: SaveFuture,
    returned: threading.Event | None,
    gate: threading.Event | None,
    view: Callable[[], None] | None = None,
) -> None:
    """Write this rank's boxes (once ``gate`` opens, or as they are staged; a synchronous save
    first ``view``s the live tensors), agree on success, commit; settle ``fut``."""
    written = 0
    failure = b""
    try:
        if view is not None:
            view()
        if gate is not None:
            gate.wait()
        start = time.perf_counter()
        if comm.rank == 0:
            job.final.claim(job.tmp, job.meta.save_id)
        written = _write(job, items, comm.rank, comm.world)
        job.phases.since("write", start)
    except Exception as err:  # noqa: BLE001 - reported to every rank below
        failure = f"{type(err).__name__}: {err}".encode()
    except BaseException:
        # Ctrl-C in a synchronous save: one process alone writes the staging folder, and takes
        # it away; ranks of a job are stopped together, and their restart clears it.
        if comm.world == 1:
            job.tmp.discard()
        raise
    try:
        start = time.perf_counter()
        commit_everywhere(comm, job.tmp, job.final, job.meta, failure, job.options.overwrite)
        job.phases.since("commit", start)
    except BaseException as err:  # noqa: BLE001 - the future raises it
        fut._finish(error=err)
        return
    fut._finish(_result(job, comm, fut, written, returned))


def _result(
    job: _Job, comm: Comm | StoreComm, fut: SaveFuture, written: int, returned: threading.Event | None
) -> SaveResult:
    """This rank's ``SaveResult`` of a committed save, with its metrics."""
    seconds = time.perf_counter() - job.started
    held, staged = seconds, 0  # a synchronous save held the caller throughout and copied nothing
    if returned is not None:
        returned.wait()
        held, staged = fut._blocked_seconds, written
    flight = job.in_flight
    metrics = Metrics(
        job.operation,
        job.final.url,
        comm.rank,
        comm.world,
        job.phases.items(SAVE_PHASES),
        written,
        len({n for n, _ in job.mine}),
        flight.issued,
        flight.most,
        flight.most_bytes,
        seconds,
    )
    return SaveResult(job.final.url, written, len(job.mine), seconds, held, staged, report(metrics))


def _write(job: _Job, items: list[Staged], rank: int, world: int) -> int:
    """Start every write as soon as its box is staged, write this rank's share of the Zarr
    documents meanwhile, then make it all durable; a written buffer goes back at once. Which
    writer writes a box is the location's choice (``Location.box_writer``)."""
    writer: BoxWriter | None = None
    try:
        _faults.point("save.write", url=job.final.url)
        if job.meta.packed:
            writer = _packs.PackWriter(job.tmp, rank, job.options.io, job.in_flight)
        else:
            writer = job.tmp.box_writer(job.options.io, job.in_flight)
        for (name, box), item in zip(job.mine, items):
            writer.write(job.meta.arrays[name], box, item)
        writer.write_documents(hierarchy.documents(job.meta, rank, world))
        if job.rank_doc is not None:
            job.tmp.write(_rankstate.file_name(rank), job.rank_doc)
        written = writer.join()
        # Durable before this rank reports success: the marker may follow at once.
        job.tmp.make_durable()
        return written
    finally:
        # A writer thread may wait for an item the save will never stage: it fails instead.
        # Every buffer goes back, also where the writer could not even be made.
        for item in items:
            item.fail(SaveError("the save stopped before this shard was written"))
        if writer is not None:
            writer.close()
        for item in items:
            item.release()
