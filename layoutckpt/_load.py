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
from typing import Any

import numpy as np

from .base._errors import TemplateMismatchError
from .base._futures import LoadFuture
from .base._metrics import LOAD_PHASES, Metrics, Phases, report
from .engine import _fetch
from . import _rankstate
from .format._dtypes import numpy_dtype
from .format._format import ArrayMeta
from .layout import _flat, _plan
from .layout._flat import Flat
from .layout._layout import Layout
from .layout._spec import P, check_spec
from .layout._tree import collapse, decode_value, flatten, is_array_leaf, leaf_nodes, unflatten
from .storage import _store
from .storage._location import LocalDir, locate
from .torch._dist import check_mesh, comm_for
from .torch._dtensor import default_mesh, from_local, is_dtensor, local_device, sharding_of

Select = str | re.Pattern[str] | Iterable[str] | Callable[[str], bool] | None


def _selector(select: Select, stored: list[str]) -> set[str] | None:
    if select is None:
        return None
    if isinstance(select, str | re.Pattern):
        regex = re.compile(select)
        return {n for n in stored if regex.search(n)}
    if callable(select):
        return {n for n in stored if select(n)}
    wanted = set(select)
    unknown = sorted(wanted - set(stored))
    if unknown:
        raise KeyError(f"select= names {unknown[:5]} that the checkpoint does not have")
    return wanted


def load(
    path: str | os.PathLike[str],
    layout: Layout | None = None,
    *,
    like: Any = None,
    select: Select = None,
    strict: bool = True,
    inplace: bool = False,
    group: Any = None,
    concurrency: int = 32,  # _store.DEFAULT_CONCURRENCY, spelled out for the docs; a test checks
) -> Any:
    """Load this rank's shards of every (selected) array under ``layout``, in the saved tree.

    ``path`` is a committed checkpoint, in any form ``save`` takes (a local directory,
    ``file://``, ``s3://bucket/prefix``, ``gs://``, ``memory://``, or a TensorStore kvstore
    dict). ``layout`` may differ from the one the checkpoint was saved with (any mesh, any
    specs); it defaults to every array whole on every rank. Arrays come back as CPU
    ``torch.Tensor``s (NumPy arrays where they were saved from NumPy, or without torch), and
    JSON values as Python values.

    With ``like=`` the result takes the template's tree, and each template leaf must match the
    shape and dtype this rank would load (else ``TemplateMismatchError``); a loaded tensor goes
    to its template leaf's device. With ``strict`` (default) stored arrays the template lacks
    are an error, not a silent drop. A ``DTensor`` in the template is loaded as a DTensor with
    its mesh and placements (no rule needed; its tensors may be on ``meta``). With
    ``inplace=True`` the data is copied into the template's tensors, which are returned.
    ``select`` loads only some leaves, the rest left out of the result: a regex
    (``re.search``-ed in each global name), a callable ``name -> bool``, or an iterable of
    names (a name the checkpoint lacks raises ``KeyError``). ``group`` is the
    ``torch.distributed`` process group whose ranks load together (default: the default group,
    or a world of one). ``concurrency`` bounds the storage requests in flight.

    A missing checkpoint raises ``CheckpointNotFoundError``, a layout that does not fit an
    array ``LayoutError`` (both before any byte is read), and a damaged chunk
    ``IntegrityError`` naming its array.
    """
    options = dict(like=like, select=select, strict=strict, inplace=inplace, group=group, concurrency=concurrency)
    return load_async(path, layout, **options).result()


def load_async(
    path: str | os.PathLike[str],
    layout: Layout | None = None,
    *,
    like: Any = None,
    select: Select = None,
    strict: bool = True,
    inplace: bool = False,
    group: Any = None,
    concurrency: int = 32,  # _store.DEFAULT_CONCURRENCY, spelled out for the docs; a test checks
) -> LoadFuture[Any]:
    """Plan the load and put every read in flight; ``result()`` waits and builds the state.

    Takes the arguments of ``load`` and returns a ``LoadFuture``; ``fut.result()`` returns what
    ``load`` would, after which ``fut.metrics`` holds this rank's phases (plan, read, place),
    bytes and requests. Bad input (a template or layout that does not fit) raises here, before
    any byte is read.
    """
    from .torch._tensors import from_numpy, torch_dtype
    from .torch._torch import installed, is_tensor, torch

    t0 = time.perf_counter()
    phases = Phases()
    root = locate(path)
    meta = _store.read_meta(root)
    comm = comm_for(group)
    stored_leaves = dict(leaf_nodes(meta.tree))
    if inplace and like is None:
        raise TemplateMismatchError("inplace=True copies into the tensors of like=; pass the state to fill as like=")

    user_layout = layout

    def flat_spec(name: str) -> Flat | None:
        rule = user_layout.rule_for(name) if user_layout is not None else None
        return rule[1] if rule is not None and isinstance(rule[1], Flat) else None

    template: dict[str, Any] = {}
    if like is not None:
        structure, template = flatten(like)
        flat_names = {n for n in template if flat_spec(n) is not None}
        missing = sorted(n for n in template if n not in stored_leaves and n not in flat_names)
        if missing:
            raise TemplateMismatchError(
                f"the template asks for {missing[:5]}, which checkpoint {root.url!r} does not "
                "hold; remove them from the template or load them from another checkpoint"
            )
        covered = {_stored_name(n, stored_leaves) for n in template}
        covered |= {f"{n}.{p}" for n in flat_names for p, _ in flat_spec(n).params}  # type: ignore[union-attr]
        extra = sorted(n for n in meta.arrays if n not in covered)
        if strict and extra and select is None:
            raise TemplateMismatchError(
                f"checkpoint {root.url!r} holds arrays the template lacks, e.g. {extra[:5]}; "
                "pass strict=False to ignore them"
            )
    else:
        # A stored group that a flat rule names is loaded as that flat buffer.
        structure = collapse(meta.tree, lambda n: flat_spec(n) is not None)
    if layout is None:
        # Every array whole on every rank of the group (one process: the whole checkpoint), but
        # DTensors of the template where their placements say.
        layout = Layout.replicated(default_mesh(template, comm.world, comm.global_ranks))
    check_mesh(layout.mesh, comm)
    wanted = template if like is not None else dict(leaf_nodes(structure))
    keep = _selector(select, list(wanted))
    names = [n for n in wanted if keep is None or n in keep]

    # Plan every read first (pure), so bad input raises before any byte is read. Names tied at
    # save time share one stored array, read once per distinct box.
    targets: dict[str, tuple[str, _plan.Box]] = {}
    flats: dict[str, tuple[int, str, list[tuple[tuple[str, _plan.Box], int, int, int]]]] = {}
    for name in names:
        target = template.get(name)
        spec = flat_spec(name)
        if spec is not None:
            flats[name] = _plan_flat(name, spec, layout.mesh, comm.rank, meta.arrays, target)
            continue
        stored = _stored_name(name, stored_leaves)
        if stored is None:
            continue
        a = meta.arrays[stored]
        if is_dtensor(target):
            _check_global(name, target, a)
            mesh, spec = sharding_of(target, name, comm.rank, comm.global_ranks, user_layout)
        else:
            mesh, spec = layout.mesh, layout.spec_for(name) if user_layout is not None else P()
            check_spec(spec, mesh, len(a.shape), name, a.shape)
        box = _plan.shard_box(a.shape, spec, mesh, comm.rank)
        if target is not None:
            local = target.to_local() if is_dtensor(target) else target
            _check_template(name, local, a, _plan.box_shape(box), spec)
        targets[name] = (stored, box)

    ctx = _store.context(concurrency)
    complete = meta.all_chunks_stored
    where = root.url
    boxes = list(targets.values()) + [key for _, _, parts in flats.values() for key, *_ in parts]
    # A local checkpoint's shard files are read by _shardfile, other stores by TensorStore.
    local = root.root if isinstance(root, LocalDir) else None
    opened = {}
    if local is None:
        opened = {s: _store.open_array(ctx, root, meta.arrays[s], all_chunks_stored=complete) for s, _ in boxes}
    requests = []
    for key in dict.fromkeys(boxes):
        stored, box = key
        a = meta.arrays[stored]
        if _plan.box_size(box) > 0:
            rows = a.inner_chunk_shape[0] if a.inner_chunk_shape else 1
            dtype = numpy_dtype(a.dtype)
            if local is not None:
                read = functools.partial(_store.read_box, local, a, stored, where, complete)
                requests.append(_fetch.Request(key, None, box, dtype, rows, stored, read))
            else:
                requests.append(_fetch.Request(key, opened[stored].result(), box, dtype, rows, stored))
    fetcher = _fetch.Fetcher(requests, lambda future, name: _store.read_result(future, name, where))
    phases.since("plan", t0)
    reads = {r.key for r in requests}
    built: dict[tuple[str, _plan.Box], Any] = {}

    def shard(name: str) -> Any:
        stored, box = key = targets[name]
        a = meta.arrays[stored]
        if key in reads:
            data = fetcher.result(key)
        else:
            data = np.zeros(_plan.box_shape(box), dtype=numpy_dtype(a.dtype))
        kind = a.kind
        target = template.get(name)
        if target is not None:
            kind = "torch" if is_tensor(target) else "numpy"
        if kind == "numpy_scalar":
            return data[()]
        if kind == "numpy" or not installed():  # without torch installed, every array is NumPy
            return data
        if data.size == 0:
            # NumPy gives empty arrays zero strides, which torch's .view(dtype) refuses.
            return torch.zeros(data.shape, dtype=torch_dtype(a.dtype))
        t = from_numpy(data, a.dtype)
        assert t.dtype == torch_dtype(a.dtype)
        return t

    def flat_buffer(name: str) -> Any:
        length, dtype, parts = flats[name]
        buf = np.zeros(length, dtype=numpy_dtype(dtype))
        for key, lo, hi, dst in parts:
            rows = fetcher.result(key).reshape(-1)
            buf[dst : dst + hi - lo] = rows[lo:hi]
        if isinstance(template.get(name), np.ndarray) or not installed():
            return buf
        # NumPy gives empty arrays zero strides, which torch's .view(dtype) refuses.
        return from_numpy(buf, dtype) if buf.size else torch.zeros(0, dtype=torch_dtype(dtype))

    def leaf(name: str, node: Any) -> Any:
        target = template.get(name)
        if name in flats:
            data = flat_buffer(name)
            if target is None:
                return data
            if inplace:
                return _fill(target, data)
            return data.to(local_device(target)) if is_tensor(data) else data
        if name not in targets:
            return decode_value(stored_leaves[name]) if name in stored_leaves else node
        if inplace and target is not None:
            return _fill(target, shard(name))
        key = targets[name]
        if key not in built:
            # One object per stored array and box: names tied at save time stay tied.
            t = shard(name)
            if target is not None and is_tensor(t):
                t = t.to(local_device(target))
                if is_dtensor(target):
                    t = from_local(t, target, meta.arrays[key[0]].shape)
            built[key] = t
        return built[key]

    def finish() -> Any:
        fetcher.join()
        phases.add("read", fetcher.seconds)
        start = time.perf_counter()
        out = unflatten(structure, leaf, keep)
        phases.since("place", start)
        flight = fetcher.in_flight
        arrays = len({stored for stored, _ in reads})
        fut.metrics = report(
            Metrics(
                "load",
                root.url,
                comm.rank,
                comm.world,
                phases.items(LOAD_PHASES),
                fetcher.bytes,
                arrays,
                flight.issued,
                flight.most,
                flight.most_bytes,
                time.perf_counter() - t0,
            )
        )
        return out

    fut: LoadFuture[Any] = LoadFuture(finish, fetcher)
    return fut


def _fill(target: Any, data: Any) -> Any:
    """Copy ``data`` into the template leaf ``target`` (its local shard for a DTensor); return it."""
    local = target.to_local() if is_dtensor(target) else target
    if isinstance(local, np.ndarray):
        local[...] = data
    else:
        local.copy_(data)
    return target


def _plan_flat(
    name: str, spec: Flat, mesh: Any, rank: int, arrays: Mapping[str, ArrayMeta], target: Any
) -> tuple[int, str, list[tuple[tuple[str, _plan.Box], int, int, int]]]:
    """(buffer length, dtype, reads) of a flat target: whole rows of each parameter it overlaps."""
    spec.check(mesh, name)
    length, reads = _flat.load_plan(spec, mesh, rank)
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
    parts = [((f"{name}.{spec.params[r.param][0]}", r.box), r.lo, r.hi, r.dst) for r in reads]
    return length, dtype, parts


def _stored_name(name: str, stored_leaves: dict[str, Any]) -> str | None:
    """The stored array a tree name reads (itself, or the array it is tied to); None for values."""
    node = stored_leaves.get(name)
    return node.get("array") if isinstance(node, dict) else None


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
    from .torch._tensors import zarr_name_of
    from .torch._torch import is_tensor

    if is_tensor(target):
        dtype = zarr_name_of(target.dtype)
    else:
        from .format._dtypes import NUMPY_TO_ZARR

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
    if meta.rank_state_world is None:
        raise KeyError(f"checkpoint {root.url!r} holds no per-rank state; it was saved without rank_state=")
    saved = meta.rank_state_world
    if saved == comm.world and redistribute is None:
        return _rankstate.read_one(root, comm.rank)
    states = _rankstate.read_all(root, saved)
    return _rankstate.choose(states, comm.rank, comm.world, redistribute, root.url)
