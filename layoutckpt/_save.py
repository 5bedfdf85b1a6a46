"""``save`` and ``save_async``: every rank writes the boxes it was assigned, then one rank commits.

On the caller's thread: state -> flatten -> check (local, then agreed across ranks) -> plan
(pure) -> stage (``save_async``: copy the shards this rank writes into reused host buffers).
In the background: write (TensorStore futures, all in flight together; this rank's share of the
Zarr documents) -> one sync -> agree on success (over the rendezvous store) -> commit (root
metadata last, rename). ``save`` runs the same steps on the caller's thread, from the live
tensors.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np

from .base._errors import InconsistentShardsError, SaveError
from .base._futures import SaveFuture, swap_in_flight, wait_previous
from .base._metrics import SAVE_PHASES, InFlight, Metrics, Phases, report
from .base._version import __version__
from .base._workers import Workers
from . import _rankstate
from .format._dtypes import zarr_name
from .format._format import ArrayMeta, CheckpointMeta, group_document, root_document
from .layout import _flat, _plan
from .layout._flat import Flat
from .layout._layout import Layout
from .layout._spec import Mesh, P, check_spec
from .layout._tree import check_no_prefix_clash, flatten, name_to_path, nested, replace_leaf, retarget
from .storage import _shardfile, _store
from .storage._location import LocalDir, Location, locate
from .torch._dist import Comm, StoreComm, background_comm, check_mesh, comm_for, digest
from .torch._dtensor import default_mesh, is_dtensor, sharding_of
from .torch._staging import Staged, side_stream, stage_all
from .torch._tensors import tensor_zarr_dtype
from .torch._torch import is_tensor

DEFAULT_INNER_CHUNK_BYTES = 2 << 20


@attrs.frozen
class SaveResult:
    """What this rank did: the committed path, bytes and arrays it wrote, and the time it took.

    ``arrays_written`` counts the boxes this rank wrote (a box is one shard of an array, or one
    row block of a flat buffer's parameter), so an array split into several boxes counts once
    per box; ``metrics.arrays`` counts distinct arrays. ``seconds`` runs from the call to the commit; ``blocked_seconds`` is how long the call held
    the caller (for ``save_async``, checks, planning and staging; for ``save``, all of it).
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
class _Local:
    """One array leaf as this rank holds it (the live object: nothing is copied yet)."""

    name: str
    source: Any
    shape: tuple[int, ...]
    itemsize: int
    dtype: str
    kind: str
    # A DTensor leaf: its global shape, mesh and placements are known, so it needs no rule.
    dtensor: Any = None


def _local_arrays(leaves: Mapping[str, Any]) -> list[_Local]:
    out = []
    for name, leaf in leaves.items():
        if is_dtensor(leaf):
            local = leaf.to_local()
            dtype = tensor_zarr_dtype(local, name)
            out.append(_Local(name, local, tuple(local.shape), local.element_size(), dtype, "torch", leaf))
        elif is_tensor(leaf):
            dtype = tensor_zarr_dtype(leaf, name)
            out.append(_Local(name, leaf, tuple(leaf.shape), leaf.element_size(), dtype, "torch"))
        elif isinstance(leaf, np.ndarray):
            out.append(_Local(name, leaf, leaf.shape, leaf.itemsize, zarr_name(leaf.dtype, name), "numpy"))
        elif isinstance(leaf, np.generic):
            out.append(_Local(name, np.asarray(leaf), (), leaf.itemsize, zarr_name(leaf.dtype, name), "numpy_scalar"))
    return out


def _storage_key(leaf: Any) -> Any:
    """Equal for two leaves that are the same tensor (tied weights), None where that is unknowable."""
    extra: tuple[Any, ...] = ()
    if is_dtensor(leaf):
        extra = (id(leaf.device_mesh), tuple(leaf.placements), tuple(leaf.shape))
        leaf = leaf.to_local()
    if not is_tensor(leaf) or leaf.device.type == "meta" or leaf.numel() == 0:
        return None
    view = (leaf.storage_offset(), tuple(leaf.shape), tuple(leaf.stride()), leaf.dtype, str(leaf.device))
    return (leaf.untyped_storage().data_ptr(), *view, *extra)


def _tie(structure: Any, leaves: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Store a tensor that appears under several names (tied weights) once, under its first name.

    The other names become aliases in the tree, so a load gives one tensor back to all of them.
    """
    first: dict[Any, str] = {}
    aliases: dict[str, str] = {}
    for name, leaf in leaves.items():
        key = _storage_key(leaf)
        if key is None:
            continue
        if key in first:
            aliases[name] = first[key]
        else:
            first[key] = name
    if not aliases:
        return structure, leaves
    kept = {n: leaf for n, leaf in leaves.items() if n not in aliases}
    return retarget(structure, aliases), kept


def _agree(comm: Comm, error: BaseException | None, words: list[int]) -> tuple[list[int], list[int]]:
    """Exchange success and ``words`` in one collective; if any rank failed, all raise.

    The failing rank re-raises its own error; the others raise one that names it, so no rank is
    left waiting in a collective its peers have abandoned.
    """
    hi, lo = comm.all_max_min([1 if error else 0, *words])
    if hi[0]:
        messages = comm.all_gather_bytes(f"{type(error).__name__}: {error}".encode() if error else b"")
        if error is not None:
            raise error
        failed = [f"rank {r}: {m.decode()}" for r, m in enumerate(messages) if m]
        raise InconsistentShardsError("save refused on other ranks, nothing was written: " + "; ".join(failed))
    return hi[1:], lo[1:]


def save(
    path: str | os.PathLike[str],
    state: Any,
    layout: Layout | None = None,
    *,
    step: int | None = None,
    metadata: Mapping[str, Any] | None = None,
    rank_state: Any = None,
    overwrite: bool = False,
    group: Any = None,
    inner_chunk_bytes: int = DEFAULT_INNER_CHUNK_BYTES,
    compression: str | None = None,
    concurrency: int = 32,  # _store.DEFAULT_CONCURRENCY, spelled out for the docs; a test checks
    direct_io: bool = True,
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
    ``compression`` is ``None`` (default), ``"zstd"`` or ``"blosc"``; ``concurrency`` bounds the
    storage requests in flight (file operations, or S3/GCS requests). ``direct_io`` (default
    True) writes the large uncompressed shards of a local save past the page cache (``O_DIRECT``)
    where the file system allows it, and through it where not; ``False`` always goes through it.

    Returns this rank's ``SaveResult`` (path, bytes and arrays written, seconds, and
    ``.metrics`` with the time of each phase) after the checkpoint is committed on every rank.
    Bad input raises before anything is written, on every rank: ``LayoutError`` for a spec that
    does not fit an array, ``InconsistentShardsError`` when ranks disagree, ``InvalidNameError``
    for a name that cannot be stored. A failed write raises ``SaveError`` and commits nothing.
    The caller is blocked throughout, so the live tensors are written without a staging copy.
    """
    options = dict(step=step, metadata=metadata, rank_state=rank_state, overwrite=overwrite, group=group)
    storage = dict(
        inner_chunk_bytes=inner_chunk_bytes, compression=compression, concurrency=concurrency, direct_io=direct_io
    )
    return _start(path, state, layout, copy=False, lazy=False, budget=None, **options, **storage).result()


def save_async(
    path: str | os.PathLike[str],
    state: Any,
    layout: Layout | None = None,
    *,
    step: int | None = None,
    metadata: Mapping[str, Any] | None = None,
    rank_state: Any = None,
    overwrite: bool = False,
    group: Any = None,
    lazy: bool = False,
    host_memory_budget: int | None = None,
    inner_chunk_bytes: int = DEFAULT_INNER_CHUNK_BYTES,
    compression: str | None = None,
    concurrency: int = 32,  # _store.DEFAULT_CONCURRENCY, spelled out for the docs; a test checks
    direct_io: bool = True,
) -> SaveFuture:
    """Start saving; return once the state is staged (copied out of the live tensors).

    Takes the arguments of ``save``, and returns a ``SaveFuture``. Writing and the commit run on
    a background thread; ``fut.result()`` waits for the commit, returns the ``SaveResult`` (its
    ``.metrics`` has the plan, stage, write and commit phases) and raises any rank's failure.
    With ``lazy=True`` the call returns before the copy is done: call ``fut.wait_staged()``
    before mutating the state (e.g. before ``optimizer.step()``). Staging buffers are reused
    from save to save; ``host_memory_budget`` (bytes, default unlimited) caps them, and a larger
    state is staged in waves as writes free buffers. One save is in flight at a time: this call
    first waits for the previous one, and raises its failure (as ``SaveError``) if nobody has
    seen it. Bad input raises here, before anything is written, as for ``save``.
    """
    options = dict(step=step, metadata=metadata, rank_state=rank_state, overwrite=overwrite, group=group)
    storage = dict(
        inner_chunk_bytes=inner_chunk_bytes, compression=compression, concurrency=concurrency, direct_io=direct_io
    )
    return _start(path, state, layout, copy=True, lazy=lazy, budget=host_memory_budget, **options, **storage)


@attrs.frozen
class _Job:
    """Everything the background part of a save needs; planned before the call returns."""

    tmp: Location
    final: Location
    meta: CheckpointMeta
    metas: dict[str, ArrayMeta]
    mine: list[tuple[str, _plan.Box]]
    rank_doc: bytes | None
    overwrite: bool
    concurrency: int
    direct_io: bool
    started: float
    operation: str
    phases: Phases = attrs.field(factory=Phases)
    in_flight: InFlight = attrs.field(factory=InFlight)


def _start(
    path: str | os.PathLike[str],
    state: Any,
    layout: Layout | None,
    *,
    copy: bool,
    lazy: bool,
    budget: int | None,
    step: int | None,
    metadata: Mapping[str, Any] | None,
    rank_state: Any,
    overwrite: bool,
    group: Any,
    inner_chunk_bytes: int,
    compression: str | None,
    concurrency: int,
    direct_io: bool,
) -> SaveFuture:
    t0 = time.perf_counter()
    comm = comm_for(group)
    final = locate(path)
    # One save in flight: its buffers come back, and its failure is not lost.
    previous = wait_previous()

    # 1. Local checks. An error is held until every rank has reported, so no rank hangs.
    error: BaseException | None = None
    structure: Any = None
    arrays: list[_Local] = []
    shardings: list[tuple[Mesh, P]] = []
    flats: list[tuple[_Local, Flat]] = []
    rank_doc = None
    mesh = layout.mesh if layout is not None else Mesh({})
    try:
        if previous is not None:
            raise SaveError(f"the previous save_async failed, and this save was not started: {previous}") from previous
        structure, leaves = _tie(*flatten(state))
        if layout is None:
            mesh = default_mesh(leaves, comm.world, comm.global_ranks)
        check_mesh(mesh, comm)
        arrays = []
        for a in _local_arrays(leaves):
            if a.dtensor is not None:
                shardings.append(sharding_of(a.dtensor, a.name, comm.rank, comm.global_ranks, layout))
                arrays.append(a)
                continue
            spec = layout.spec_for(a.name) if layout is not None else P()
            if isinstance(spec, Flat):
                flats.append((a, _check_flat(a, spec, mesh, comm.rank)))
                continue
            check_spec(spec, mesh, len(a.shape), a.name, a.shape)
            shardings.append((mesh, spec))
            arrays.append(a)
        if flats:
            structure = _expand_flats(structure, flats)
            check_no_prefix_clash([a.name for a in arrays] + [n for f, spec in flats for n in _flat_names(f, spec)])
        _check_user_metadata(metadata)
        if rank_state is not None:
            rank_doc = _rankstate.document(rank_state, comm.rank, comm.world)
        # An object store's prefix is checked and claimed by rank 0 alone: it may clear the
        # leftovers of an unfinished save there, which other ranks must not see half done.
        if final.is_local or comm.rank == 0:
            final.check_destination(overwrite)
        if comm.rank == 0:
            final.prepare()
    except Exception as err:  # noqa: BLE001 - re-raised by _agree on every rank
        error = err
    # The mesh is part of each spec: ranks that order or size the mesh axes differently would
    # place their shards at different boxes.
    signature = [(a.name, a.dtype, len(a.shape), f"{s!r} on {m!r}") for a, (m, s) in zip(arrays, shardings)]
    signature += [(a.name, a.dtype, 1, f"{spec!r} on {mesh!r}") for a, spec in flats]
    agreed = (signature, structure, rank_doc is not None)
    what = _ToPlan(mesh, arrays, shardings, flats, inner_chunk_bytes, compression)
    key = None if error else what.key(comm)
    cached = _PLANS.get(key)
    checked = [*digest(agreed), sum(len(a.shape) for a in arrays)]
    # Two more words ride on this collective: the save that made each rank's cached plan (-1
    # for none), and rank 0's random token, which names the temporary directory.
    hi, lo = _agree(
        comm, error, [*checked, cached.token if cached else -1, _store.new_token() if comm.rank == 0 else 0]
    )
    if hi[: len(checked)] != lo[: len(checked)]:
        raise InconsistentShardsError(_describe_disagreement(comm, signature))
    token = hi[-1]
    if cached is None or hi[-2] != lo[-2]:
        # 2. Not every rank holds a plan made by one earlier save of this same state: plan.
        cached = _plan_globally(comm, what, token)
    # The tree lives as long as the save. The last save's, where equal, is already old to the
    # garbage collector; a new one (two containers per node) would be promoted with every save.
    if cached.tree == structure:
        structure = cached.tree
    else:
        cached = attrs.evolve(cached, tree=structure)
    _remember(key, cached)
    metas = dict(cached.metas)

    # 3. The token also keys the commit's store exchanges, so they never mix with another save's.
    tmp = final.staging(token)
    writer_comm = comm if not copy else background_comm(comm, f"save-{token:012x}")
    meta = CheckpointMeta(
        arrays=metas,
        tree=structure,
        mesh=mesh,
        rules=layout.spec_rules if layout is not None else (),
        step=step,
        user_metadata=dict(metadata or {}),
        library_version=__version__,
        rank_state_world=comm.world if rank_doc is not None else None,
        all_chunks_stored=True,
    )
    mine = [(arrays[i].name, box) for i, box in cached.regular]
    sources = [arrays[i].source for i, _ in cached.regular]
    # Boundary fragments travel now, on the caller's thread: the process group is free, and
    # each rank sends at most one row block's fragment per flat buffer.
    for name, box, data in _flat_writes(comm, flats, cached.flat_shards, mesh):
        mine.append((name, box))
        sources.append(data)
    job = _Job(
        tmp, final, meta, metas, mine, rank_doc, overwrite, concurrency, direct_io, t0, "save_async" if copy else "save"
    )
    job.phases.since("plan", t0)
    items = [Staged(source) for source in sources]
    fut = SaveFuture(final.url)

    # 4. Stage and write. A synchronous save writes straight from the live tensors.
    if not copy:
        for s in items:
            s.view()
        fut._set_staged()
        _write_and_commit(job, items, writer_comm, fut, None, None)
        return fut
    stream = side_stream(items)
    if stream is not None:
        fut._wait_staged_hook = stream.synchronize
    returned = threading.Event()  # the result reports how long this call blocked
    # Within the budget the writer starts once everything is staged: writing meanwhile would
    # only compete with the copy for the GIL and the cores. Over it, writes must free buffers.
    waves = budget is not None and sum(s.nbytes for s in items) > budget
    gate = None if waves else fut._staged
    swap_in_flight(fut)
    threading.Thread(
        target=_write_and_commit, args=(job, items, writer_comm, fut, returned, gate), name="layoutckpt-save"
    ).start()

    def stage() -> None:
        start = time.perf_counter()
        try:
            stage_all(items, budget, stream)
        except BaseException as err:
            fut._set_staged(err)
            raise
        job.phases.since("stage", start)
        fut._set_staged()

    try:
        if lazy:
            threading.Thread(target=_quietly(stage), name="layoutckpt-stage", daemon=True).start()
        else:
            try:
                stage()
                fut.wait_staged()
            except BaseException:
                fut._observed = True  # raised here; the next save must not raise it again
                raise
    finally:
        fut._blocked_seconds = time.perf_counter() - t0
        returned.set()
    return fut


@attrs.frozen
class _Planned:
    """What a save plans from every rank's shapes; the next save of the same state reuses it."""

    token: int  # the token of the save that planned it: the same on every rank
    metas: dict[str, ArrayMeta]
    regular: list[tuple[int, _plan.Box]]  # (index into the arrays, box) this rank writes
    flat_shards: list[list[tuple[int, ...]]]
    tree: Any = None  # the tree of the last save that used the plan


# The plans of the last few states this process saved, by everything they depend on that this
# rank knows alone. A training loop saves one state again and again: its global shapes, array
# documents and write assignment are planned once, and later saves run one collective, not four.
_PLANS: collections.OrderedDict[Any, _Planned] = collections.OrderedDict()
_PLANS_KEPT = 4


@attrs.frozen
class _ToPlan:
    """What a save plans from: this rank's arrays, how each is split, and the chunking."""

    mesh: Mesh
    arrays: list[_Local]
    shardings: list[tuple[Mesh, P]]
    flats: list[tuple[_Local, Flat]]
    inner_chunk_bytes: int
    compression: str | None

    def key(self, comm: Comm) -> Any:
        """Everything the plan depends on that this rank knows alone (hashable)."""
        local = tuple(
            (a.name, a.dtype, a.shape, a.itemsize, a.kind, m, spec, a.dtensor.shape if a.dtensor is not None else None)
            for a, (m, spec) in zip(self.arrays, self.shardings)
        )
        flat = tuple((a.name, a.dtype, a.shape, a.itemsize, a.kind, repr(spec)) for a, spec in self.flats)
        return (comm.rank, tuple(comm.global_ranks), self.mesh, local, flat, self.inner_chunk_bytes, self.compression)


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
    mesh, arrays, shardings, flats = what.mesh, what.arrays, what.shardings, what.flats
    inner_chunk_bytes, compression = what.inner_chunk_bytes, what.compression
    local_dims = [d for a in arrays for d in a.shape]
    sums = comm.all_reduce(local_dims, "sum")
    maxs, mins = comm.all_max_min(local_dims)
    metas: dict[str, ArrayMeta] = {}
    plan_arrays: list[_plan.ArraySpec] = []
    offset = 0
    for a, (m, spec) in zip(arrays, shardings):
        sl = slice(offset, offset + len(a.shape))
        offset += len(a.shape)
        if a.dtensor is not None:
            shape = tuple(a.dtensor.shape)
        else:
            shape = _plan.global_shape_from_sums(a.name, spec, m, sums[sl], mins[sl], maxs[sl])
        outer = _plan.shard_shape(shape, spec, m)
        metas[a.name] = ArrayMeta(
            path=name_to_path(a.name),
            shape=shape,
            dtype=a.dtype,
            shard_shape=outer,
            inner_chunk_shape=_plan.chunk_shape_for(outer, a.itemsize, inner_chunk_bytes),
            spec=spec,
            kind=a.kind,
            compression=compression,
            mesh=m if m != mesh else None,
        )
        plan_arrays.append(_plan.ArraySpec(a.name, shape, spec, a.itemsize, m if m != mesh else None))
    flat_shards: list[list[tuple[int, ...]]] = []
    for a, spec in flats:
        flat_shards.append([])
        for stored, (_, shape) in zip(_flat_names(a, spec), spec.params):
            outer = _flat.row_shard_shape(shape, a.itemsize, _flat.DEFAULT_SHARD_BYTES)
            flat_shards[-1].append(outer)
            metas[stored] = ArrayMeta(
                path=name_to_path(stored),
                shape=shape,
                dtype=a.dtype,
                shard_shape=outer,
                inner_chunk_shape=_plan.chunk_shape_for(outer, a.itemsize, inner_chunk_bytes),
                spec=P(),
                kind=a.kind,
                compression=compression,
            )
    error = None
    try:
        for a, pa in zip(arrays, plan_arrays):
            expected = _plan.box_shape(_plan.shard_box(pa.shape, pa.spec, pa.mesh or mesh, comm.rank))
            if a.shape != expected:
                raise InconsistentShardsError(
                    f"array {a.name!r}: rank {comm.rank} holds a shard of shape {a.shape}, but "
                    f"the global shape {pa.shape} recovered from all ranks, split by {pa.spec!r} on "
                    f"{pa.mesh or mesh!r} (as torch.chunk would), gives this rank {expected}; check that every "
                    "rank passes its own shard of the same tensor"
                )
    except InconsistentShardsError as err:
        error = err
    _agree(comm, error, [])
    return _Planned(token, metas, _plan.writes_of(plan_arrays, mesh, comm.rank), flat_shards)


def _flat_names(a: _Local, spec: Flat) -> list[str]:
    """The stored names of a flat buffer's parameters: under the buffer's own name."""
    return [f"{a.name}.{param}" for param, _ in spec.params]


def _check_flat(a: _Local, spec: Flat, mesh: Mesh, rank: int) -> Flat:
    spec.check(mesh, a.name)
    piece, _ = spec.piece_of(mesh, rank)
    start, stop = spec.piece_range(mesh, piece)
    if len(a.shape) != 1 or a.shape[0] != stop - start:
        raise InconsistentShardsError(
            f"flat array {a.name!r}: rank {rank} holds shape {a.shape}, but {spec!r} on {mesh!r} gives it "
            f"elements [{start}, {stop}) of the {spec.total} concatenated, a 1-D buffer of {stop - start}; "
            "pass each rank's own flat buffer, or declare its bounds"
        )
    return spec


def _expand_flats(structure: Any, flats: list[tuple[_Local, Flat]]) -> Any:
    """Each flat buffer's leaf becomes the tree of its parameters, stored as arrays of their own."""
    for a, spec in flats:
        structure = replace_leaf(structure, a.name, nested(a.name, [p for p, _ in spec.params]))
    return structure


def _flat_writes(
    comm: Comm, flats: list[tuple[_Local, Flat]], shards: list[list[tuple[int, ...]]], mesh: Mesh
) -> list[tuple[str, _plan.Box, Any]]:
    """(stored name, box, data) of the row blocks this rank writes for its flat buffers.

    Blocks inside this rank's range are views of its buffer; the others are assembled from it
    and from the fragments the neighbouring ranks send, all exchanged in one batch.
    """
    if not flats:
        return []
    import torch

    from .torch._tensors import from_numpy

    out: list[tuple[str, _plan.Box, Any]] = []
    sends: list[tuple[int, int, Any]] = []
    recvs: list[tuple[int, int, Any]] = []
    for tag, ((a, spec), shard_shapes) in enumerate(zip(flats, shards)):
        local = a.source if isinstance(a.source, torch.Tensor) else from_numpy(np.ascontiguousarray(a.source), a.dtype)
        local = local.detach()
        names = _flat_names(a, spec)
        writes, to_send = _flat.save_plan(spec, mesh, comm.rank, shard_shapes)
        for send in to_send:
            sends.append((send.to, tag, local[send.lo : send.hi].contiguous()))
        for w in writes:
            shape = _plan.box_shape(w.box)
            if len(w.parts) == 1 and w.parts[0].rank == comm.rank:
                part = w.parts[0]
                out.append((names[w.param], w.box, local[part.src : part.src + w.size].view(shape)))
                continue
            buf = torch.empty(w.size, dtype=local.dtype, device=local.device)
            for part in w.parts:
                if part.rank == comm.rank:
                    buf[part.lo : part.hi].copy_(local[part.src : part.src + part.hi - part.lo])
                else:
                    recvs.append((part.rank, tag, buf[part.lo : part.hi]))
            out.append((names[w.param], w.box, buf.view(shape)))
    comm.exchange(sends, recvs)
    return out


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
) -> None:
    """Write this rank's boxes (once ``gate`` opens, or as they are staged), agree on success,
    commit; settle ``fut``."""
    written = 0
    failure = b""
    try:
        if gate is not None:
            gate.wait()
        start = time.perf_counter()
        written = _write(job, items, comm.rank, comm.world)
        job.phases.since("write", start)
    except Exception as err:  # noqa: BLE001 - reported to every rank below
        failure = f"{type(err).__name__}: {err}".encode()
    try:
        start = time.perf_counter()
        _commit(comm, job.tmp, job.final, job.meta, failure, job.overwrite)
        job.phases.since("commit", start)
    except BaseException as err:  # noqa: BLE001 - the future raises it
        fut._finish(error=err)
        return
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
    fut._finish(SaveResult(job.final.url, written, len(job.mine), seconds, held, staged, report(metrics)))


def _write(job: _Job, items: list[Staged], rank: int, world: int) -> int:
    """Issue every write as soon as its shard is staged, write this rank's share of the Zarr
    documents meanwhile, then make it all durable; a written buffer goes back at once.

    On a local file system a box that is one whole shard is written by ``_shardfile`` on a few
    threads (half the CPU time of TensorStore's path; a large shard past the page cache, with
    ``job.direct_io``, and each other file's writeback started as it is closed); other boxes,
    and every box on an object store, go through TensorStore.
    """
    pending = []
    written = 0
    local = job.tmp if isinstance(job.tmp, LocalDir) else None
    writers = Workers("layoutckpt-write", _shardfile.THREADS) if local else None
    try:
        ctx = _store.context(job.concurrency)
        opened: dict[str, Any] = {}
        for (name, box), item in zip(job.mine, items):
            meta = job.metas[name]
            cell = _plan.shard_cell(box, meta.shape, meta.shard_shape) if local is not None else None
            if cell is not None:
                assert writers is not None and local is not None
                writers.submit(_write_shard_file, job, local, meta, cell, item)
                continue
            if name not in opened:
                opened[name] = _store.open_array(ctx, job.tmp, meta)
            store = opened[name].result()
            data = item.wait()
            target = store[tuple(slice(a, b) for a, b in box)] if box else store
            job.in_flight.start(data.nbytes)
            w = target.write(data, can_reference_source_data_indefinitely=True)

            def settled(_: Any, item: Staged = item, nbytes: int = data.nbytes) -> None:
                job.in_flight.done(nbytes)
                item.release()  # back-pressure: staging may be waiting for exactly this buffer

            w.commit.add_done_callback(settled)
            pending.append(w)
            written += data.nbytes
        _write_skeleton(job.tmp, job.meta, rank, world)
        if job.rank_doc is not None:
            job.tmp.write(_rankstate.file_name(rank), job.rank_doc)
        for w in pending:
            w.result()
        if writers is not None:
            written += writers.join()
        # Durable before this rank reports success: the marker may follow at once.
        job.tmp.make_durable()
    finally:
        for w in pending:
            try:
                w.result()
            except Exception:  # noqa: BLE001 - the first failure is already being raised
                pass
        for item in items:
            item.fail(SaveError("the save stopped before this shard was written"))
        if writers is not None:
            # Unstarted shards are dropped; a thread may still be writing from a staged buffer.
            writers.close()
        for item in items:
            item.release()
    return written


def _write_shard_file(job: _Job, root: LocalDir, meta: ArrayMeta, cell: tuple[int, ...], item: Staged) -> int:
    """Write one whole shard of ``meta`` from its staged box; returns the bytes of the box."""
    try:
        data = item.wait()
        job.in_flight.start(data.nbytes)
        _shardfile.write_shard(root.root, meta, cell, data.dtype, data, start_writeback=True, direct=job.direct_io)
        job.in_flight.done(data.nbytes)
        return data.nbytes
    finally:
        item.release()  # back-pressure: staging may be waiting for exactly this buffer


def _check_user_metadata(metadata: Mapping[str, Any] | None) -> None:
    """User metadata is stored as strict JSON in the commit marker: check it before writing."""
    import json

    if metadata is None:
        return
    if not isinstance(metadata, Mapping):
        raise TypeError(f"metadata= must be a dict of JSON values, got {type(metadata).__name__}")
    for key, value in metadata.items():
        try:
            json.dumps({key: value}, allow_nan=False)
        except (TypeError, ValueError) as err:
            raise TypeError(
                f"metadata[{key!r}] cannot be stored as JSON ({err}); use str/int/float/bool/None, "
                "lists and dicts of them, with finite floats"
            ) from None
        if not isinstance(key, str):
            raise TypeError(f"metadata key {key!r} must be a str")


def _write_skeleton(tmp: Location, meta: CheckpointMeta, rank: int, world: int) -> None:
    """This rank's share of the Zarr documents of every group and array, so plain ``zarr`` can
    walk the hierarchy. Shared round-robin: a model has hundreds of them, and one rank writing
    all would hold up the commit."""
    import json

    groups: set[str] = set()
    docs: list[tuple[str, bytes | None]] = []
    for a in meta.arrays.values():
        parts = a.path.split("/")
        groups.update("/".join(parts[:i]) for i in range(1, len(parts)))
        docs.append((a.path, None))
    if meta.rank_state_world is not None:
        groups.add(_rankstate.DIR)
    docs.extend((g, group_document()) for g in sorted(groups))
    arrays = {a.path: a for a in meta.arrays.values()}
    tmp.write_many(
        (f"{path}/zarr.json", doc or json.dumps(arrays[path].zarr_metadata()).encode())
        for path, doc in docs[rank::world]
    )


def _commit(
    comm: Comm | StoreComm, tmp: Location, final: Location, meta: CheckpointMeta, failure: bytes, overwrite: bool
) -> None:
    """Commit only if every rank wrote all it had to; otherwise remove the partial data."""
    (failed,) = comm.all_reduce([1 if failure else 0], "max")
    if failed:
        messages = comm.all_gather_bytes(failure)
        if comm.rank == 0:
            tmp.discard()
        comm.barrier()
        detail = "; ".join(f"rank {r}: {m.decode()}" for r, m in enumerate(messages) if m)
        raise SaveError(f"saving {final.url!r} failed, nothing was committed: {detail}")
    status = b""
    if comm.rank == 0:
        try:
            # Every rank made its part durable before it reported success (in ``_write``).
            final.commit(tmp, root_document(meta), overwrite=overwrite)
        except Exception as err:  # noqa: BLE001 - broadcast to every rank below
            tmp.discard()
            status = f"{type(err).__name__}: {err}".encode()
    status = comm.broadcast_bytes(status if comm.rank == 0 else None)
    if status:
        raise SaveError(f"committing {final.url!r} failed on rank 0: {status.decode()}")


def _describe_disagreement(comm: Comm, signature: list[Any]) -> str:
    mine = repr(signature).encode()
    everyone = comm.all_gather_bytes(mine)
    differing = [r for r, s in enumerate(everyone) if s != everyone[0]]
    if not differing:
        return (
            "ranks hold the same arrays but different JSON values, tree structure, or rank_state "
            "presence; non-tensor leaves must be equal on every rank (per-rank values go in "
            "rank_state=, which every rank passes or none)"
        )
    r = differing[0]
    first = dict((n, (d, k, s)) for n, d, k, s in eval_signature(everyone[0]))
    other = dict((n, (d, k, s)) for n, d, k, s in eval_signature(everyone[r]))
    only0 = sorted(set(first) - set(other))[:3]
    onlyr = sorted(set(other) - set(first))[:3]
    changed = [n for n in first if n in other and first[n] != other[n]][:3]
    parts = []
    if only0:
        parts.append(f"arrays only on rank 0: {only0}")
    if onlyr:
        parts.append(f"arrays only on rank {r}: {onlyr}")
    for n in changed:
        parts.append(f"array {n!r} is (dtype, ndim, spec) {first[n]} on rank 0 but {other[n]} on rank {r}")
    return (
        "ranks disagree about the state to save: "
        + "; ".join(parts)
        + "; every rank must pass the same names, dtypes and ranks, and the same layout"
    )


def eval_signature(raw: bytes) -> list[tuple[str, str, int, str]]:
    import ast

    return [tuple(x) for x in ast.literal_eval(raw.decode())]
