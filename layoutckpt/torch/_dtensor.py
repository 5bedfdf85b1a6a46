"""DTensors: their layout is read off the ``DeviceMesh`` and placements, so they need no rules.

A DTensor's placements are translated into this library's vocabulary once, at the edge: its
mesh becomes the world ``Mesh`` of the root ``DeviceMesh`` (a sub-mesh such as ``mesh["dp"]``,
or a flattened one such as ``mesh["dp", "cp"]._flatten()``, maps to the root axes it spans), and
its placements become a ``P`` naming those axes. From there, planning is the same pure function
of shapes, specs and ranks as for any other array.

- ``Shard(d)`` on several mesh dimensions splits ``d`` left to right (the first is major);
  ``_StridedShard(d, split_factor=k)``, as FSDP2 makes on top of tensor parallelism, is split
  after the later dimensions whose sizes multiply to ``k``, i.e. it is the minor axis.
- ``Replicate()`` leaves the axis out of the spec (a replica), and ``Partial`` is refused:
  its local values are pending a reduction, so no shard of the global array exists yet.
- Every rank checks that the box the spec gives it is the box DTensor itself computes for it,
  so a split the spec cannot express (uneven sizes split on two axes) fails with a clear error
  instead of writing the wrong rows.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Sequence
from typing import Any

from ..base._errors import LayoutError
from ..layout._plan import Box, shard_box
from ..layout._spec import Mesh, P


def is_dtensor(x: object) -> bool:
    # Only look when torch.distributed.tensor has been imported: a DTensor cannot exist otherwise.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(x, module.DTensor)


def _axis_names(device_mesh: Any) -> tuple[str, ...]:
    names = device_mesh.mesh_dim_names
    return tuple(names) if names else tuple(f"d{i}" for i in range(device_mesh.ndim))


def _root(device_mesh: Any) -> Any:
    get_root = getattr(device_mesh, "_get_root_mesh", None)
    root = get_root() if get_root is not None else None
    return root if root is not None else device_mesh


def world_mesh(device_mesh: Any, group_ranks: Sequence[int], name: str) -> Mesh:
    """The ``Mesh`` of ``device_mesh``'s root, whose row-major order must be the group's ranks."""
    root = _root(device_mesh)
    flat = [int(r) for r in root.mesh.flatten().tolist()]
    if flat != list(group_ranks):
        raise LayoutError(
            f"array {name!r}: its DTensor lives on a DeviceMesh over global ranks {flat[:16]}, but "
            f"layoutckpt needs a root mesh that holds the process group's ranks {list(group_ranks)[:16]} "
            "in row-major order (as init_device_mesh makes it); build the mesh with init_device_mesh, "
            "or pass group= the process group of that mesh"
        )
    return Mesh(dict(zip(_axis_names(root), root.mesh.shape)))


def _root_axes_of(device_mesh: Any, dim: int, root_mesh: Mesh, name: str) -> tuple[str, ...]:
    """The root axes (major to minor) that sub-mesh dimension ``dim`` runs along."""
    names = device_mesh.mesh_dim_names
    if device_mesh.size(dim) == 1:
        # Nothing varies along it; keep its name when the root has it, so the spec says it.
        return (names[dim],) if names and names[dim] in root_mesh.axis_names else ()
    root_ranks = [int(r) for r in _root(device_mesh).mesh.flatten().tolist()]
    position = {r: i for i, r in enumerate(root_ranks)}
    coord = device_mesh.get_coordinate()
    if coord is None:
        raise LayoutError(f"array {name!r}: this rank is not part of the DTensor's DeviceMesh")
    index = list(coord)
    along = []
    for i in range(device_mesh.size(dim)):
        index[dim] = i
        along.append(root_mesh.coords(position[int(device_mesh.mesh[tuple(index)])]))
    varying = tuple(a for a in root_mesh.axis_names if len({c[a] for c in along}) > 1)
    # The dimension must enumerate those root axes in row-major order, as a (flattened) slice does.
    expected = []
    for flat in range(device_mesh.size(dim)):
        coords = dict(along[0])
        for axis in reversed(varying):
            flat, coords[axis] = divmod(flat, root_mesh.axis_size(axis))
        expected.append(coords)
    if along != expected or math.prod(root_mesh.axis_size(a) for a in varying) != device_mesh.size(dim):
        raise LayoutError(
            f"array {name!r}: mesh dimension {dim} of its DeviceMesh does not run along root mesh axes in "
            "row-major order, so its shards cannot be named by a spec; slice or flatten the root mesh "
            "made by init_device_mesh instead"
        )
    return varying


def spec_of(dt: Any, mesh: Mesh, name: str) -> P:
    """The spec, on the root ``mesh``, that places every rank's shard where ``dt``'s placements do."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    device_mesh = dt.device_mesh
    per_dim: list[list[tuple[tuple[str, ...], int]]] = [[] for _ in range(dt.ndim)]
    for m, placement in enumerate(dt.placements):
        if isinstance(placement, Replicate):
            continue
        # _StridedShard subclassed Shard in older torch; in newer torch (2.13) it does not.
        strided = isinstance(placement, _StridedShard)
        if not (strided or isinstance(placement, Shard)):
            raise LayoutError(
                f"array {name!r}: its DTensor has placement {placement} on mesh dimension {m}, which is "
                "neither a Shard nor a Replicate; a Partial DTensor holds values pending a reduction, not "
                "shards of the array. Call dt.redistribute(placements=[Replicate() or Shard(d) ...]) "
                "before saving it"
            )
        split = placement.split_factor if strided else 1
        per_dim[placement.dim].append((_root_axes_of(device_mesh, m, mesh, name), int(split)))
    entries: list[tuple[str, ...]] = []
    for d, splits in enumerate(per_dim):
        order: list[tuple[tuple[str, ...], int]] = []
        # Left to right; a strided split goes after the later splits whose sizes make its factor.
        pending: list[tuple[tuple[str, ...], int]] = []
        for axes, factor in splits:
            order.append((axes, 1))
            if factor > 1:
                pending.append((axes, factor))
        for axes, factor in pending:
            i = order.index((axes, 1))
            product, j = 1, i + 1
            while j < len(order) and product < factor:
                product *= math.prod(mesh.axis_size(a) for a in order[j][0])
                j += 1
            if product != factor:
                raise LayoutError(
                    f"array {name!r}: dimension {d} has a strided shard with split factor {factor} that the "
                    "later mesh dimensions do not make up; this placement is not supported"
                )
            order.insert(j - 1, order.pop(i))
        entries.append(tuple(a for axes, _ in order for a in axes))
    while entries and not entries[-1]:
        entries.pop()
    return P(*(e if e else None for e in entries))


def check_box(dt: Any, mesh: Mesh, spec: P, rank: int, name: str) -> Box:
    """This rank's box under ``spec``; raise unless it is where DTensor itself puts the shard."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    box = shard_box(tuple(dt.shape), spec, mesh, rank)
    local, offset = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
    theirs = tuple((int(o), int(o) + int(n)) for o, n in zip(offset, local))
    # Empty shards may sit at other offsets (no element is placed), but not have other shapes:
    # the shard's shape is checked against the box's later.
    shape = tuple(b - a for a, b in box)
    empty = any(b <= a for a, b in box) and shape == tuple(b - a for a, b in theirs)
    if box != theirs and not empty:
        raise LayoutError(
            f"array {name!r} with shape {tuple(dt.shape)}: its DTensor placements {tuple(dt.placements)} put "
            f"rank {rank}'s shard at {theirs}, which spec {spec!r} on {mesh!r} cannot express (it gives "
            f"{box}). Uneven sizes split over two mesh axes nest differently; pad the dimension to a "
            "multiple of the axis sizes, or redistribute the DTensor before saving"
        )
    return box


def from_local(local: Any, like: Any, shape: tuple[int, ...]) -> Any:
    """A DTensor with ``like``'s mesh and placements whose shard on this rank is ``local``."""
    from torch.distributed.tensor import DTensor

    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * max(shape[d + 1], 1)
    return DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=shape, stride=tuple(strides)
    )


def sharding_key(dt: Any) -> str:
    """What decides which shard of a DTensor a rank holds, as a short string: its global shape,
    its mesh's shape and axis names, this rank's place on the mesh, and its placements. Two
    DTensors with the same key hold the same elements of arrays of the same shape."""
    mesh = dt.device_mesh
    return _sharding_key(tuple(dt.shape), mesh, tuple(dt.placements), tuple(mesh.get_coordinate() or ()))


@functools.lru_cache(maxsize=4096)
def _sharding_key(shape: tuple[int, ...], mesh: Any, placements: tuple[Any, ...], at: tuple[int, ...]) -> str:
    # A fast tier keys every array of every save: the DeviceMesh and placements hash cheaply.
    return f"{list(shape)} {dict(zip(_axis_names(mesh), mesh.mesh.shape))} {list(at)} {list(map(str, placements))}"


def local_device(like: Any) -> Any:
    """Where a loaded shard for ``like`` goes: its device, or its mesh's device if it is on ``meta``."""
    import torch

    device = like.to_local().device if is_dtensor(like) else like.device
    if device.type != "meta":
        return device
    kind = like.device_mesh.device_type if is_dtensor(like) else "cpu"
    return torch.device(kind, torch.cuda.current_device()) if kind == "cuda" else torch.device(kind)


def sharding_of(dt: Any, name: str, rank: int, group_ranks: Sequence[int], layout: Any = None) -> tuple[Mesh, P]:
    """(root mesh, spec) of a DTensor leaf; a rule of ``layout`` that matches it must agree."""
    from ..layout._spec import check_spec

    mesh = world_mesh(dt.device_mesh, group_ranks, name)
    spec = spec_of(dt, mesh, name)
    shape = tuple(dt.shape)
    check_spec(spec, mesh, len(shape), name, shape)
    box = check_box(dt, mesh, spec, rank, name)
    rule = layout.rule_for(name) if layout is not None else None
    if rule is not None:
        pattern, rule_spec = rule
        check_spec(rule_spec, layout.mesh, len(shape), name, shape)
        # Each rank compares its own box, so together the ranks check every box.
        theirs = shard_box(shape, rule_spec, layout.mesh, rank)
        if theirs != box:
            raise LayoutError(
                f"array {name!r} with shape {shape}: layout rule {pattern!r} gives {rule_spec!r} on "
                f"{layout.mesh!r}, which puts rank {rank}'s shard at {theirs}, but the DTensor's placements "
                f"{tuple(dt.placements)} put it at {box}; fix the rule, or narrow its pattern so that it "
                "does not match DTensors (they need no rule)"
            )
    return mesh, spec


def default_mesh(leaves: Any, world: int, group_ranks: Sequence[int]) -> Mesh:
    """The mesh of a save or load given no layout: the first DTensor's root mesh, else replicas."""
    for name, leaf in leaves.items():
        if is_dtensor(leaf):
            return world_mesh(leaf.device_mesh, group_ranks, name)
    return Mesh({"replica": world}) if world > 1 else Mesh({})
