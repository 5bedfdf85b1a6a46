"""``layoutckpt.jax``: load a checkpoint as JAX arrays, under the shardings JAX asks for.

A checkpoint's files do not depend on the parallelism that wrote them (docs/format.md), so one
saved by PyTorch ranks under any layout loads in JAX under any sharding, without torch:

    >>> import layoutckpt.jax as lcj                                    # doctest: +SKIP
    >>> from jax.sharding import PartitionSpec as P                     # doctest: +SKIP
    >>> mesh = jax.make_mesh((4, 2), ("x", "y"))                        # doctest: +SKIP
    >>> params = lcj.load(path, [(r"embed", P("x", None)), (r".*", P())], mesh=mesh)  # doctest: +SKIP

Each array's sharding gives every addressable device its index
(``addressable_devices_indices_map``); each *distinct* box is read once, replicas sharing the
read, and a read fetches only the inner chunks the box overlaps. The boxes are then placed on
their devices and assembled with ``jax.make_array_from_single_device_arrays``. In a multi-process
JAX job each process reads only its own devices' boxes.

Host memory: the read engine reads the boxes in order with at most ``IOConfig.budget_bytes``
in flight, an array goes to its devices as soon as its last box is in, and its host buffers
are dropped once the copies are done, so the host holds the reads in flight and the array being
assembled, never the whole checkpoint.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from ._load import Select, _selector
from ._reader import ArrayInfo, Reader
from .base._errors import LayoutError, TemplateMismatchError
from .base._options import IOConfig
from .engine._read import BoxRead
from .format._dtypes import numpy_dtype
from .format._format import ArrayMeta
from .layout._plan import Box, box_shape, box_size, box_view, shard_pieces
from .layout._spec import P
from .layout._tree import decode_value, leaf_nodes, unflatten

__all__ = ["load", "load_array"]

# A sharding, or a partition spec (JAX's or layoutckpt's) that means NamedSharding(mesh, spec).
ShardingLike = Sharding | PartitionSpec | P
Shardings = (
    ShardingLike
    | Mapping[str, ShardingLike]
    | Callable[[str, ArrayInfo], ShardingLike]
    | Sequence[tuple[str, ShardingLike]]
)


Key = tuple[str, Box]  # a box of a stored array


def load(
    path: str | os.PathLike[str],
    shardings: Shardings,
    *,
    mesh: Mesh | None = None,
    select: Select = None,
    io: IOConfig | None = None,
) -> Any:
    """Every (selected) array of the checkpoint at ``path`` as a ``jax.Array``, in the saved tree.

    ``path`` is a directory or any location ``layoutckpt.open`` takes (``s3://``, ``gs://``, ...).

    ``shardings`` says how each array is laid out on the devices. It is one of

    - a ``jax.sharding.Sharding`` for every array;
    - a mapping from global name (``"model.layers.0.wq"``) to sharding; every loaded array needs
      an entry, and names the checkpoint does not hold are an error;
    - a callable ``(name, ArrayInfo) -> sharding``, which sees the stored shape and dtype;
    - rules: a sequence of ``(regex, spec)`` pairs; the first pattern that ``re.search``-es the
      name decides, and an array no rule matches is an error (end with ``(r".*", P())`` to
      replicate the rest). ``layout.spec_rules`` of a layoutckpt ``Layout`` fits here.

    Wherever a sharding is expected, a ``PartitionSpec`` (or a layoutckpt ``P``) may stand for
    ``NamedSharding(mesh, spec)`` on the ``mesh=`` given. JAX needs every sharded dimension to
    divide evenly. Values stored in the tree (ints, strings, ...) come back as Python values;
    ``select=`` works as in ``layoutckpt.load``. With 64-bit types disabled in JAX (its
    default), 64-bit arrays load as 32-bit ones, as ``jnp.asarray`` would make them, and
    integers that do not fit raise instead of wrapping. ``io`` (an ``lc.IOConfig``) tunes how
    bytes are read.
    """
    _check_mesh(mesh)
    with Reader(path, io=io) as reader:
        tree = reader.meta.tree
        leaves = dict(leaf_nodes(tree))
        array_names = [n for n, node in leaves.items() if "array" in node]
        keep = _selector(select, list(leaves))
        sharding_for = _resolver(shardings, mesh, array_names, reader.path)
        plans = {}
        for name in array_names:
            if keep is None or name in keep:
                info = reader.info(name)
                plans[name] = _plan_array(info, reader.aliases.get(name, name), sharding_for(name, info))
        arrays = _materialize(reader, list(plans.values()))

    def leaf(name: str, node: Mapping[str, Any]) -> Any:
        return arrays[name] if "array" in node else decode_value(node)

    return unflatten(tree, leaf, keep)


def load_array(
    source: str | os.PathLike[str] | Reader,
    name: str,
    sharding: ShardingLike,
    *,
    mesh: Mesh | None = None,
    io: IOConfig | None = None,
) -> jax.Array:
    """One array of a checkpoint (a path, or a ``layoutckpt.open`` reader) as a ``jax.Array``."""
    _check_mesh(mesh)
    if isinstance(source, Reader):
        return _load_one(source, name, sharding, mesh)
    with Reader(source, io=io) as reader:
        return _load_one(reader, name, sharding, mesh)


def _load_one(reader: Reader, name: str, sharding: ShardingLike, mesh: Mesh | None) -> jax.Array:
    info = reader.info(name)
    plan = _plan_array(info, reader.aliases.get(name, name), _as_sharding(sharding, mesh, name))
    return _materialize(reader, [plan])[name]


# ----------------------------------------------------------------------------- choosing shardings


def _check_mesh(mesh: object) -> None:
    if mesh is not None and not isinstance(mesh, Mesh):
        raise LayoutError(
            f"mesh= must be a jax.sharding.Mesh (e.g. jax.make_mesh((4, 2), ('x', 'y'))), got {mesh!r}; "
            "a layoutckpt Mesh names axes but no devices"
        )


def _as_sharding(x: object, mesh: Mesh | None, name: str) -> Sharding:
    if isinstance(x, Sharding):
        return x
    if isinstance(x, P):
        x = PartitionSpec(*x.entries)
    if isinstance(x, PartitionSpec):
        if mesh is None:
            raise LayoutError(
                f"array {name!r}: {x!r} is a partition spec, but no mesh= was given to apply it on; "
                "pass mesh=jax.sharding.Mesh(...) or give a NamedSharding"
            )
        return NamedSharding(mesh, x)
    raise LayoutError(
        f"array {name!r}: expected a jax.sharding.Sharding or a PartitionSpec for it, got {type(x).__name__} {x!r}"
    )


def _resolver(
    shardings: Shardings, mesh: Mesh | None, array_names: list[str], where: str
) -> Callable[[str, ArrayInfo], Sharding]:
    """``(name, info) -> Sharding`` for any accepted form of ``shardings``; checked up front."""
    if isinstance(shardings, ShardingLike):
        return lambda name, info: _as_sharding(shardings, mesh, name)
    if isinstance(shardings, Mapping):
        unknown = sorted(set(shardings) - set(array_names))
        if unknown:
            raise LayoutError(
                f"shardings= names arrays {unknown[:5]} that checkpoint {where!r} does not hold; "
                "fix the names (layoutckpt.open(path).keys() lists the stored ones)"
            )

        def by_name(name: str, info: ArrayInfo) -> Sharding:
            if name not in shardings:
                raise LayoutError(
                    f"array {name!r} has no entry in the shardings= mapping; add one, or leave the array "
                    "out with select="
                )
            return _as_sharding(shardings[name], mesh, name)

        return by_name
    if callable(shardings):
        return lambda name, info: _as_sharding(shardings(name, info), mesh, name)
    if isinstance(shardings, Sequence) and not isinstance(shardings, str):
        rules = _parse_rules(shardings)

        def by_rule(name: str, info: ArrayInfo) -> Sharding:
            for regex, spec in rules:
                if regex.search(name):
                    return _as_sharding(spec, mesh, name)
            raise LayoutError(
                f"array {name!r}: no sharding rule matches it (patterns: {[r.pattern for r, _ in rules]}); "
                "add a rule for it, or a final catch-all rule such as (r'.*', P())"
            )

        return by_rule
    raise TypeError(
        "shardings= must be a Sharding, a PartitionSpec, a mapping name -> sharding, a callable "
        f"(name, info) -> sharding, or a list of (regex, spec) rules; got {type(shardings).__name__}"
    )


def _parse_rules(rules: Sequence[Any]) -> list[tuple[re.Pattern[str], ShardingLike]]:
    parsed = []
    for i, rule in enumerate(rules):
        if not (isinstance(rule, tuple | list) and len(rule) == 2 and isinstance(rule[0], str)):
            raise LayoutError(f"sharding rule #{i} must be a (regex, spec) pair, got {rule!r}")
        try:
            parsed.append((re.compile(rule[0]), rule[1]))
        except re.error as err:
            raise LayoutError(f"sharding rule #{i}: pattern {rule[0]!r} is not a valid regex: {err}") from None
    return parsed


# ----------------------------------------------------------------------------- planning


@attrs.frozen
class _ArrayPlan:
    """Which box of stored array ``stored`` each addressable device of ``sharding`` holds."""

    name: str
    stored: str
    shape: tuple[int, ...]
    dtype: np.dtype
    sharding: Sharding
    placements: tuple[tuple[Any, Box], ...]

    @property
    def boxes(self) -> list[Box]:
        """The distinct boxes, each read once however many devices hold it."""
        return list(dict.fromkeys(box for _, box in self.placements))


def _plan_array(info: ArrayInfo, stored: str, sharding: Sharding) -> _ArrayPlan:
    """The plan for ``info``'s array under ``sharding``; a ``LayoutError`` if it does not fit."""
    shape = info.shape
    problem = None
    if isinstance(sharding, NamedSharding) and len(sharding.spec) > len(shape):
        problem = f"its spec has {len(sharding.spec)} entries for {len(shape)} dimension(s)"
    else:
        try:
            indices = sharding.addressable_devices_indices_map(shape)
        except (ValueError, IndexError) as err:
            problem = str(err)
    if problem is not None:
        raise LayoutError(
            f"array {info.name!r} of shape {shape} cannot take {sharding!r}: {problem}; JAX needs one "
            "spec entry at most per dimension and each sharded dimension divisible by its mesh axes, "
            "so pick a spec that divides it (or replicate it with P())"
        )
    placements = tuple((device, _box(index, shape)) for device, index in indices.items())
    return _ArrayPlan(info.name, stored, shape, info.dtype, sharding, placements)


def _box(index: tuple[slice, ...], shape: tuple[int, ...]) -> Box:
    box = []
    for s, n in zip(index, shape):
        start, stop, step = s.indices(n)
        assert step == 1, index  # shardings cut contiguous blocks
        box.append((start, stop))
    return tuple(box)


# ----------------------------------------------------------------------------- reading and placing


def _materialize(reader: Reader, plans: list[_ArrayPlan]) -> dict[str, jax.Array]:
    """``{name: jax.Array}``: the chunks the devices' boxes need, each read once by the read
    engine into one host array per stored array, then placed on the devices.

    The stored arrays are read in order, at most ``IOConfig.budget_bytes`` in flight, so each
    is placed as soon as its last read is in, and its host array is dropped once the devices
    hold their copies. Names tied at save time, under the same sharding, share one array.
    """
    unique = list({(p.stored, p.sharding): p for p in plans}.values())
    groups: dict[str, list[_ArrayPlan]] = {}
    for plan in unique:
        groups.setdefault(plan.stored, []).append(plan)
    hosts: dict[str, tuple[Box, np.ndarray]] = {}
    left: dict[str, int] = {}
    requests: list[BoxRead] = []
    for stored, group in groups.items():
        meta = reader.meta.arrays[stored]
        region, reads = _covering_reads(meta, [box for plan in group for box in plan.boxes])
        host = np.empty(box_shape(region), numpy_dtype(meta.dtype))
        hosts[stored], left[stored] = (region, host), len(reads)
        requests += [BoxRead(stored, meta, r, _within(host, region, r), key=stored) for r in reads]
    built: dict[tuple[str, Sharding], jax.Array] = {}

    def place(stored: str) -> None:
        region, host = hosts.pop(stored)
        for plan in groups[stored]:
            built[plan.stored, plan.sharding] = array = _place(plan, region, host)
            jax.block_until_ready([array])  # the copies are done: the host array may go

    for stored in [s for s, n in left.items() if n == 0]:
        place(stored)
    # Handed over, not kept: the read engine lets each request (and the view of its host array
    # it holds) go once read, so a placed array's host memory is freed before the next is read.
    for r, _ in reader.read_boxes(_handed_over(requests)):
        left[r.key] -= 1
        if left[r.key] == 0:
            place(r.key)
    return {p.name: built[p.stored, p.sharding] for p in plans}


def _handed_over(items: list[BoxRead]) -> Iterator[BoxRead]:
    """``items``, emptying the list as they are taken."""
    items.reverse()
    while items:
        yield items.pop()


def _covering_reads(meta: ArrayMeta, boxes: list[Box]) -> tuple[Box, list[Box]]:
    """The region a host array must cover for ``boxes``, and the reads that fill what they need
    of it: in each shard they touch, the bounding box of the inner chunks they overlap there.
    Devices' boxes that cut through one inner chunk then share its read, and each shard's index
    is read once."""
    shape, shard, inner = meta.shape, meta.shard_shape, meta.inner_chunk_shape
    per_shard: dict[tuple[int, ...], list[list[int]]] = {}
    for box in (b for b in boxes if box_size(b) > 0):
        for piece in shard_pieces(box, shard):
            cell = tuple(a // s for (a, _), s in zip(piece, shard))
            aligned = [[a // c * c, min(-(-b // c) * c, n)] for (a, b), c, n in zip(piece, inner, shape)]
            held = per_shard.setdefault(cell, aligned)
            for dim, (lo, hi) in enumerate(aligned):
                held[dim] = [min(held[dim][0], lo), max(held[dim][1], hi)]
    reads = [tuple((lo, hi) for lo, hi in read) for read in per_shard.values()]
    if not reads:
        return tuple((0, 0) for _ in shape), []
    region = tuple((min(r[d][0] for r in reads), max(r[d][1] for r in reads)) for d in range(len(shape)))
    return region, reads


def _within(host: np.ndarray, region: Box, box: Box) -> np.ndarray:
    """The view of ``host`` (which holds ``region``) that holds ``box``."""
    if box_size(box) == 0:
        return np.empty(box_shape(box), host.dtype)
    return box_view(host, box, [o for o, _ in region])


def _place(plan: _ArrayPlan, region: Box, host: np.ndarray) -> jax.Array:
    data = {box: _jax_dtype(_within(host, region, box), plan.name) for box in plan.boxes}
    devices = [SingleDeviceSharding(d, memory_kind=plan.sharding.memory_kind) for d, _ in plan.placements]
    shards = jax.device_put([data[box] for _, box in plan.placements], devices)
    return jax.make_array_from_single_device_arrays(plan.shape, plan.sharding, shards)


def _jax_dtype(data: np.ndarray, name: str) -> np.ndarray:
    """``data`` in the dtype JAX would give it: 32-bit for 64-bit types unless x64 is enabled."""
    target = np.dtype(jax.dtypes.canonicalize_dtype(data.dtype))
    if target == data.dtype:
        return data
    if np.issubdtype(target, np.integer) and data.size:
        bounds = np.iinfo(target)
        if data.min() < bounds.min or data.max() > bounds.max:
            raise TemplateMismatchError(
                f"array {name!r} is stored as {data.dtype} and holds values outside {target}, the widest "
                "integer JAX allows while 64-bit types are disabled; enable them with "
                "jax.config.update('jax_enable_x64', True) before loading"
            )
    return data.astype(target)
