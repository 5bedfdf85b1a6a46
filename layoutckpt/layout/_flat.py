"""Flat shards: one buffer per rank covering a contiguous range of many parameters, concatenated.

ZeRO-1/2 and FSDP1-style optimizers keep, on each rank, a 1-D buffer that is a range of the
concatenation of many flattened parameters. Such a range is not a box of any parameter: within
one parameter it is at most a partial leading row, whole rows, and a partial trailing row.

Each parameter is stored as its own Zarr array under ``<leaf name>.<parameter name>``, chunked in
*row blocks* (shards of whole rows, about ``shard_bytes`` each), so the checkpoint is the same as
a per-parameter save and any layout reads it. A row block that lies inside one rank's range is
written by that rank straight from its buffer. A row block cut by a range boundary is written by
the rank holding its first element, after the ranks holding the rest have sent it their
fragments (point to point, planned here, so no sizes are exchanged). Each rank sends at most one
fragment, the one before its range's start, and no stored object is ever written by two ranks.

Everything here is pure: ranges, shards, owners and fragments are functions of the declared
parameters, the mesh and a rank.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping, Sequence

import attrs

from ..base._errors import LayoutError
from ._plan import Box, box_shape, shard_box, shard_shape
from ._spec import Mesh, P, SpecEntry, entry_axes

DEFAULT_SHARD_BYTES = 8 << 20


def _params(params: Sequence[tuple[str, Sequence[int]]]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    out = []
    for item in params:
        if not (isinstance(item, tuple | list) and len(item) == 2 and isinstance(item[0], str)):
            raise LayoutError(f"Flat params must be (name, shape) pairs, got {item!r}")
        name, shape = item
        shape = tuple(shape)
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
            raise LayoutError(f"Flat param {name!r}: shape {shape!r} must be non-negative integers")
        out.append((name, shape))
    if len({n for n, _ in out}) != len(out):
        raise LayoutError("Flat params name a parameter twice; every parameter appears once in the order")
    return tuple(out)


def _specs(specs: Mapping[str, P] | None) -> tuple[tuple[str, P], ...]:
    items = tuple((specs or {}).items())
    for name, spec in items:
        if not isinstance(spec, P):
            raise LayoutError(f"Flat specs: parameter {name!r} needs a P(...), got {spec!r}")
    return items


def _bounds(bounds: Sequence[int] | None) -> tuple[int, ...] | None:
    if bounds is None:
        return None
    b = tuple(bounds)
    if len(b) < 2 or b[0] != 0 or any(y < x for x, y in itertools.pairwise(b)):
        raise LayoutError(f"Flat bounds {b!r} must start at 0 and never decrease (one more entry than pieces)")
    return b


@attrs.frozen(repr=False)
class Flat:
    """A flat buffer per rank: a range of the concatenation of ``params`` split along ``axis``.

    ``params`` are (name, global shape) in concatenation order; ``axis`` is the mesh axis (or
    axes, major to minor) whose ranks hold consecutive ranges; other mesh axes hold replicas.
    By default the concatenation is cut into equal ranges of ``ceil(total / pieces)`` elements,
    the last zero-padded, as ZeRO does; ``bounds`` gives explicit cut points instead (``pieces +
    1`` of them, from 0; past the total is padding). Use it as the spec of a layout rule:

    >>> Flat([("w", (4, 3)), ("b", (3,))], "dp")
    Flat([('w', (4, 3)), ('b', (3,))], 'dp')
    """

    params: tuple[tuple[str, tuple[int, ...]], ...] = attrs.field(converter=_params)
    axis: SpecEntry = attrs.field()
    bounds: tuple[int, ...] | None = attrs.field(default=None, converter=_bounds)
    # ZeRO over tensor parallelism: the parameters split over other axes (tensor parallel), by
    # name; the buffer then concatenates this rank's pieces of them.
    specs: tuple[tuple[str, P], ...] = attrs.field(default=(), kw_only=True, converter=_specs)

    @axis.validator
    def _check_axis(self, _: object, value: object) -> None:
        ok = isinstance(value, str) or (isinstance(value, tuple) and value and all(isinstance(a, str) for a in value))
        if not ok:
            raise LayoutError(f"Flat axis must be a mesh axis name or a tuple of them, got {value!r}")

    def __repr__(self) -> str:
        extra = f", bounds={list(self.bounds)!r}" if self.bounds is not None else ""
        extra += f", specs={dict(self.specs)!r}" if self.specs else ""
        return f"Flat({[(n, s) for n, s in self.params]!r}, {self.axis!r}{extra})"

    def spec_of(self, param: str) -> P:
        """How parameter ``param`` is split before it is flattened: ``P()`` unless ``specs`` says."""
        return dict(self.specs).get(param, P())

    @property
    def within(self) -> tuple[str, ...]:
        """The axes that split parameters before flattening (tensor parallel), in order of use."""
        return tuple(dict.fromkeys(a for _, spec in self.specs for a in spec.axes))

    def local(self, mesh: Mesh, rank: int, fixed: tuple[str, ...] = ()) -> LocalFlat:
        """This rank's flat buffer as a flat of its own pieces on the mesh without ``within``
        and the ``fixed`` axes (stage axes, whose ranks hold other buffers, not replicas)."""
        return _local(self, mesh, rank, fixed)

    def stored_shard(self, param: int, itemsize: int, mesh: Mesh, shard_bytes: int) -> tuple[int, ...]:
        """The shard shape of parameter ``param``'s stored array: row blocks of about
        ``shard_bytes`` that also tile every tensor-parallel piece of it."""
        name, shape = self.params[param]
        spec = self.spec_of(name)
        if not spec.axes:
            return row_shard_shape(shape, itemsize, shard_bytes)
        piece = shard_shape(shape, spec, mesh)
        block = row_shard_shape(piece, itemsize, shard_bytes)
        if not block:
            return block
        # A block must divide the piece's rows, so that every piece starts on a block.
        rows = next(b for b in range(block[0], 0, -1) if piece[0] % b == 0)
        return (rows, *piece[1:])

    @property
    def axes(self) -> tuple[str, ...]:
        """The mesh axes of ``axis`` as a tuple, major to minor."""
        return entry_axes(self.axis)

    @property
    def total(self) -> int:
        """Elements in the concatenation of all the parameters (padding not included)."""
        return sum(math.prod(s) for _, s in self.params)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Where each parameter starts in the concatenation, in elements, in ``params`` order."""
        out, at = [], 0
        for _, shape in self.params:
            out.append(at)
            at += math.prod(shape)
        return tuple(out)

    def pieces(self, mesh: Mesh) -> int:
        """Into how many ranges the concatenation is cut on ``mesh``: the product of the sizes of
        ``axes``. ``LayoutError`` if ``mesh`` lacks one of them."""
        return math.prod(mesh.axis_size(a) for a in self.axes)

    def check(self, mesh: Mesh, name: str) -> None:
        """Raise a ``LayoutError`` naming the flat array ``name`` unless it fits ``mesh``: every
        axis on the mesh, and ``bounds`` (if given) one more than the pieces, ending at or past
        ``total``."""
        for a in (*self.axes, *self.within):
            if a not in mesh.axis_names:
                raise LayoutError(
                    f"flat array {name!r}: axis {a!r} is not an axis of {mesh!r}; use one of {list(mesh.axis_names)}"
                )
        shared = set(self.axes) & set(self.within)
        if shared:
            raise LayoutError(
                f"flat array {name!r}: axes {sorted(shared)} both cut the buffer and split its parameters; "
                "a parameter's spec names the tensor-parallel axes, the flat axis the data-parallel ones"
            )
        unknown = sorted(set(dict(self.specs)) - {n for n, _ in self.params})
        if unknown:
            raise LayoutError(f"flat array {name!r}: specs= names {unknown}, which are not among its params")
        k = self.pieces(mesh)
        if self.bounds is not None and len(self.bounds) != k + 1:
            raise LayoutError(
                f"flat array {name!r}: {len(self.bounds)} bounds given but axis {self.axis!r} has {k} ranks; "
                f"give {k + 1} cut points"
            )
        if self.bounds is not None and self.bounds[-1] < self.total:
            raise LayoutError(
                f"flat array {name!r}: the bounds end at {self.bounds[-1]} but the parameters hold {self.total} "
                "elements; the last bound must be at least the total"
            )

    def piece_range(self, mesh: Mesh, piece: int) -> tuple[int, int]:
        """The [start, stop) of the concatenation held by piece ``piece``, padding included."""
        if self.bounds is not None:
            return self.bounds[piece], self.bounds[piece + 1]
        length = -(-self.total // self.pieces(mesh))
        return piece * length, (piece + 1) * length

    def piece_of(self, mesh: Mesh, rank: int) -> tuple[int, int]:
        """(piece index, replica index) of ``rank``: its place along the flat axes and the others."""
        coords = mesh.coords(rank)
        piece = replica = 0
        for axis in mesh.axis_names:
            if axis not in self.axes:
                replica = replica * mesh.axis_size(axis) + coords[axis]
        for axis in self.axes:
            piece = piece * mesh.axis_size(axis) + coords[axis]
        return piece, replica

    def rank_of(self, mesh: Mesh, piece: int, replica: int) -> int:
        """The rank holding piece ``piece``, replica ``replica``: the inverse of ``piece_of``."""
        coords: dict[str, int] = {}
        for axis in reversed(self.axes):
            piece, coords[axis] = divmod(piece, mesh.axis_size(axis))
        for axis in reversed(mesh.axis_names):
            if axis not in self.axes:
                replica, coords[axis] = divmod(replica, mesh.axis_size(axis))
        return mesh.rank_of(coords)

    def replicas(self, mesh: Mesh) -> int:
        """How many ranks hold each piece: the product of the sizes of the other mesh axes."""
        return mesh.size // self.pieces(mesh)


@attrs.frozen
class LocalFlat:
    """A rank's flat buffer seen as a flat of its tensor-parallel pieces (``Flat.local``).

    ``flat`` has the pieces' shapes and lives on ``mesh``, the mesh without the tensor-parallel
    axes, where this rank is ``rank``; ``ranks[r]`` is the full mesh's rank of its rank ``r``.
    ``origins[p]`` is where parameter ``p``'s piece starts in the stored array; ``writes[p]``
    says whether this rank's pieces of ``p`` are written by ranks of its coordinates (a
    parameter replicated along a tensor-parallel axis is written at coordinate 0 only).
    """

    flat: Flat
    mesh: Mesh
    rank: int
    ranks: tuple[int, ...]
    origins: tuple[tuple[int, ...], ...]
    writes: tuple[bool, ...]

    def to_global(self, box: Box, param: int) -> Box:
        return tuple((a + o, b + o) for (a, b), o in zip(box, self.origins[param]))


def _local(flat: Flat, mesh: Mesh, rank: int, fixed: tuple[str, ...]) -> LocalFlat:
    within = flat.within
    coords = mesh.coords(rank)
    if not within and not fixed:
        origins = tuple((0,) * len(shape) for _, shape in flat.params)
        return LocalFlat(flat, mesh, rank, tuple(range(mesh.size)), origins, (True,) * len(flat.params))
    params, origins, writes = [], [], []
    for name, shape in flat.params:
        spec = flat.spec_of(name)
        box = shard_box(shape, spec, mesh, rank)
        params.append((name, box_shape(box)))
        origins.append(tuple(a for a, _ in box))
        writes.append(all(coords[a] == 0 for a in within if a not in spec.axes))
    sub = Mesh(tuple((a, n) for a, n in mesh.axes if a not in within and a not in fixed))
    at = {a: coords[a] for a in (*within, *fixed)}
    ranks = tuple(mesh.rank_of({**sub.coords(r), **at}) for r in range(sub.size))
    sub_rank = sub.rank_of({a: coords[a] for a in sub.axis_names})
    local = Flat(params, flat.axis, flat.bounds)
    return LocalFlat(local, sub, sub_rank, ranks, tuple(origins), tuple(writes))


def rows_of(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, elements per row) of a parameter seen as rows along its first dimension."""
    if not shape:
        return 1, 1
    return shape[0], math.prod(shape[1:])


def row_shard_shape(shape: tuple[int, ...], itemsize: int, shard_bytes: int) -> tuple[int, ...]:
    """Row blocks of about ``shard_bytes``: the stored shard shape of a flat-saved parameter."""
    if not shape:
        return ()
    rows, per_row = rows_of(shape)
    block = max(1, min(rows, shard_bytes // max(1, per_row * itemsize)))
    return (block, *(max(1, n) for n in shape[1:]))


def row_box(shape: tuple[int, ...], r0: int, r1: int) -> Box:
    return ((r0, r1), *((0, n) for n in shape[1:])) if shape else ()


@attrs.frozen
class Part:
    """Elements ``[lo, hi)`` of a stored shard (flat, within it) held by ``rank`` at ``src`` of its buffer."""

    rank: int
    lo: int
    hi: int
    src: int


@attrs.frozen
class ShardWrite:
    """One stored row block this rank writes, assembled from its own buffer and received parts."""

    param: int
    box: Box
    size: int
    parts: tuple[Part, ...]


@attrs.frozen
class Send:
    """Elements ``[lo, hi)`` of this rank's buffer that ``to`` needs for a shard of parameter
    ``param`` it writes."""

    to: int
    lo: int
    hi: int
    param: int = 0


def _shards_overlapping(flat: Flat, shard_shapes: Sequence[tuple[int, ...]], lo: int, hi: int) -> Iterator[tuple]:
    """(param index, shard index, global start, global stop, r0, r1) of row blocks within [lo, hi)."""
    for p, ((_, shape), offset) in enumerate(zip(flat.params, flat.offsets)):
        rows, per_row = rows_of(shape)
        n = rows * per_row if shape else 1
        if n == 0 or offset + n <= lo or offset >= hi:
            continue
        block = shard_shapes[p][0] if shape else 1
        first = max(0, (lo - offset) // (block * per_row))
        last = min(-(-rows // block), -(-(hi - offset) // (block * per_row)))
        for s in range(first, last):
            r0, r1 = s * block, min(rows, (s + 1) * block)
            yield p, s, offset + r0 * per_row, offset + r1 * per_row, r0, r1


def _piece_at(flat: Flat, mesh: Mesh, position: int) -> int:
    k = flat.pieces(mesh)
    if flat.bounds is not None:
        return next(i for i in range(k) if flat.bounds[i] <= position < flat.bounds[i + 1])
    return position // (-(-flat.total // k))


def save_plan(
    flat: Flat, mesh: Mesh, rank: int, shard_shapes: Sequence[tuple[int, ...]]
) -> tuple[list[ShardWrite], list[Send]]:
    """The row blocks ``rank`` writes (with where each part comes from) and the fragments it sends.

    A block is written by the holder of its first element; among replicas, the one whose replica
    index is the block's ordinal modulo the replica count, so replicas share the writing.
    """
    piece, replica = flat.piece_of(mesh, rank)
    start, stop = flat.piece_range(mesh, piece)
    stop = min(stop, flat.total)
    n_rep = flat.replicas(mesh)
    writes: list[ShardWrite] = []
    sends: list[Send] = []
    for p, s, g0, g1, r0, r1 in _shards_overlapping(flat, shard_shapes, start, stop):
        if (p + s) % n_rep != replica:
            continue
        owner = _piece_at(flat, mesh, g0)
        if owner != piece:
            # Only the block holding this range's first element starts before it.
            to = flat.rank_of(mesh, owner, replica)
            sends.append(Send(to, max(g0, start) - start, min(g1, stop) - start, p))
            continue
        parts = []
        at, q = g0, piece
        while at < g1:
            q_start, q_stop = flat.piece_range(mesh, q)
            end = min(g1, q_stop)
            if end > at:
                parts.append(Part(flat.rank_of(mesh, q, replica), at - g0, end - g0, at - q_start))
            at, q = max(at, end), q + 1
        writes.append(ShardWrite(p, row_box(flat.params[p][1], r0, r1), g1 - g0, tuple(parts)))
    return writes, sends


@attrs.frozen
class Read:
    """Copy ``[lo, hi)`` of the rows ``box`` of parameter ``param`` (flattened) to ``dst`` of the buffer."""

    param: int
    box: Box
    lo: int
    hi: int
    dst: int


def load_plan(flat: Flat, mesh: Mesh, rank: int) -> tuple[int, list[Read]]:
    """(this rank's buffer length, the reads that fill it): whole rows around each parameter's part."""
    piece, _ = flat.piece_of(mesh, rank)
    start, stop = flat.piece_range(mesh, piece)
    reads = []
    for p, ((_, shape), offset) in enumerate(zip(flat.params, flat.offsets)):
        rows, per_row = rows_of(shape)
        n = rows * per_row
        a, b = max(start, offset) - offset, min(stop, offset + n) - offset
        if b <= a:
            continue
        r0, r1 = a // per_row, -(-b // per_row)
        reads.append(Read(p, row_box(shape, r0, r1), a - r0 * per_row, b - r0 * per_row, offset + a - start))
    return stop - start, reads
