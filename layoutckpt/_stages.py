"""Ranks that hold different names: the one exchange that tells every rank the whole state.

Pipeline stages hold different layers, and expert-parallel ranks their own experts. Ranks that
differ only along the other axes (data and tensor parallel replicas and shards) hold the same
names, so it is enough that one rank of each stage coordinate tells the others what its stage
holds: one broadcast per stage coordinate. Each rank receives the state's description, one
entry per stored array, whatever the world's size. Every rank then knows every array, which
stage coordinates hold it, and the tree to store; the save checks with its usual digest that
all ranks built the same union.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from ._pieces import Piece, source_of
from .base._errors import InconsistentShardsError, LayoutError
from .layout._flat import Flat
from .layout._layout import Layout
from .layout._names import Renumber
from .layout._spec import Mesh, P
from .torch._dist import Comm

Coords = tuple[int, ...]


@attrs.frozen
class Entry:
    """What every rank must know of one stored array, whether it holds it or not."""

    name: str
    dtype: str
    ndim: int
    spec: Any  # the spec as JSON
    mesh: Any  # the spec's mesh as JSON, where it is not the layout's (a DTensor's)
    kind: str
    itemsize: int
    pad: Any  # a padded array's [dimension, rows per piece], else None
    flat: bool = False  # a flat buffer (its layout rule says how it is cut)

    def parsed(self) -> tuple[P, Mesh | None]:
        return P.from_json(self.spec), Mesh.from_json(self.mesh) if self.mesh is not None else None


@attrs.frozen
class Union:
    """Every stored array of the state, which stage coordinates hold each, and the tree's leaves."""

    entries: tuple[Entry, ...]
    holders: tuple[tuple[Coords, ...], ...]
    nodes: Mapping[str, Any]


def coords_of(mesh: Mesh, axes: Sequence[str], rank: int) -> Coords:
    """This rank's coordinates along the stage ``axes``."""
    coords = mesh.coords(rank)
    return tuple(coords[a] for a in axes)


def speakers(mesh: Mesh, axes: Sequence[str]) -> list[int]:
    """One rank per stage coordinate, in row-major order: the one whose other coordinates are 0."""
    zero = dict.fromkeys(mesh.axis_names, 0)
    return [
        mesh.rank_of({**zero, **dict(zip(axes, stage))})
        for stage in itertools.product(*(range(mesh.axis_size(a)) for a in axes))
    ]


def union(comm: Comm, mesh: Mesh, axes: Sequence[str], entries: list[Entry], nodes: Mapping[str, Any]) -> Union:
    """Every stage's arrays and tree leaves, as one rank of each stage tells them, merged.

    An array held on several stage coordinates must be described alike on each (dtype, rank,
    spec), and a tree leaf must be equal; anything else is an ``InconsistentShardsError`` naming
    the array and the two coordinates. So must every rank of a stage hold what its speaker does.
    """
    mine = json.dumps([[attrs.astuple(e) for e in entries], nodes], sort_keys=True).encode()
    told = comm.broadcast_many(speakers(mesh, axes), mine)
    stages = list(itertools.product(*(range(mesh.axis_size(a)) for a in axes)))
    here = stages.index(coords_of(mesh, axes, comm.rank))
    if told[here] != mine:
        raise InconsistentShardsError(
            f"rank {comm.rank} holds other arrays or values than the first rank of its stage "
            f"({', '.join(f'{a}={c}' for a, c in zip(axes, stages[here]))}); ranks that differ only along "
            f"axes other than {list(axes)} must hold the same names"
        )
    merged: dict[str, Entry] = {}
    holders: dict[str, list[Coords]] = {}
    tree: dict[str, Any] = {}
    where: dict[str, Coords] = {}
    for stage, raw in zip(stages, told):
        their_entries, their_nodes = json.loads(raw)
        for fields in their_entries:
            e = Entry(*fields)
            if e.name in merged and merged[e.name] != e:
                raise InconsistentShardsError(_differs(e.name, axes, where[e.name], stage, merged[e.name], e))
            merged.setdefault(e.name, e)
            where.setdefault(e.name, stage)
            holders.setdefault(e.name, []).append(stage)
        for name, node in their_nodes.items():
            if name in tree and tree[name] != node:
                raise InconsistentShardsError(_differs(name, axes, where[name], stage, tree[name], node))
            tree.setdefault(name, node)
            where.setdefault(name, stage)
    order = list(merged)
    return Union(tuple(merged[n] for n in order), tuple(tuple(holders[n]) for n in order), tree)


def _differs(name: str, axes: Sequence[str], a: Coords, b: Coords, first: Any, second: Any) -> str:
    at = ", ".join(f"{axis}={c}" for axis, c in zip(axes, a))
    bt = ", ".join(f"{axis}={c}" for axis, c in zip(axes, b))
    return (
        f"array {name!r} is {first} on the ranks at {at} but {second} on those at {bt}; a name held by "
        "several stages must be the same array on each (same dtype, shape and spec, or the same value). "
        "Values that differ per stage, such as an optimizer's param_groups listing each stage's "
        "parameters, go per parameter (StateDictOptions(flatten_optimizer_state_dict=True), as "
        "torchtitan saves) or in rank_state="
    )


@attrs.frozen
class Joined:
    """The whole state as every rank sees it after the exchange: every stored array (this
    rank's piece, or a stand-in of its dtype and rank where it holds none), how each is split,
    which stage coordinates hold it, and the stored tree's leaves."""

    arrays: list[Piece]
    shardings: list[tuple[Mesh, P]]
    holders: list[tuple[Coords, ...]]
    nodes: Mapping[str, Any]
    flats: list[tuple[Piece, Flat]]
    flat_holders: list[tuple[Coords, ...]]


def join(
    comm: Comm,
    mesh: Mesh,
    layout: Layout,
    arrays: list[Piece],
    shardings: list[tuple[Mesh, P]],
    flats: list[tuple[Piece, Flat]],
    nodes: Mapping[str, Any],
    failed: bool,
) -> Joined:
    """Exchange along the layout's stage axes and merge. A rank whose local checks ``failed``
    still takes part (with nothing to offer), so that no rank waits for it."""
    axes = layout.stage_axes
    entries = [] if failed else [_entry(a, m, s, mesh) for a, (m, s) in zip(arrays, shardings)]
    entries += (
        [] if failed else [Entry(a.name, a.dtype, 1, None, None, a.kind, a.itemsize, None, True) for a, _ in flats]
    )
    u = union(comm, mesh, axes, entries, {} if failed else nodes)
    _check_numbering(layout, [e.name for e in u.entries])
    mine = {a.name: (a, sharding) for a, sharding in zip(arrays, shardings)}
    my_flats = {a.name: (a, spec) for a, spec in flats}
    out_arrays, out_shardings, holders = [], [], []
    out_flats, flat_holders = [], []
    for e, held in zip(u.entries, u.holders):
        if e.flat:
            stand_in = Piece(e.name, None, (0,), e.itemsize, e.dtype, e.kind)
            out_flats.append(my_flats.get(e.name, (stand_in, layout.spec_for(e.name))))
            flat_holders.append(held)
            continue
        holders.append(held)
        if e.name in mine:
            a, sharding = mine[e.name]
        else:
            spec, own = e.parsed()
            pad = tuple(e.pad) if e.pad is not None else None
            a = Piece(e.name, None, (0,) * e.ndim, e.itemsize, e.dtype, e.kind, spec=spec, pad=pad)
            sharding = (own or mesh, spec)
        out_arrays.append(a)
        out_shardings.append(sharding)
    return Joined(out_arrays, out_shardings, holders, u.nodes, out_flats, flat_holders)


def _entry(a: Piece, m: Mesh, spec: P, mesh: Mesh) -> Entry:
    own = m.to_json() if m != mesh else None
    return Entry(a.name, a.dtype, len(a.shape), spec.to_json(), own, a.kind, a.itemsize, a.pad and list(a.pad))


def _check_numbering(layout: Layout, names: list[str]) -> None:
    """Every number a ``Renumber`` rule makes global, from 0 to the largest, is held by a rank."""
    for rule in layout.names:
        if not isinstance(rule, Renumber):
            continue
        found: dict[int, str] = {}
        for name in names:
            match = re.search(rule.pattern, name)
            if match:
                found.setdefault(int(match.group(1)), name)
        missing = sorted(set(range(max(found, default=-1) + 1)) - set(found))
        if missing:
            example = found[max(found)]
            match = re.search(rule.pattern, example)
            assert match is not None
            lost = f"{example[: match.start(1)]}{missing[0]}{example[match.end(1) :]}"
            raise LayoutError(
                f"no rank holds {lost!r} (numbers {missing[:5]} of {rule!r} are missing), yet ranks hold up to "
                f"{example!r}; every stage must pass its own layers (check per=/starts= against the stages' sizes)"
            )


def reconcile(
    comm: Comm,
    arrays: list[Piece],
    shardings: list[tuple[Mesh, P]],
    holders: list[tuple[Coords, ...]] | None,
    layout: Layout | None,
) -> list[Piece]:
    """Check or average the copies of arrays held by several replicas, as the layout says.

    An array held on several stage coordinates (a tied embedding on the first and last stage)
    is checked by default: the copies of each piece must be bit-equal. ``replicas=`` declares
    ``"check"``, ``"mean"`` (each piece becomes the mean of its copies, as UCP's
    ``params_to_average``) or ``"first"`` (no check; the first stage's copy is written) for any
    array. One all-reduce checks every array; each averaged array costs one of its own.
    """
    policies = [_policy(layout, a.name, holders[i] if holders else ()) for i, a in enumerate(arrays)]
    checked = [i for i, p in enumerate(policies) if p == "check"]
    if checked:
        _check_copies(comm, [arrays[i] for i in checked], [shardings[i] for i in checked])
    out = list(arrays)
    for i, policy in enumerate(policies):
        if policy == "mean":
            out[i] = attrs.evolve(out[i], source=_mean(comm, out[i], shardings[i]), cut=None)
    return out


def _policy(layout: Layout | None, name: str, held: tuple[Coords, ...]) -> str | None:
    declared = layout.replica_policy(name) if layout is not None else None
    return declared or ("check" if len(held) > 1 else None)


def _piece(a: Piece, sharding: tuple[Mesh, P], rank: int) -> tuple[int, int]:
    """(pieces, this rank's piece) of the array ``a``'s spec."""
    mesh, spec = sharding
    coords = mesh.coords(rank)
    k, i = 1, 0
    for axis in spec.axes:
        k, i = k * mesh.axis_size(axis), i * mesh.axis_size(axis) + coords[axis]
    return k, i


def _check_copies(comm: Comm, arrays: list[Piece], shardings: list[tuple[Mesh, P]]) -> None:
    slots, values = [], []
    for a, sharding in zip(arrays, shardings):
        k, i = _piece(a, sharding, comm.rank)
        mine = _fingerprint(source_of(a)) if a.source is not None else None
        slots.append((a.name, k))
        values += [mine if (mine is not None and j == i) else None for j in range(k)]
    hi = comm.all_reduce(
        [-1 if v is None else v for v in values] + [-_UNHELD if v is None else -v for v in values], "max"
    )
    n = len(values)
    at = 0
    for name, k in slots:
        for j in range(k):
            most, least = hi[at + j], -hi[n + at + j]
            if most >= 0 and most != least:
                raise InconsistentShardsError(
                    f"array {name!r}: the ranks holding piece {j} of it hold different values; its copies must be "
                    f"bit-equal, or declare replicas=[({name!r}, 'mean')] (average them) or 'first' (keep one)"
                )
        at += k


_UNHELD = 1 << 62


def _fingerprint(data: Any) -> int:
    """56 bits of a BLAKE2b of ``data``'s bytes (a tensor or an array)."""
    if hasattr(data, "detach"):
        import torch

        data = data.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return int.from_bytes(hashlib.blake2b(raw, digest_size=7).digest(), "little")


def _mean(comm: Comm, a: Piece, sharding: tuple[Mesh, P]) -> Any:
    """This rank's piece of ``a``, averaged (in float64) over every rank holding that piece."""
    import torch

    k, i = _piece(a, sharding, comm.rank)
    data = torch.as_tensor(source_of(a)).detach().cpu() if a.source is not None else None
    size = comm.all_reduce([data.numel() if data is not None else 0], "max")[0]
    # Row p sums the copies of piece p; the last column counts them.
    buf = torch.zeros(k, size + 1, dtype=torch.float64)
    if data is not None:
        buf[i, : data.numel()] = data.reshape(-1).to(torch.float64)
        buf[i, size] = 1
    comm.all_reduce_tensor(buf)
    if data is None:
        return None
    return (buf[i, : data.numel()] / buf[i, size]).to(data.dtype).reshape(data.shape)
