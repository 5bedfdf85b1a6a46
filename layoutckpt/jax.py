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

Host memory: the boxes are read in windows of about ``HOST_BATCH_BYTES`` (a large box in
pieces of whole inner-chunk rows, copied into place), an array goes to its devices as soon as
its last piece is in, and its host buffers are dropped once the copies are done. The next
window is read while the current one is placed, so the host holds about two windows and the
array being assembled, never the whole checkpoint.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import jax
import numpy as np
import tensorstore as ts
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from ._load import Select, _selector
from ._reader import ArrayInfo, Reader
from .base._errors import LayoutError, TemplateMismatchError
from .engine import _fetch
from .layout import _plan
from .layout._plan import Box
from .layout._spec import P
from .layout._tree import decode_value, leaf_nodes, unflatten
from .storage import _store

__all__ = ["load", "load_array"]

# A sharding, or a partition spec (JAX's or layoutckpt's) that means NamedSharding(mesh, spec).
ShardingLike = Sharding | PartitionSpec | P
Shardings = (
    ShardingLike
    | Mapping[str, ShardingLike]
    | Callable[[str, ArrayInfo], ShardingLike]
    | Sequence[tuple[str, ShardingLike]]
)

HOST_BATCH_BYTES = 256 << 20

Key = tuple[str, Box]  # a box of a stored array


def load(
    path: str | os.PathLike[str],
    shardings: Shardings,
    *,
    mesh: Mesh | None = None,
    select: Select = None,
    concurrency: int = 32,  # _store.DEFAULT_CONCURRENCY, spelled out for the docs; a test checks
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
    integers that do not fit raise instead of wrapping.
    """
    _check_mesh(mesh)
    with Reader(path, concurrency=concurrency) as reader:
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
    concurrency: int = 32,  # _store.DEFAULT_CONCURRENCY, spelled out for the docs; a test checks
) -> jax.Array:
    """One array of a checkpoint (a path, or a ``layoutckpt.open`` reader) as a ``jax.Array``."""
    _check_mesh(mesh)
    if isinstance(source, Reader):
        return _load_one(source, name, sharding, mesh)
    with Reader(source, concurrency=concurrency) as reader:
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
    rows: int  # of an inner chunk: large boxes are read in pieces of whole chunk rows
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
    rows = info.inner_chunk_shape[0] if info.inner_chunk_shape else 1
    return _ArrayPlan(info.name, stored, shape, info.dtype, rows, sharding, placements)


def _box(index: tuple[slice, ...], shape: tuple[int, ...]) -> Box:
    box = []
    for s, n in zip(index, shape):
        start, stop, step = s.indices(n)
        assert step == 1, index  # shardings cut contiguous blocks
        box.append((start, stop))
    return tuple(box)


# ----------------------------------------------------------------------------- reading and placing


def _materialize(reader: Reader, plans: list[_ArrayPlan]) -> dict[str, jax.Array]:
    """``{name: jax.Array}``: every distinct box read once, then placed on its devices.

    Boxes are cut into pieces of whole inner-chunk rows (``_fetch``) and the pieces into windows
    of about ``HOST_BATCH_BYTES``. A window is one ``ts.Batch``: TensorStore then reads each
    inner chunk and shard index the window needs once, however many boxes overlap it (without
    a batch, two devices' boxes in one chunk may both fetch it). The next window is in flight
    while the current one is placed. Names tied at save time, under the same sharding, share
    one array.
    """
    unique = list({(p.stored, p.sharding): p for p in plans}.values())
    owner: dict[Key, _ArrayPlan] = {}
    users: dict[Key, int] = {}  # how many arrays still to build need each box
    for plan in unique:
        for box in plan.boxes:
            owner.setdefault((plan.stored, box), plan)
            users[plan.stored, box] = users.get((plan.stored, box), 0) + 1
    pieces = {key: _pieces(reader, plan, key[1]) for key, plan in owner.items()}
    left = {key: len(p) for key, p in pieces.items()}
    host: dict[Key, np.ndarray] = {}
    for key, plan in owner.items():
        if len(pieces[key]) != 1:  # filled piece by piece (or empty)
            host[key] = np.empty(_plan.box_shape(key[1]), dtype=plan.dtype)
    windows: list[list[tuple[Key, Box]]] = [[]]
    size = 0
    for key, plan in owner.items():
        for piece in pieces[key]:
            nbytes = _plan.box_size(piece) * plan.dtype.itemsize
            if windows[-1] and size + nbytes > HOST_BATCH_BYTES:
                windows.append([])
                size = 0
            windows[-1].append((key, piece))
            size += nbytes

    def issue(window: list[tuple[Key, Box]]) -> list[tuple[Key, Box, Any]]:
        with ts.Batch() as batch:
            return [(key, piece, _read(reader.tensorstore(key[0]), piece, batch)) for key, piece in window]

    built: dict[tuple[str, Sharding], jax.Array] = {}
    placed = 0
    in_flight = issue(windows[0])
    for i in range(len(windows)):
        current, in_flight = in_flight, issue(windows[i + 1]) if i + 1 < len(windows) else []
        for key, piece, future in current:
            data = _store.read_result(future, owner[key].name, reader.path)
            if piece == key[1]:
                host[key] = data
            else:
                offset = piece[0][0] - key[1][0][0]
                host[key][offset : offset + data.shape[0]] = data
            left[key] -= 1
        # Windows follow the plans' order, so the plans done are those up to the first that is not.
        done = []
        while placed < len(unique) and all(left[unique[placed].stored, b] == 0 for b in unique[placed].boxes):
            plan = unique[placed]
            built[plan.stored, plan.sharding] = _place(plan, host)
            done.append(built[plan.stored, plan.sharding])
            for box in plan.boxes:
                users[plan.stored, box] -= 1
                if users[plan.stored, box] == 0:
                    del host[plan.stored, box]
            placed += 1
        # Wait for the copies, so this window's host buffers are free before the next is issued.
        jax.block_until_ready(done)
    assert placed == len(unique)
    return {p.name: built[p.stored, p.sharding] for p in plans}


def _pieces(reader: Reader, plan: _ArrayPlan, box: Box) -> list[Box]:
    """``box`` in pieces of whole inner-chunk rows of at most about ``_fetch.PIECE_BYTES``; none if empty."""
    if _plan.box_size(box) == 0:
        return []
    request = _fetch.Request(box, reader.tensorstore(plan.stored), box, plan.dtype, plan.rows, plan.name)
    return _fetch._pieces(request, _fetch.PIECE_BYTES)


def _read(store: ts.TensorStore, piece: Box, batch: ts.Batch) -> ts.Future[np.ndarray]:
    view = store[tuple(slice(a, b) for a, b in piece)] if piece else store
    return view.read(batch=batch)


def _place(plan: _ArrayPlan, host: Mapping[Key, np.ndarray]) -> jax.Array:
    data = {box: _jax_dtype(host[plan.stored, box], plan.name) for box in plan.boxes}
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
