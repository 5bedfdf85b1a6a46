"""What a rank holds, as pieces of stored arrays: local names made global, fused and padded
tensors cut into the logical arrays they hold.

A leaf of the state is usually one box of one stored array. Under a layout with name rules,
stages, ``Fused`` or ``Padded`` rules it may be under a local name, part of a fused tensor or a
padded one; ``localize`` turns this rank's leaves into ``Piece``s, each exactly one box of one
stored array under its global name, which is all that planning and writing know. Loading uses
the same cuts backwards (``Cut.place``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import numpy as np

from .base._errors import LayoutError
from .format._dtypes import zarr_name
from .layout._flat import Flat
from .layout._layout import Layout
from .layout._names import to_global
from .layout._plan import shard_shape
from .layout._spec import Mesh, P
from .layout._tree import leaf_nodes, retarget
from .layout._views import Cut, Fused, Padded
from .torch._dtensor import is_dtensor
from .torch._tensors import tensor_zarr_dtype
from .torch._torch import is_tensor, torch


@attrs.frozen
class Piece:
    """One box of one stored array that this rank holds (the live object: nothing copied yet).

    ``name`` is the stored, global name; ``local`` the leaf it comes from (the same name
    unless the layout maps names, fuses or pads). ``cut`` says where in that leaf the piece
    lies (None: it is the whole leaf). ``shard`` overrides the pieces' lengths (padded arrays).
    """

    name: str
    source: Any
    shape: tuple[int, ...]
    itemsize: int
    dtype: str
    kind: str
    # A DTensor leaf: its global shape, mesh and placements are known, so it needs no rule.
    dtensor: Any = None
    local: str = ""
    cut: Cut | None = None
    pad: tuple[int, int] | None = None  # a padded leaf's (dimension, rows per piece)
    # How the stored array is split: the rule's spec (a fused or padded rule's inner P); None
    # for a DTensor, whose placements say.
    spec: P | Flat | None = None


def pieces_of(leaves: Mapping[str, Any], spec_of: Callable[[str], Any] | None = None) -> list[Piece]:
    """Every array leaf as one piece of the stored array of its own name; with ``spec_of``,
    each piece but a DTensor's split as it says (made once, not made and then changed)."""
    out = []
    for name, leaf in leaves.items():
        if is_dtensor(leaf):
            local = leaf.to_local()
            dtype = tensor_zarr_dtype(local, name)
            out.append(Piece(name, local, tuple(local.shape), local.element_size(), dtype, "torch", leaf, name))
            continue
        if is_tensor(leaf):
            data, shape, itemsize, kind = leaf, tuple(leaf.shape), leaf.element_size(), "torch"
            dtype = tensor_zarr_dtype(leaf, name)
        elif isinstance(leaf, np.ndarray | np.generic):
            # Stored bytes are little-endian: a big-endian array is converted (a copy), never
            # written as it lies in memory.
            data = np.asarray(leaf).astype(leaf.dtype.newbyteorder("="), copy=False)
            shape, itemsize, dtype = data.shape, data.itemsize, zarr_name(data.dtype, name)
            kind = "numpy" if isinstance(leaf, np.ndarray) else "numpy_scalar"
        else:
            continue
        spec = spec_of(name) if spec_of is not None else None
        out.append(Piece(name, data, shape, itemsize, dtype, kind, local=name, spec=spec))
    return out


def uses_views(layout: Layout | None) -> bool:
    """Whether ``layout`` maps names, splits names over stages, fuses or pads: then the stored
    tree is built from the global names, not taken from the state's own tree."""
    if layout is None:
        return False
    return bool(layout.stage_axes or layout.names) or any(isinstance(s, Fused | Padded) for _, s in layout.rules)


def localize(leaves: Mapping[str, Any], layout: Layout | None, mesh: Mesh, rank: int) -> list[Piece]:
    """This rank's array leaves as pieces under global names with their specs, fused and padded
    leaves cut into their arrays. Raises ``LayoutError`` naming the array when a rule does not fit."""
    if not uses_views(layout):
        return pieces_of(leaves, functools.partial(_spec, layout))
    assert layout is not None
    pieces = pieces_of(leaves)
    coords = mesh.coords(rank)
    names = to_global(layout.names, [p.local for p in pieces], coords)
    out: list[Piece] = []
    for p in pieces:
        name = names[p.local]
        # A DTensor's placements say how it is split: it needs no rule, and may match none.
        spec = _spec(layout, name) if p.dtensor is None else _rule_spec(layout, name)
        if isinstance(spec, Fused | Padded) and p.dtensor is not None:
            raise LayoutError(
                f"array {name!r}: a {type(spec).__name__} rule matches a DTensor; declare it on the local "
                "tensor (dt.to_local()) with the rule's spec, or give the DTensor a plain rule"
            )
        if isinstance(spec, Fused):
            out += [_cut(p, part, cut, spec.spec) for part, cut in spec.cuts(name, p.shape, mesh, coords)]
        elif isinstance(spec, Padded):
            cut, _, rows = spec.cut(name, p.shape, mesh, coords)
            out.append(attrs.evolve(_cut(p, name, cut, spec.spec), pad=(spec.dim, rows)))
        else:
            _check_not_a_part(layout, name, spec)
            out.append(attrs.evolve(p, name=name, spec=None if p.dtensor is not None else spec))
    _check_unique(out)
    return out


def _check_not_a_part(layout: Layout, name: str, spec: Any) -> None:
    """A leaf named as a ``Fused`` rule names a part of another leaf is loaded as that part (the
    checkpoint cannot tell them apart): it must be split as the part would be."""
    part = layout.fused_part_spec(name)
    if part is not None and spec is not None and part != spec:
        raise LayoutError(
            f"array {name!r} is split by {spec!r}, but it is named as a part of a leaf that a Fused rule "
            f"matches, which a load splits by {part!r}; rename the leaf, or give it a rule that splits it "
            "as that part"
        )


def _check_unique(pieces: list[Piece]) -> None:
    """Two leaves whose stored names meet (a fused part's name that is also a leaf's, a rename
    onto one) would each overwrite the other's array."""
    seen: dict[str, str] = {}
    for p in pieces:
        other = seen.setdefault(p.name, p.local)
        if other != p.local:
            raise LayoutError(
                f"array {p.name!r} is stored from two leaves, {other!r} and {p.local!r} (a fused part or "
                "a rename gives one the other's name); each would overwrite the other: rename one of them"
            )


def _spec(layout: Layout | None, name: str) -> Any:
    return layout.spec_for(name) if layout is not None else P()


def _rule_spec(layout: Layout, name: str) -> Any:
    rule = layout.rule_for(name)
    return rule[1] if rule is not None else None


def _cut(p: Piece, name: str, cut: Cut, spec: P) -> Piece:
    shape = (*p.shape[: cut.dim], cut.groups * cut.width, *p.shape[cut.dim + 1 :])
    return attrs.evolve(p, name=name, shape=shape, cut=cut, spec=spec)


def source_of(piece: Piece) -> Any:
    """The data of ``piece``: its leaf, or the part of it that the cut takes (a view where the
    part is contiguous in the leaf, else a copy)."""
    return piece.cut.take(piece.source) if piece.cut is not None else piece.source


def padded_shard(piece: Piece, shape: tuple[int, ...], spec: P, mesh: Mesh) -> tuple[int, ...] | None:
    """The shard shape of a padded piece's array (the padded rows per piece along its
    dimension), None for any other array."""
    if piece.pad is None:
        return None
    return padded_shard_shape(shape, spec, mesh, *piece.pad)


def padded_shard_shape(shape: tuple[int, ...], spec: P, mesh: Mesh, dim: int, rows: int) -> tuple[int, ...]:
    """The shard shape of a padded array of ``shape``: ``rows`` (the padded rows of a piece)
    along ``dim``, as ``spec`` splits it along the others."""
    shard = list(shard_shape(shape, spec, mesh))
    # Pieces as long as the array (one rank holds it all) make a grid of one shard of it.
    shard[dim] = max(1, min(rows, shape[dim]))
    return tuple(shard)


def storage_key(leaf: Any) -> Any:
    """Equal for two leaves that are the same tensor (tied weights), None where that is unknowable."""
    extra: tuple[Any, ...] = ()
    if is_dtensor(leaf):
        extra = (id(leaf.device_mesh), tuple(leaf.placements), tuple(leaf.shape))
        leaf = leaf.to_local()
    if not is_tensor(leaf) or leaf.is_meta or leaf.layout != torch.strided or leaf.numel() == 0:
        return None
    # Tensors that start at the same address with the same shape, strides and dtype are views
    # of the same elements: the address includes the storage offset.
    return (leaf.data_ptr(), tuple(leaf.shape), leaf.stride(), leaf.dtype, leaf.device, *extra)


def tie(structure: Any, leaves: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Store a tensor that appears under several names (tied weights) once, under its first name.

    The other names become aliases in the tree, so a load gives one tensor back to all of them.
    """
    first: dict[Any, str] = {}
    aliases: dict[str, str] = {}
    for name, leaf in leaves.items():
        key = storage_key(leaf)
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


def tree_nodes(
    structure: Any, pieces: list[Piece], flats: list[tuple[Piece, Flat]], layout: Layout, mesh: Mesh, rank: int
) -> dict[str, Any]:
    """{global name: node} of every leaf of the state as stored under a layout with views: a
    fused leaf as its parts, a flat buffer as its parameters, a tied name as its target's array."""
    leaves = dict(leaf_nodes(structure))
    names = to_global(layout.names, leaves, mesh.coords(rank))
    stored: dict[str, list[str]] = {}
    for p in pieces:
        stored.setdefault(p.local, []).append(p.name)
    for p, spec in flats:
        stored[p.local] = [f"{p.name}.{param}" for param, _ in spec.params]
    nodes: dict[str, Any] = {}
    for local, node in leaves.items():
        if "array" not in node:
            nodes[names[local]] = node
        elif node["array"] == local:
            nodes.update((s, {"array": s}) for s in stored[local])
        elif len(stored[node["array"]]) == 1:
            nodes[names[local]] = {"array": stored[node["array"]][0]}
        else:
            raise LayoutError(f"array {local!r} is tied to {node['array']!r}, which is fused: untie them to save")
    return nodes
