"""``load``: every rank reads exactly the boxes its layout gives it, from any saved layout.

open metadata -> target boxes (pure, from the layout or a template) -> read all boxes with many
TensorStore reads in flight (each touches only the inner chunks it overlaps) -> wrap as tensors
without copying -> rebuild the tree.
"""

from __future__ import annotations

import functools
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Unpack

import attrs
import numpy as np

from . import _rankstate, _shared_reads
from ._pieces import padded_shard_shape, uses_views
from .base._arguments import check_load_arguments
from .base._errors import IntegrityError, TemplateMismatchError
from .base._futures import LoadFuture
from .base._gc import collector_paused
from .base._metrics import LOAD_PHASES, Metrics, Phases, report
from .base._options import LoadKeywords, LoadOptions, options_of
from .engine._read import BackgroundReads, BoxRead
from .format._dtypes import NUMPY_TO_ZARR, numpy_dtype
from .format._format import ArrayMeta, CheckpointMeta
from .layout import _flat, _plan
from .layout._flat import Flat
from .layout._layout import Layout
from .layout._names import to_global
from .layout._spec import P, check_spec
from .layout._tree import any_leaf, collapse, decode_value, flatten, is_array_leaf, leaf_nodes, unflatten
from .layout._views import Cut, Fused, Padded, part_name
from .storage import _store
from .storage._location import Location, locate
from .storage._packs import arrays_of
from .storage._readers import BoxReader, Lease
from .torch._dist import Comm, check_mesh, comm_for, failing_together, told
from .torch._dtensor import default_mesh, from_local, is_dtensor, local_device, sharding_of
from .torch._pinned import HostArena
from .torch._tensors import from_numpy, to_numpy, torch_dtype, zarr_name_of
from .torch._torch import installed, is_tensor, torch

Select = str | re.Pattern[str] | Iterable[str] | Callable[[str], bool] | None


def _selector(select: Select, stored: list[str], checkpoint: Iterable[str] = ()) -> set[str] | None:
    """The names of ``stored`` (what this load gives) that ``select`` picks; ``checkpoint``: the
    names the checkpoint holds, for the error on a name it holds that this load gives otherwise."""
    if select is None:
        return None
    if isinstance(select, str | re.Pattern):
        try:
            regex = re.compile(select)
        except re.error as err:
            raise ValueError(f"select={select!r} is not a valid regular expression: {err}") from None
        return {n for n in stored if regex.search(n)}
    if callable(select):
        return {n for n in stored if select(n)}
    if not isinstance(select, Iterable) or isinstance(select, bytes):
        raise TypeError(
            f"select= takes a regex, a collection of names or a predicate, got {type(select).__name__} {select!r}"
        )
    wanted = set(select)
    unknown = sorted(wanted - set(stored))
    held = sorted(set(unknown) & set(checkpoint))
    if held:
        raise KeyError(
            f"select= names {held[:5]}, which the checkpoint holds but this load does not give (it gives "
            f"the names of like=, and a flat buffer under a Flat rule as one): select among {sorted(stored)[:8]}"
        )
    if unknown:
        raise KeyError(f"select= names {unknown[:5]} that the checkpoint does not have")
    return wanted


def load(path: str | os.PathLike[str], layout: Layout | None = None, **options: Unpack[LoadKeywords]) -> Any:
    """Load this rank's shards of every (selected) array under ``layout``, in the saved tree.

    ``path`` is a committed checkpoint, in any form ``save`` takes (a local directory,
    ``file://``, ``s3://bucket/prefix``, ``gs://``, ``memory://``, or a TensorStore kvstore
    dict). ``layout`` may differ from the one the checkpoint was saved with (any mesh, any
    specs); it defaults to every array whole on every rank. Arrays come back as CPU
    ``torch.Tensor``s (NumPy arrays where they were saved from NumPy, or without torch), and
    JSON values as Python values.

    With ``like=`` the result takes the template's tree, and each template leaf must match the
    shape and dtype this rank would load (else ``TemplateMismatchError``); a loaded tensor goes
    to its template leaf's device (onto a GPU from host memory page-locked for the copy). With
    ``strict`` (default) stored arrays the template lacks are an error, not a silent drop. A
    ``DTensor`` in the template is loaded as a DTensor with its mesh and placements (no rule
    needed; its tensors may be on ``meta``). With ``inplace=True`` the data goes into the
    template's tensors, which are returned: CPU tensors of the stored dtype are read into
    directly (a load that fails on damage has then overwritten part of them), others are copied
    into once read.
    ``select`` loads only some leaves, the rest left out of the result: a regex
    (``re.search``-ed in each global name), a callable ``name -> bool``, or an iterable of
    names (a name the checkpoint lacks raises ``KeyError``). ``group`` is the
    ``torch.distributed`` process group whose ranks load together (default: the default group,
    or a world of one). ``io`` (an ``lc.IOConfig``) tunes how bytes are read.

    With ``share_reads=True`` (every rank passes it) the ranks that load one box (the
    replicas of a data-parallel layout) share its read: each reads whole inner-chunk rows of
    it, up to 8 ranks per box, and sends them to the others over the process group, so storage
    serves each box once per 8 replicas rather than once per replica (an object store's
    requests and egress, a parallel file system's bandwidth); the parts of fused and padded
    leaves too, not the pieces of flat buffers. Loads whose ranks of one stage load different
    arrays read alone, as without it.

    A path or layout of the wrong kind (a template passed as ``layout``) raises ``TypeError``,
    a missing checkpoint ``CheckpointNotFoundError``, a layout that does not fit an array
    ``LayoutError`` (all before any byte is read), and a damaged chunk ``IntegrityError``
    naming its array. Where the ranks load different parts (a layout, DTensors in the template,
    ``share_reads``), any of the errors raised before reading fails the load on every rank:
    the others raise one of the same class, naming the rank and its message. A load of whole
    arrays into plain tensors takes part in no collective: one rank may make it alone.
    """
    check_load_arguments("load", path, layout, Layout)
    with collector_paused():
        return _start(path, layout, options_of(LoadOptions, options, "load", LoadKeywords), reads_agreed=True).result()


def load_async(
    path: str | os.PathLike[str], layout: Layout | None = None, **options: Unpack[LoadKeywords]
) -> LoadFuture[Any]:
    """Plan the load and put every read in flight; ``result()`` waits and builds the state.

    Takes the keywords of ``load`` and returns a ``LoadFuture``; ``fut.result()`` returns what
    ``load`` would, after which ``fut.metrics`` holds this rank's phases (plan, read, place),
    bytes and requests. Bad input (a template or layout that does not fit) raises here, before
    any byte is read; where the ranks load different parts, on every rank, as in ``load``.

    ``fut.result()`` takes part in no collective (ranks may call it at different points of
    their loop), except with ``share_reads``, where the ranks exchange what they read there: so
    a damaged chunk read by one rank raises there only, where ``load`` would fail every rank.
    """
    check_load_arguments("load_async", path, layout, Layout)
    return _start(path, layout, options_of(LoadOptions, options, "load_async", LoadKeywords), reads_agreed=False)


@collector_paused()
def _start(
    path: str | os.PathLike[str], layout: Layout | None, options: LoadOptions, *, reads_agreed: bool
) -> LoadFuture[Any]:
    """Plan every read first (pure), so bad input raises before any byte is read; then put the
    reads in flight on the read engine's thread. ``reads_agreed``: the ranks that plan together
    also agree on their reads' outcome (``load``, whose caller waits at the call anyway)."""
    t0 = time.perf_counter()
    phases = Phases()
    comm = comm_for(options.group)
    together = _together(comm, layout, options)
    root, meta, plan = _plan_on_every_rank(path, layout, options, comm, together)
    reader = arrays_of(root, meta).box_reader(root.url, meta.all_chunks_stored, options.io)
    bound = plan.device_bound()
    lent = plan.lent(meta, reader, bound)
    wanted = plan.requests(meta, lent, _sharing(plan, meta, layout, comm, lent), plan.arena(meta, bound, lent))
    reads = BackgroundReads(reader, wanted.reads, options.io)
    phases.since("plan", t0)
    agree = together and (reads_agreed or wanted.shared is not None)
    fut: LoadFuture[Any] = LoadFuture(
        lambda: _finish(plan, meta, reads, wanted, root, comm, agree, phases, t0, fut), reads
    )
    return fut


Target = tuple[str, _plan.Box]  # (stored array, box): one read, shared by names tied at save time
FlatReads = tuple[int, str, list[tuple[Target, int, int, int]]]  # (length, dtype, reads) of a flat buffer


@attrs.frozen
class Composite:
    """A template leaf made of several reads: a fused tensor's parts, or a padded tensor's
    logical rows with the padding filled."""

    shape: tuple[int, ...]
    dtype: str
    parts: tuple[tuple[Target, Cut], ...]
    fill: float = 0


@attrs.frozen
class _Requests:
    """A load's reads, the template leaves they fill in place (``filled``), the boxes its
    reader lends instead (``lent``: copied to the device straight from the reader's memory),
    and the host arena that boxes bound for a GPU are read into (``arena``)."""

    reads: list[BoxRead]
    filled: frozenset[str]
    lent: dict[Target, Lease]
    # Where the ranks agreed to share reads (``share_reads``), the boxes this rank shares.
    shared: dict[Target, _shared_reads.Shared] | None = None
    arena: HostArena | None = None

    def copied_async(self) -> set[Target]:
        """The boxes whose copies to a device run without blocking: from page-locked memory."""
        return set(self.lent) | (set(self.arena.offsets) if self.arena is not None else set())


@attrs.frozen
class _LoadPlan:
    """What this rank loads: the tree to build, the template's leaves, and every read."""

    structure: Any
    template: dict[str, Any]
    keep: set[str] | None
    targets: dict[str, Target]
    flats: dict[str, FlatReads]
    options: LoadOptions
    composites: dict[str, Composite] = attrs.field(factory=dict)
    # What places each box of ``targets`` and ``composites`` (which ranks hold the same box).
    holders: dict[Target, _shared_reads.Holding] = attrs.field(factory=dict)

    def requests(
        self,
        meta: CheckpointMeta,
        lent: dict[Target, Lease],
        sharing: dict[Target, _shared_reads.Sharing] | None,
        arena: HostArena | None = None,
    ) -> _Requests:
        """Every read, the template leaves that the reads fill in place (``destinations``), the
        boxes the reader lends instead of reading them (``lent``), the boxes whose reads this
        rank shares with others (``sharing``): of those it reads only its part, and the boxes
        read into ``arena`` (bound for a GPU)."""
        boxes = list(self.targets.values()) + [key for _, _, parts in self.flats.values() for key, *_ in parts]
        boxes += [key for c in self.composites.values() for key, _ in c.parts]
        direct = self.destinations(meta)
        outs = {key: view for key, (_, view) in direct.items()}
        if arena is not None:
            for key in arena.offsets:
                dtype = numpy_dtype(meta.arrays[key[0]].dtype)
                outs[key] = arena.view(key, _plan.box_shape(key[1]), dtype)
        shared = None
        if sharing is not None:
            shared = {
                key: _shared_reads.Shared(_shared_reads.destination(outs.get(key), meta.arrays[key[0]], key[1]), how)
                for key, how in sharing.items()
            }
        reads = []
        for stored, box in dict.fromkeys(boxes):
            key = (stored, box)
            if _plan.box_size(box) == 0 or key in lent:
                continue
            if shared is not None and key in shared:
                part = shared[key].sharing.mine
                if part is not None:
                    out = _shared_reads.rows(shared[key].out, box, part)
                    reads.append(BoxRead(stored, meta.arrays[stored], part, out=out, key=key))
                continue
            reads.append(BoxRead(stored, meta.arrays[stored], box, out=outs.get(key), key=key))
        return _Requests(reads, frozenset(name for name, _ in direct.values()), lent, shared, arena)

    def device_bound(self) -> dict[Target, set[str]]:
        """The boxes that go only to template leaves off the host (a GPU), with the kinds of
        those leaves' devices. A box also read for a leaf on the host, or for a flat buffer or
        a fused tensor, is not one."""
        host = {key for name, key in self.targets.items() if not _off_host(self.template.get(name))}
        host |= {key for _, _, parts in self.flats.values() for key, *_ in parts}
        host |= {key for c in self.composites.values() for key, _ in c.parts}
        out: dict[Target, set[str]] = {}
        for name, key in self.targets.items():
            if key not in host and _plan.box_size(key[1]) > 0:
                out.setdefault(key, set()).add(local_device(self.template[name]).type)
        return out

    def lent(self, meta: CheckpointMeta, reader: BoxReader, bound: dict[Target, set[str]]) -> dict[Target, Lease]:
        """The boxes bound for a device (``device_bound``) that the reader holds in host memory
        already (a memory tier): each is copied to its device straight from there, with no read
        into a buffer first (on a GPU, from the pinned buffer the save staged it in, at the
        link's speed)."""
        out = {}
        for key in bound:
            lease = reader.lend(key[0], meta.arrays[key[0]], key[1])
            if lease is not None:
                out[key] = lease
        return out

    def arena(self, meta: CheckpointMeta, bound: dict[Target, set[str]], lent: dict[Target, Lease]) -> HostArena | None:
        """The host arena that the boxes bound only for GPUs (``device_bound``), and not lent,
        are read into, to be page-locked for their copies; None where there are none."""
        sizes = {
            key: _plan.box_size(key[1]) * numpy_dtype(meta.arrays[key[0]].dtype).itemsize
            for key, kinds in bound.items()
            if kinds == {"cuda"} and key not in lent
        }
        return HostArena(sizes) if sizes else None

    def destinations(self, meta: CheckpointMeta) -> dict[Target, tuple[str, np.ndarray]]:
        """With ``inplace``, each box read straight into its template tensor's own memory (the
        first template leaf of a box, where that is a CPU array of the stored dtype), by the
        leaf's name: no buffer of its own, no copy after the read, no page faults on fresh
        memory (docs/design/inplace-direct-reads.md). Other leaves are copied in once read."""
        if not self.options.inplace:
            return {}
        out: dict[Target, tuple[str, np.ndarray]] = {}
        for name, key in self.targets.items():
            if key not in out and _plan.box_size(key[1]) > 0:
                view = _own_memory(self.template.get(name), meta.arrays[key[0]].dtype)
                if view is not None:
                    out[key] = (name, view)
        return out


def _plan_load(where: str, meta: CheckpointMeta, layout: Layout | None, options: LoadOptions, comm: Any) -> _LoadPlan:
    """The load's plan (pure but for the world's size and rank): bad input raises here."""
    if options.inplace and options.like is None:
        raise TemplateMismatchError("inplace=True copies into the tensors of like=; pass the state to fill as like=")
    flat_spec = functools.partial(_flat_spec, layout)
    global_names: dict[str, str] = {}
    if options.like is not None:
        structure, template = flatten(options.like)
        if uses_views(layout):
            assert layout is not None
            check_mesh(layout.mesh, comm)
            global_names = to_global(layout.names, template, layout.mesh.coords(comm.rank))
        _check_template_names(where, meta, options, template, global_names, layout)
    else:
        # A stored group that a flat rule names is loaded as that flat buffer.
        structure, template = collapse(meta.tree, lambda n: flat_spec(n) is not None), {}
    target_layout = layout
    if target_layout is None:
        # Every array whole on every rank of the group (one process: the whole checkpoint), but
        # DTensors of the template where their placements say.
        target_layout = Layout.replicated(default_mesh(template, comm.world, comm.global_ranks))
    check_mesh(target_layout.mesh, comm)
    wanted = template if options.like is not None else dict(leaf_nodes(structure))
    keep = _selector(options.select, list(wanted), [*meta.arrays, *(n for n, _ in leaf_nodes(meta.tree))])
    names = [n for n in wanted if keep is None or n in keep]
    if options.inplace:
        _check_fillable(template, names)
    targets, flats, composites, holders = _targets(names, template, meta, target_layout, layout, comm, global_names)
    return _LoadPlan(structure, template, keep, targets, flats, options, composites, holders)


def _together(comm: Comm, layout: Layout | None, options: LoadOptions) -> bool:
    """Whether the ranks agree on the load's outcome: where they load different parts, a
    failure may show on some ranks only (``split_by_rank``)."""
    return comm.world > 1 and split_by_rank(layout, options.like, options.share_reads)


def _plan_on_every_rank(
    path: str | os.PathLike[str], layout: Layout | None, options: LoadOptions, comm: Comm, together: bool
) -> tuple[Location, CheckpointMeta, _LoadPlan]:
    """The checkpoint at ``path``, its metadata and ``_plan_load``, and whether any of them failed
    on any rank: then every rank raises before it reads. Some failures show only on some ranks
    (a template whose shard fits on one rank and not on another, a path one rank cannot see),
    and a rank that loads while its peers raise goes on alone into the next collective, where
    it hangs."""
    comm = comm.during("while the ranks planned a load")
    with failing_together(comm, told("the load failed on other ranks, so no rank reads"), when=together):
        root = locate(path)
        meta = _store.read_meta(root)
        plan = _plan_load(root.url, meta, layout, options, comm)
    return root, meta, plan


def split_by_rank(layout: Layout | None, like: Any, share_reads: bool = False) -> bool:
    """Whether the ranks load different parts (a layout, DTensors in the template ``like``,
    shared reads), so that a failure may show on some ranks only, and every rank takes part. A
    load of whole arrays into plain tensors takes no part in any collective: one rank may make
    it alone (rank 0 reading for an evaluation), and every rank that does fails alike."""
    if layout is not None or share_reads:
        return True
    return like is not None and any_leaf(like, is_dtensor)


def _sharing(
    plan: _LoadPlan, meta: CheckpointMeta, layout: Layout | None, comm: Any, lent: dict[Target, Lease]
) -> dict[Target, _shared_reads.Sharing] | None:
    """This rank's part in the reads it shares (``share_reads``); None unless every rank agrees
    to share (``_shared_reads.agree``). Boxes also read for flat buffers are read whole: a
    flat buffer's pieces follow from the rank's place in it, not from a spec."""
    if not plan.options.share_reads or comm.world == 1:
        return None
    parts = {key for _, _, ps in plan.flats.values() for key, *_ in ps}
    holders = {key: how for key, how in plan.holders.items() if key not in parts and _plan.box_size(key[1]) > 0}
    stages = (layout.mesh, layout.stage_axes) if layout is not None and layout.stage_axes else None
    if not _shared_reads.agree(comm, stages, holders, set(lent)):
        return None
    return _shared_reads.plan({k: h for k, h in holders.items() if k not in lent}, meta.arrays, comm.rank, stages)


def _flat_spec(layout: Layout | None, name: str) -> Flat | None:
    rule = layout.rule_for(name) if layout is not None else None
    return rule[1] if rule is not None and isinstance(rule[1], Flat) else None


def _check_template_names(
    where: str,
    meta: CheckpointMeta,
    options: LoadOptions,
    template: dict[str, Any],
    global_names: dict[str, str],
    layout: Layout | None,
) -> None:
    """Every template leaf is in the checkpoint (under its global name, as its fused parts or
    flat parameters), and, with ``strict``, every stored array is in the template."""
    stored_leaves = meta.leaves
    covered: set[str | None] = set()
    missing = []
    for name in template:
        wanted = _stored_of(global_names.get(name, name), layout, stored_leaves)
        absent = [n for n in wanted if n not in stored_leaves]
        missing += [name] if absent else []
        covered |= {_stored_name(n, stored_leaves) for n in wanted}
    if missing:
        raise TemplateMismatchError(
            f"the template asks for {sorted(missing)[:5]}, which checkpoint {where!r} does not "
            "hold; remove them from the template or load them from another checkpoint"
        )
    extra = sorted(n for n in meta.arrays if n not in covered)
    # Under stage axes each rank holds its stage's arrays only: the others' are not missing.
    staged = layout is not None and bool(layout.stage_axes)
    if options.strict and extra and options.select is None and not staged:
        raise TemplateMismatchError(
            f"checkpoint {where!r} holds arrays the template lacks, e.g. {extra[:5]}; pass strict=False to ignore them"
        )


def _stored_of(name: str, layout: Layout | None, stored_leaves: dict[str, Any]) -> list[str]:
    """The stored leaves the template leaf ``name`` (global) is read from."""
    spec = _flat_spec(layout, name)
    if spec is not None:
        return [f"{name}.{p}" for p, _ in spec.params]
    rule = layout.rule_for(name) if layout is not None and name not in stored_leaves else None
    if rule is not None and isinstance(rule[1], Fused):
        return [part_name(name, p) for p, _ in rule[1].parts]
    return [name]


def _targets(
    names: list[str],
    template: dict[str, Any],
    meta: CheckpointMeta,
    layout: Layout,
    user_layout: Layout | None,
    comm: Any,
    global_names: dict[str, str],
) -> tuple[dict[str, Target], dict[str, FlatReads], dict[str, Composite], dict[Target, _shared_reads.Holding]]:
    """The box of every named array this rank loads, the reads of its flat buffers, and of its
    fused and padded leaves; and the mesh and spec each box comes from."""
    stored_leaves = meta.leaves
    targets: dict[str, Target] = {}
    flats: dict[str, FlatReads] = {}
    composites: dict[str, Composite] = {}
    holders: dict[Target, _shared_reads.Holding] = {}
    for name in names:
        target = template.get(name)
        gname = global_names.get(name, name)
        spec = _flat_spec(user_layout, gname)
        if spec is not None:
            flats[name] = _plan_flat(gname, spec, layout.mesh, comm.rank, meta.arrays, target)
            continue
        rule = layout.rule_for(gname) if user_layout is not None and target is not None else None
        view = rule[1] if rule is not None else None
        c = None
        if isinstance(view, Fused | Padded) and not is_dtensor(target):
            if isinstance(view, Fused) and gname in stored_leaves:
                # Saved without its Fused rule: one array, whose parts lie one after another;
                # None where each rank's rows are a plain piece of it (read as ``_stored_of`` says).
                c = _plan_fused_whole(gname, view, target, meta, layout.mesh, comm.rank)
            else:
                c = _plan_view(gname, view, target, meta, layout.mesh, comm.rank)
        if c is not None:
            assert isinstance(view, Fused | Padded)
            composites[name] = c
            decides = f"{view!r} {tuple(target.shape)}"  # the template's shape cuts the parts
            holders.update({key: (layout.mesh, view.spec, decides) for key, _ in c.parts})
            continue
        stored = _stored_name(gname, stored_leaves)
        if stored is None:
            if target is not None and is_array_leaf(target) and gname in stored_leaves:
                raise TemplateMismatchError(
                    f"leaf {name!r}: the template holds an array there, but the checkpoint stores a plain "
                    "value (saved as a Python number or string); put a plain value in the template"
                )
            continue
        a = meta.arrays[stored]
        if is_dtensor(target):
            _check_global(name, target, a)
            mesh, spec = sharding_of(target, gname, comm.rank, comm.global_ranks, user_layout)
        else:
            mesh, spec = layout.mesh, _stored_spec(user_layout, gname)
            check_spec(spec, mesh, len(a.shape), gname, a.shape)
        box = _plan.shard_box(a.shape, spec, mesh, comm.rank)
        if target is not None:
            local = target.to_local() if is_dtensor(target) else target
            _check_template(name, local, a, _plan.box_shape(box), spec)
        targets[name] = (stored, box)
        holders[(stored, box)] = (mesh, spec, "")
    return targets, flats, composites, holders


def _stored_spec(layout: Layout | None, name: str) -> P:
    """How a stored array is split when loaded without a template: a fused part (or a padded
    array) as its fused (padded) rule's inner ``P`` says, any other array as its rule does."""
    if layout is None:
        return P()
    part = layout.fused_part_spec(name)
    if part is not None:
        return part
    spec = layout.spec_for(name)
    return spec.spec if isinstance(spec, Fused | Padded) else spec  # type: ignore[return-value]


def _plan_fused_whole(
    name: str, view: Fused, target: Any, meta: CheckpointMeta, mesh: Any, rank: int
) -> Composite | None:
    """The reads that fill a fused template leaf from the one array it was saved as: this
    rank's rows of each part, at the part's offset in the stored array. None where those rows
    are one plain piece of it: grouped parts, or a spec that does not split the fused dimension."""
    a = meta.arrays[name]
    check_spec(view.spec, mesh, len(a.shape), name, a.shape)
    if view.groups is not None or _plan.shard_box(a.shape, view.spec, mesh, rank)[view.dim] == (0, a.shape[view.dim]):
        return None
    sizes = [size for _, size in view.parts]
    if view.dim >= len(a.shape) or sum(sizes) != a.shape[view.dim]:
        raise TemplateMismatchError(
            f"array {name!r} is stored whole, {a.shape}, but the parts of {view!r} add up to {sum(sizes)} "
            f"along dimension {view.dim}; give the rule the sizes it was saved with"
        )
    shape = tuple(target.shape)
    cuts = view.cuts(name, shape, mesh, mesh.coords(rank))
    parts, offset = [], 0
    for (_, cut), size in zip(cuts, sizes):
        part = (*a.shape[: view.dim], size, *a.shape[view.dim + 1 :])
        box = list(_plan.shard_box(part, view.spec, mesh, rank))
        start, stop = box[view.dim]
        box[view.dim] = (start + offset, stop + offset)
        parts.append(((name, tuple(box)), cut))
        offset += size
    _check_template(name, target, a, shape, view)
    return Composite(shape, a.dtype, tuple(parts))


def _plan_view(name: str, view: Fused | Padded, target: Any, meta: CheckpointMeta, mesh: Any, rank: int) -> Composite:
    """The reads that fill a fused or padded template leaf, each checked against the stored array."""
    if not is_array_leaf(target):
        raise TemplateMismatchError(f"array {name!r}: the template holds a {type(target).__name__}; put a tensor there")
    shape, coords = tuple(target.shape), mesh.coords(rank)
    if isinstance(view, Fused):
        cuts = view.cuts(name, shape, mesh, coords)
        fill: float = 0
    else:
        cut, _, rows = view.cut(name, shape, mesh, coords)
        cuts, fill = [(name, cut)], view.value
    parts, dtypes = [], set()
    for stored, cut in cuts:
        a = meta.arrays[stored]
        check_spec(view.spec, mesh, len(a.shape), stored, a.shape)
        shard = None if isinstance(view, Fused) else padded_shard_shape(a.shape, view.spec, mesh, cut.dim, rows)
        box = _plan.shard_box(a.shape, view.spec, mesh, rank, shard)
        piece = (*shape[: cut.dim], cut.groups * cut.width, *shape[cut.dim + 1 :])
        if _plan.box_shape(box) != piece:
            raise TemplateMismatchError(
                f"array {name!r}: its part {stored!r} is {_plan.box_shape(box)} of the stored {a.shape} on this rank "
                f"under {view!r}, but the template's tensor {shape} leaves it {piece}; build the model with the "
                "saved configuration (the parts' sizes, the vocabulary)"
            )
        parts.append(((stored, box), cut))
        dtypes.add(a.dtype)
    _check_template(name, target, meta.arrays[cuts[0][0]], shape, view)
    if len(dtypes) > 1:
        raise TemplateMismatchError(f"array {name!r}: its parts are stored with different dtypes {sorted(dtypes)}")
    dtype = dtypes.pop()
    _check_fill(name, view, fill, numpy_dtype(dtype))
    return Composite(shape, dtype, tuple(parts), fill)


def _check_fill(name: str, view: Any, fill: float, dtype: np.dtype) -> None:
    """An integer or bool array's padding value must be one of its values, not rounded into one."""
    if dtype.kind not in "biu" or fill == 0:
        return
    with np.errstate(all="ignore"):
        exact = np.array(fill).astype(dtype).item() == fill
    if not exact:
        raise TemplateMismatchError(
            f"array {name!r}: the padding value {fill!r} of {view!r} is not a {dtype} value; give a value "
            "the array's dtype holds"
        )


@collector_paused()
def _finish(
    plan: _LoadPlan,
    meta: CheckpointMeta,
    reads: BackgroundReads,
    wanted: _Requests,
    root: Location,
    comm: Any,
    together: bool,
    phases: Phases,
    t0: float,
    fut: LoadFuture[Any],
) -> Any:
    """Wait for the reads, build the tree, and report the load's metrics on ``fut``."""
    try:
        _join(reads, root, meta.save_id, comm, together)
        if wanted.shared is not None:
            _shared_reads.exchange(comm, wanted.shared)
        phases.add("read", reads.seconds)
        start = time.perf_counter()
        if wanted.arena is not None:
            wanted.arena.pin()
        out = unflatten(plan.structure, _Builder(plan, meta, reads, wanted).leaf, plan.keep)
    finally:
        _settle(wanted, plan)  # also where the build failed: no copy may outlive the arena's lock
    for lease in wanted.lent.values():
        lease.check()
    phases.since("place", start)
    flight = reads.in_flight
    arrays = len(
        {stored for stored, _ in plan.targets.values()} | {k[0] for *_, p in plan.flats.values() for k, *_ in p}
    )
    fut.metrics = report(
        Metrics(
            "load",
            root.url,
            comm.rank,
            comm.world,
            phases.items(LOAD_PHASES),
            reads.bytes + sum(lease.data.nbytes for lease in wanted.lent.values()),
            arrays,
            flight.issued,
            flight.most,
            flight.most_bytes,
            time.perf_counter() - t0,
        )
    )
    return out


def _join(reads: BackgroundReads, root: Location, save_id: str, comm: Comm, together: bool) -> None:
    """Wait for this rank's reads and, ``together``, learn whether every rank's succeeded: a
    checksum that fails on one rank's chunks fails the load on every rank, which then stay in
    step (a rank that shares its boxes sends nothing when its reads failed)."""
    incomplete = told("the load's reads failed on other ranks, so this rank's result is incomplete")
    with failing_together(comm.during("while the ranks finished a load's reads"), incomplete, when=together):
        try:
            reads.join()
        except IntegrityError as err:
            explained = _store.explain_replaced(err, root, save_id)
            if explained is err:
                raise
            raise explained from err


class _Builder:
    """Turns the arrays read into the leaves of the result: tensors or NumPy arrays, on the
    template's devices, as DTensors where the template holds them, or copied into it."""

    def __init__(self, plan: _LoadPlan, meta: CheckpointMeta, reads: BackgroundReads, wanted: _Requests) -> None:
        self.plan, self.meta, self.reads = plan, meta, reads
        self.filled = wanted.filled  # template leaves the reads filled in place: nothing left to do
        self.lent = wanted.lent
        self.shared = wanted.shared
        self.copied_async = wanted.copied_async()
        self.stored_leaves = meta.leaves
        self.built: dict[Target, Any] = {}

    def leaf(self, name: str, node: Any) -> Any:
        plan, target = self.plan, self.plan.template.get(name)
        if name in plan.flats:
            data = self.flat_buffer(name)
            if target is None:
                return data
            if plan.options.inplace:
                return _fill(target, data)
            return data.to(local_device(target)) if is_tensor(data) else data
        if name in plan.composites:
            data = self.composite(name)
            if plan.options.inplace:
                return _fill(target, data)
            return data.to(local_device(target)) if is_tensor(data) else data
        if name not in plan.targets:
            return decode_value(self.stored_leaves[name]) if name in self.stored_leaves else node
        key = plan.targets[name]
        # A box in page-locked memory is copied without waiting; ``_settle`` waits for every such
        # copy at the end.
        unblocked = key in self.copied_async
        # A NumPy scalar is immutable: it comes back as a new one, as without ``inplace``.
        if plan.options.inplace and target is not None and not isinstance(target, np.generic):
            return target if name in self.filled else _fill(target, self.shard(name), non_blocking=unblocked)
        if key not in self.built:
            # One object per stored array and box: names tied at save time stay tied.
            t = self.shard(name)
            if target is not None and is_tensor(t):
                t = t.to(local_device(target), non_blocking=unblocked)
                if is_dtensor(target):
                    t = from_local(t, target, self.meta.arrays[key[0]].shape)
            self.built[key] = t
        return self.built[key]

    def box(self, key: Target) -> np.ndarray:
        """The data of one box: lent, assembled from shared parts, read, or empty."""
        if key in self.lent:
            return self.lent[key].data
        if self.shared is not None and key in self.shared:
            return self.shared[key].out
        if _plan.box_size(key[1]) > 0:
            return self.reads.result(key)
        return np.zeros(_plan.box_shape(key[1]), numpy_dtype(self.meta.arrays[key[0]].dtype))

    def shard(self, name: str) -> Any:
        key = self.plan.targets[name]
        a = self.meta.arrays[key[0]]
        data = self.box(key)
        kind = a.kind
        target = self.plan.template.get(name)
        if target is not None:
            kind = "torch" if is_tensor(target) else "numpy_scalar" if isinstance(target, np.generic) else "numpy"
        if kind == "numpy_scalar":
            return data[()]
        if kind == "numpy" or not installed():  # without torch installed, every array is NumPy
            return data
        return _as_tensor(data, a.dtype)

    def composite(self, name: str) -> Any:
        c = self.plan.composites[name]
        out = np.full(c.shape, c.fill, dtype=numpy_dtype(c.dtype))
        for key, cut in c.parts:
            if _plan.box_size(key[1]) > 0:
                cut.place(out, self.box(key))
        if isinstance(self.plan.template.get(name), np.ndarray) or not installed():
            return out
        return _as_tensor(out, c.dtype)

    def flat_buffer(self, name: str) -> Any:
        length, dtype, parts = self.plan.flats[name]
        buf = np.zeros(length, dtype=numpy_dtype(dtype))
        for key, lo, hi, dst in parts:
            rows = self.reads.result(key).reshape(-1)
            buf[dst : dst + hi - lo] = rows[lo:hi]
        if isinstance(self.plan.template.get(name), np.ndarray) or not installed():
            return buf
        return _as_tensor(buf, dtype)


def _as_tensor(data: np.ndarray, dtype: str) -> Any:
    """``data`` as a tensor of the stored ``dtype``, sharing its memory."""
    if data.size == 0:
        # NumPy gives empty arrays zero strides, which torch's .view(dtype) refuses.
        return torch.zeros(data.shape, dtype=torch_dtype(dtype))
    return from_numpy(data, dtype)


def _fill(target: Any, data: Any, *, non_blocking: bool = False) -> Any:
    """Copy ``data`` into the template leaf ``target`` (its local shard for a DTensor); return it.
    Data read straight into the leaf's own memory (``_LoadPlan.destinations``) is not copied."""
    local = target.to_local() if is_dtensor(target) else target
    if _same_memory(local, data):
        return target
    if isinstance(local, np.ndarray):
        local[...] = data
    else:
        # ``detach``: a parameter that requires grad takes no in-place copy otherwise.
        local.detach().copy_(data, non_blocking=non_blocking)
    return target


def _off_host(target: Any) -> bool:
    """Whether the template leaf ``target`` is a tensor whose data goes to a device (a GPU)."""
    return target is not None and is_tensor(target) and local_device(target).type != "cpu"


def _settle(wanted: _Requests, plan: _LoadPlan) -> None:
    """Wait for the copies that run without blocking, then unlock the arena they copied from.
    The caller then checks that the memory lent boxes were copied from stayed theirs throughout
    (``Lease.check``)."""
    keys = wanted.copied_async()
    if keys:
        for device in {local_device(t) for n, t in plan.template.items() if plan.targets.get(n) in keys}:
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
    if wanted.arena is not None:
        wanted.arena.unpin()


def _own_memory(target: Any, dtype: str) -> np.ndarray | None:
    """A NumPy view of the template leaf ``target``'s own memory (its local shard for a DTensor)
    that a read may fill directly, or None: a tensor off the CPU, of another dtype, not
    contiguous, or read-only."""
    if target is None:
        return None
    local = target.to_local() if is_dtensor(target) else target
    if isinstance(local, np.ndarray):
        ok = local.dtype == numpy_dtype(dtype) and local.flags.c_contiguous and local.flags.writeable
        return local if ok else None
    if not is_tensor(local) or not local.is_cpu or not local.is_contiguous() or local.is_sparse:
        return None
    if zarr_name_of(local.dtype) != dtype or local.is_conj() or local.is_neg():
        return None
    view = to_numpy(local)
    return view if view.flags.writeable else None


def _same_memory(local: Any, data: Any) -> bool:
    """Whether ``data`` is ``local``'s own memory (same address, shape and dtype size)."""
    mine, theirs = _host_memory(local), _host_memory(data)
    if mine is None or theirs is None:
        return False
    (address, size), (other, other_size) = mine, theirs
    return size > 0 and address == other and size == other_size and tuple(local.shape) == tuple(data.shape)


def _host_memory(x: Any) -> tuple[int, int] | None:
    """(address, bytes) of a NumPy array or a CPU tensor; None for anything else."""
    if isinstance(x, np.ndarray):
        return x.ctypes.data, x.nbytes
    if is_tensor(x) and x.is_cpu:
        return x.data_ptr(), x.numel() * x.element_size()
    return None


def _plan_flat(
    name: str, spec: Flat, mesh: Any, rank: int, arrays: Mapping[str, ArrayMeta], target: Any
) -> tuple[int, str, list[tuple[tuple[str, _plan.Box], int, int, int]]]:
    """(buffer length, dtype, reads) of a flat target: whole rows of each parameter it overlaps."""
    spec.check(mesh, name)
    pieces = spec.local(mesh, rank)
    length, reads = _flat.load_plan(pieces.flat, pieces.mesh, pieces.rank)
    dtypes = set()
    for param, shape in spec.params:
        stored = f"{name}.{param}"
        a = arrays.get(stored)
        if a is None or a.shape != shape:
            found = "no such array" if a is None else f"shape {a.shape}"
            raise TemplateMismatchError(
                f"flat array {name!r}: its layout declares parameter {param!r} of shape {shape}, stored as "
                f"{stored!r}, but the checkpoint has {found}; declare the parameters as they were saved"
            )
        dtypes.add(a.dtype)
    if len(dtypes) > 1:
        raise TemplateMismatchError(
            f"flat array {name!r}: its parameters are stored with different dtypes {sorted(dtypes)}; a flat "
            "buffer holds one dtype, so load them per parameter and cast"
        )
    dtype = dtypes.pop() if dtypes else "float32"
    if target is not None:
        local = target
        if tuple(local.shape) != (length,):
            raise TemplateMismatchError(
                f"flat array {name!r}: the template has shape {tuple(local.shape)} but {spec!r} on {mesh!r} gives "
                f"rank {rank} a buffer of {length} elements; fix the template or the layout"
            )
        _check_template(name, local, ArrayMeta(name, (length,), dtype, (length,), (length,), P()), (length,), spec)
    parts = [
        ((f"{name}.{spec.params[r.param][0]}", pieces.to_global(r.box, r.param)), r.lo, r.hi, r.dst) for r in reads
    ]
    return length, dtype, parts


def _stored_name(name: str, stored_leaves: dict[str, Any]) -> str | None:
    """The stored array a tree name reads (itself, or the array it is tied to); None for values."""
    node = stored_leaves.get(name)
    return node.get("array") if isinstance(node, dict) else None


def _check_fillable(template: dict[str, Any], names: list[str]) -> None:
    """``inplace=True`` copies into the template's tensors: a tensor on the meta device has no
    memory to take the bytes, and the load would return it empty."""
    for name in names:
        target = template.get(name)
        local = target.to_local() if is_dtensor(target) else target
        if is_tensor(local) and local.device.type == "meta":
            raise TemplateMismatchError(
                f"array {name!r}: inplace=True copies into the template's tensors, but this one is on the "
                "meta device and has no memory; load without inplace (a meta template then gives the "
                "loaded tensors), or materialize the template first (e.g. model.to_empty(device=...))"
            )


def _check_global(name: str, target: Any, a: ArrayMeta) -> None:
    if tuple(target.shape) != a.shape:
        raise TemplateMismatchError(
            f"array {name!r}: the template's DTensor has global shape {tuple(target.shape)} but the checkpoint "
            f"stores {a.shape}; build the model with the saved configuration"
        )


def _check_template(name: str, target: Any, a: ArrayMeta, local: tuple[int, ...], spec: Any) -> None:
    if not is_array_leaf(target):
        raise TemplateMismatchError(
            f"array {name!r}: the template holds a {type(target).__name__} there, but the checkpoint "
            "stores an array; put a tensor (a 'meta' tensor is fine) in the template"
        )
    if is_tensor(target):
        dtype = zarr_name_of(target.dtype)
    else:
        dtype = NUMPY_TO_ZARR.get(np.dtype(target.dtype))
    if tuple(target.shape) != local:
        raise TemplateMismatchError(
            f"array {name!r}: the template has shape {tuple(target.shape)} but this rank's shard of the "
            f"stored global shape {a.shape} under {spec!r} is {local}; fix the template or the layout"
        )
    if dtype != a.dtype:
        raise TemplateMismatchError(
            f"array {name!r}: the template has dtype {target.dtype} but the checkpoint stores {a.dtype}; "
            "use a template of the stored dtype and cast after loading"
        )


def load_rank_state(
    path: str | os.PathLike[str], *, group: Any = None, redistribute: _rankstate.Redistribute | None = None
) -> Any:
    """This rank's ``rank_state=`` document, as it was saved by the rank of the same index.

    When the world size changed, ``redistribute(states, rank, world)`` gets every saved document
    (index = saved rank) and returns this rank's; without it, a ``WorldSizeError`` says so.
    """
    root = locate(path)
    meta = _store.read_meta(root)
    comm = comm_for(group)
    saved = _rankstate.saved_world(meta, root.url)
    if saved == comm.world and redistribute is None:
        return _rankstate.read_one(root, comm.rank)
    states = _rankstate.read_all(root, saved)
    return _rankstate.choose(states, comm.rank, comm.world, redistribute, root.url)
