"""Pure planning: which box of which array each rank holds, writes and reads.

Nothing here touches torch, files or the network; every function is a deterministic function of
global shapes, specs, the mesh and a rank, so every rank computes the same global plan on its
own with no gather or scatter of plans.

A *box* is a tuple of half-open ``(start, stop)`` ranges, one per dimension. Splits follow
``torch.chunk``: a dimension of size ``n`` split ``k`` ways gives pieces of ``ceil(n / k)``, the
tail smaller or empty. That is also a regular chunk grid, so a box is exactly one stored shard.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from ..base._errors import InconsistentShardsError
from ._spec import Mesh, P, SpecEntry, entry_axes

Box = tuple[tuple[int, int], ...]


def split_range(n: int, k: int, i: int, piece: int | None = None) -> tuple[int, int]:
    """The ``i``-th of ``k`` pieces of ``range(n)``, as ``torch.chunk`` cuts it; with ``piece``,
    pieces of that length instead (a padded array's), clipped at ``n``."""
    piece = -(-n // k) if piece is None else piece
    start = min(i * piece, n)
    return start, min(start + piece, n)


def entry_split(entry: SpecEntry, mesh: Mesh, coords: dict[str, int]) -> tuple[int, int]:
    """(number of pieces, this rank's piece index) for one spec entry; axes are major to minor."""
    k, i = 1, 0
    for axis in entry_axes(entry):
        size = mesh.axis_size(axis)
        k, i = k * size, i * size + coords[axis]
    return k, i


def split_counts(ndim: int, spec: P, mesh: Mesh) -> tuple[int, ...]:
    return tuple(math.prod(mesh.axis_size(a) for a in entry_axes(e)) for e in spec.padded(ndim))


def shard_box(shape: Sequence[int], spec: P, mesh: Mesh, rank: int, shard: Sequence[int] | None = None) -> Box:
    """The box of the global array that ``rank`` holds under ``spec``; ``shard`` gives the
    pieces' lengths where they are not ``torch.chunk``'s (a padded array's)."""
    return _shard_box(tuple(shape), spec, mesh, rank, None if shard is None else tuple(shard))


# Layers repeat a handful of (shape, spec) pairs, and a save and a load each ask for every
# array's box: cached, that is a lookup (P and Mesh are frozen, hashable values).
@functools.lru_cache(maxsize=16384)
def _shard_box(shape: tuple[int, ...], spec: P, mesh: Mesh, rank: int, shard: tuple[int, ...] | None) -> Box:
    coords = mesh.coords(rank)
    pieces = shard if shard is not None else (None,) * len(shape)
    return tuple(
        split_range(n, *entry_split(e, mesh, coords), piece)
        for n, e, piece in zip(shape, spec.padded(len(shape)), pieces)
    )


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in box)


def box_size(box: Box) -> int:
    return math.prod(box_shape(box))


def box_view(a: Any, box: Box, origin: Sequence[int] | None = None) -> Any:
    """The view of the array ``a`` (whose first element is at ``origin``, default 0s) that holds
    ``box``; a 0-d array's box ``()`` gives a 0-d view, where ``a[()]`` would give a scalar."""
    origin = origin if origin is not None else (0,) * len(box)
    return a[(*(slice(lo - o, hi - o) for (lo, hi), o in zip(box, origin)), ...)]


def shard_shape(shape: Sequence[int], spec: P, mesh: Mesh, shard: Sequence[int] | None = None) -> tuple[int, ...]:
    """The regular chunk grid whose chunks are exactly the boxes (at least 1 along each dim)."""
    if shard is not None:
        return tuple(max(1, s) for s in shard)
    return tuple(max(1, -(-n // k)) for n, k in zip(shape, split_counts(len(shape), spec, mesh)))


@functools.lru_cache(maxsize=4096)
def _smallest_factor(n: int) -> int:
    return next((f for f in range(2, math.isqrt(n) + 1) if n % f == 0), n)


# Small shards are still cut into about this many inner chunks, down to the smallest size.
CHUNKS_PER_SHARD = 16
MIN_INNER_CHUNK_BYTES = 32 << 10
# Chunks let another layout split any dimension of a shard this many ways and read whole chunks.
READER_SPLITS = 8
MIN_RUN_BYTES = 256


def chunk_target(outer: Sequence[int], itemsize: int, inner_chunk_bytes: int) -> int:
    """The inner chunk size for a shard of shape ``outer``: ``inner_chunk_bytes``, or less.

    A shard no bigger than one chunk would be one chunk, and a layout that reads half its
    columns would read all of it. So a shard is cut into at least about ``CHUNKS_PER_SHARD``
    chunks (a 4x4 grid of a matrix), unless chunks would fall below ``MIN_INNER_CHUNK_BYTES``,
    where per-chunk costs start to show.
    """
    shard_bytes = itemsize * math.prod(outer)
    return min(inner_chunk_bytes, max(MIN_INNER_CHUNK_BYTES, shard_bytes // CHUNKS_PER_SHARD))


def inner_chunk_shape(
    outer: Sequence[int], itemsize: int, target_bytes: int, *, splits: int = 1, min_bytes: int = 0
) -> tuple[int, ...]:
    """A block of ``outer`` that divides it and holds at most about ``target_bytes``.

    No cut takes the block below ``min_bytes``, even if it stays above the target.

    First, with ``splits > 1``, every side is cut (by factors up to 7) until it is at most
    ``1 / splits`` of the shard's, while the block keeps ``min_bytes``: a layout that splits any
    dimension of the shard up to ``splits`` ways then reads whole blocks. Cubes alone do not give
    that: a 2 MiB block of an (8000, 1024) bf16 shard is (1000, 1024), whole rows, and a reader
    of a quarter of the columns would read all of it.

    Then the block is kept as close to a cube as the divisors allow: the longest side is cut
    first, by its smallest prime factor. Another layout may read rows or columns of this shard;
    with balanced blocks either kind of request, aligned to blocks, reads no byte it does not
    need, where row-strip chunks would make every column reader fetch the whole shard. Sides
    with only large prime factors are cut last, so a prime side does not collapse to 1 needlessly.
    """
    inner = list(outer)
    while splits > 1:
        cuttable = [
            d
            for d in range(len(inner))
            if inner[d] > 1
            and inner[d] * splits > outer[d]
            and _smallest_factor(inner[d]) <= 7
            and itemsize * math.prod(inner) // _smallest_factor(inner[d]) >= min_bytes
            # Rows of the last dimension are what gets copied in one run: not below 256 bytes.
            and (d < len(inner) - 1 or itemsize * inner[d] // _smallest_factor(inner[d]) >= MIN_RUN_BYTES)
        ]
        if not cuttable:
            break
        d = max(cuttable, key=lambda i: (inner[i], -i))
        inner[d] //= _smallest_factor(inner[d])
    while itemsize * math.prod(inner) > target_bytes:
        # A cut that leaves less than min_bytes is not taken: when only a large prime is left
        # to cut by, a bigger chunk beats a flood of tiny ones (a 393,218-element side would
        # go 2 x 196,609 -> chunks of one element).
        size = itemsize * math.prod(inner)
        cuttable = [d for d in range(len(inner)) if inner[d] > 1 and size // _smallest_factor(inner[d]) >= min_bytes]
        if not cuttable:
            break
        gentle = [d for d in cuttable if _smallest_factor(inner[d]) <= 7] or cuttable
        d = max(gentle, key=lambda i: (inner[i], -i))
        inner[d] //= _smallest_factor(inner[d])
    return tuple(inner)


def chunk_shape_for(outer: Sequence[int], itemsize: int, inner_chunk_bytes: int) -> tuple[int, ...]:
    """The inner chunk shape a save uses for a shard of shape ``outer``."""
    return _chunk_shape_for(tuple(outer), itemsize, inner_chunk_bytes)


# A model repeats a few shard shapes hundreds of times (one per layer), and every save asks
# again: cached, a repeated shape costs a dictionary lookup.
@functools.lru_cache(maxsize=4096)
def _chunk_shape_for(outer: tuple[int, ...], itemsize: int, inner_chunk_bytes: int) -> tuple[int, ...]:
    target = chunk_target(outer, itemsize, inner_chunk_bytes)
    return inner_chunk_shape(
        outer, itemsize, target, splits=READER_SPLITS, min_bytes=min(target, MIN_INNER_CHUNK_BYTES)
    )


def global_shape_from_sums(
    name: str,
    spec: P,
    mesh: Mesh,
    sums: Sequence[int],
    mins: Sequence[int],
    maxs: Sequence[int],
    holders: int | None = None,
) -> tuple[int, ...]:
    """Recover the global shape from the sums, minima and maxima of every rank's local shape.

    Every piece of a split dimension is held by ``holders / k`` ranks (``holders``: the ranks
    holding the array, all by default), so the global size is the sum of local sizes divided by
    that; an unsplit dimension must be the same on every rank holding it.
    """
    world = mesh.size if holders is None else holders
    shape = []
    for d, (k, total, lo, hi) in enumerate(zip(split_counts(len(sums), spec, mesh), sums, mins, maxs)):
        if k == 1:
            if lo != hi:
                raise InconsistentShardsError(
                    f"array {name!r}: dimension {d} is not split by spec {spec!r} but its local size "
                    f"ranges from {lo} to {hi} across ranks; every rank must hold the whole dimension"
                )
            shape.append(hi)
        else:
            holders = world // k
            if total % holders:
                raise InconsistentShardsError(
                    f"array {name!r}: the local sizes of dimension {d}, split {k} ways by {spec!r}, "
                    f"sum to {total}, which the {holders} replicas of each piece cannot hold equally"
                )
            shape.append(total // holders)
    return tuple(shape)


@attrs.frozen
class ArraySpec:
    """What the planner needs to know of one array."""

    name: str
    shape: tuple[int, ...]
    spec: P
    itemsize: int
    # The mesh the spec names, where it is not the layout's (a DTensor's own mesh); same size.
    mesh: Mesh | None = None
    # The pieces' lengths, where they are not torch.chunk's (a padded array's).
    piece: tuple[int, ...] | None = None
    # Where names differ along ``stage_axes``: the stage coordinates holding the array (None: all).
    stage_axes: tuple[str, ...] = ()
    stages: tuple[tuple[int, ...], ...] | None = None


def _piece_ids(a: ArraySpec, mesh: Mesh, coords: np.ndarray) -> np.ndarray:
    """For every row of mesh coordinates, the index of the piece (distinct box) it holds.

    Pieces are numbered row-major over the dimensions' piece indices: the spec's axes, in
    order, are the digits.
    """
    ids = np.zeros(len(coords), dtype=np.int64)
    for axis in a.spec.axes:
        ids = ids * mesh.axis_size(axis) + coords[:, mesh.axis_names.index(axis)]
    return ids


def _piece_index(spec: P, mesh: Mesh, coords: dict[str, int]) -> int:
    """The index of the piece a rank with these coordinates holds (one row of ``_piece_ids``)."""
    index = 0
    for axis in spec.axes:
        index = index * mesh.axis_size(axis) + coords[axis]
    return index


def _mesh_coords(mesh: Mesh) -> np.ndarray:
    grid = np.indices([size for _, size in mesh.axes], dtype=np.int64)
    return grid.reshape(len(mesh.axes), mesh.size).T


def _replicas(mesh: Mesh, axes: tuple[str, ...]) -> np.ndarray:
    """A (pieces, replicas) array: row ``p`` lists, ascending, the ranks holding piece ``p`` of
    an array whose spec names ``axes`` (in this order) on ``mesh``.

    Ranks are row-major over the mesh axes; moving the spec's axes to the front, in spec
    order, makes the piece index the leading digits and leaves the replicas' ranks ascending.
    """
    names = mesh.axis_names
    sizes = [size for _, size in mesh.axes]
    pieces = math.prod(mesh.axis_size(axis) for axis in axes)
    order = [names.index(axis) for axis in axes] + [d for d, name in enumerate(names) if name not in axes]
    return np.arange(mesh.size, dtype=np.int64).reshape(sizes).transpose(order).reshape(pieces, -1)


@functools.lru_cache(maxsize=64)
def piece_holders(mesh: Mesh, axes: tuple[str, ...]) -> np.ndarray:
    """``_replicas``, read-only and worked out once: the ranks that may have written each piece
    of an array whose spec names ``axes`` (a reader of a packed checkpoint asks per array)."""
    out = _replicas(mesh, axes)
    out.flags.writeable = False
    return out


def _holders(
    group: np.ndarray, mesh: Mesh, axes: tuple[str, ...], stages: tuple[tuple[int, ...], ...] | None
) -> np.ndarray:
    """The replicas of ``_replicas`` that hold the array: all, or those at the ``stages``
    coordinates of the stage ``axes`` (which a stage-held array's spec never names, so every
    row has its replicas at the same stage coordinates)."""
    if stages is None:
        return group
    sizes = [size for _, size in mesh.axes]
    coords = np.unravel_index(group[0], sizes)
    at = np.stack([coords[mesh.axis_names.index(a)] for a in axes], axis=1)
    held = np.array([tuple(row) in set(stages) for row in at.tolist()], dtype=bool)
    return group[:, held]


def _piece_bytes(a: ArraySpec, mesh: Mesh) -> np.ndarray:
    """The bytes of every piece of ``a``, by piece index (see ``_piece_ids``)."""
    nbytes = np.full(1, a.itemsize, dtype=np.int64)
    for lengths in _piece_lengths(a, mesh):
        nbytes = np.multiply.outer(nbytes, lengths).reshape(-1)
    return nbytes


def _piece_lengths(a: ArraySpec, mesh: Mesh) -> list[np.ndarray]:
    """For every dimension, the length of each of its pieces."""
    out = []
    pieces = a.piece if a.piece is not None else (None,) * len(a.shape)
    for n, k, piece in zip(a.shape, split_counts(len(a.shape), a.spec, mesh), pieces):
        piece = -(-n // k) if piece is None else piece
        starts = np.minimum(np.arange(k, dtype=np.int64) * piece, n)
        out.append(np.minimum(starts + piece, n) - starts)
    return out


# Replica-parallel writes: a box held by several replicas is cut along one dimension into up to
# that many stored shards, each written by another replica, each at most the unit of balance:
# a fifth of a rank's mean share of the state (so no rank writes more than 1.2 times the mean,
# give or take rounding), and no cut below this.
MIN_SPLIT_BYTES = 4 << 20


@attrs.frozen
class Split:
    """How an array's boxes are stored: in shards of ``shard``, ``parts`` per box along ``dim``
    (``parts`` 1: one shard per box)."""

    shard: tuple[int, ...]
    dim: int = 0
    parts: int = 1


def stored_shards(arrays: Sequence[ArraySpec], mesh: Mesh) -> list[tuple[int, ...]]:
    """The stored shard shape of every array: its boxes, cut where replicas share the write."""
    return [split.shard for split in _splits(tuple(arrays), mesh)]


def _splits(arrays: tuple[ArraySpec, ...], mesh: Mesh) -> tuple[Split, ...]:
    try:
        return _splits_cached(arrays, mesh)
    except TypeError:  # unhashable fields (a list for a shape): plan without the cache
        return _compute_splits(arrays, mesh)


def _compute_splits(arrays: tuple[ArraySpec, ...], mesh: Mesh) -> tuple[Split, ...]:
    total = sum(a.itemsize * math.prod(a.shape) for a in arrays)
    unit = max(MIN_SPLIT_BYTES, total // (5 * mesh.size))
    return tuple(_split(a, a.mesh or mesh, unit) for a in arrays)


# A save and its plan ask for the same state's splits several times: computed once.
_splits_cached = functools.lru_cache(maxsize=4)(_compute_splits)


def _replica_count(a: ArraySpec, mesh: Mesh) -> int:
    replicas = mesh.size // math.prod(mesh.axis_size(axis) for axis in a.spec.axes)
    if a.stages is not None:
        replicas = replicas * len(a.stages) // math.prod(mesh.axis_size(axis) for axis in a.stage_axes)
    return replicas


def _split(a: ArraySpec, mesh: Mesh, unit: int) -> Split:
    """Cut ``a``'s boxes into as many parts (up to its replicas) as keep each at least ``unit``
    bytes, along the dimension that allows the most; a dimension the spec splits is cut only
    by a divisor of its pieces' length, so that every piece is whole shards."""
    piece = shard_shape(a.shape, a.spec, mesh, a.piece)
    nbytes = a.itemsize * math.prod(piece)
    # Parts of at most ``unit``: a rank's load then exceeds the mean by less than one part.
    wanted = min(_replica_count(a, mesh), -(-nbytes // unit) if nbytes >= 2 * unit else 1)
    best = Split(piece)
    if wanted < 2:
        return best
    for d, (length, k) in enumerate(zip(piece, split_counts(len(a.shape), a.spec, mesh))):
        if k == 1:
            sub = -(-length // min(wanted, length))
        else:
            sub = length // next(f for f in range(min(wanted, length), 0, -1) if length % f == 0)
        parts = -(-length // sub)
        if parts > best.parts:
            best = Split((*piece[:d], sub, *piece[d + 1 :]), d, parts)
    return best


def _unit_bytes(a: ArraySpec, mesh: Mesh, split: Split) -> np.ndarray:
    """A (pieces, parts) array: the bytes of each stored shard of each piece of ``a``."""
    if split.parts == 1:
        return _piece_bytes(a, mesh)[:, None]
    lengths = _piece_lengths(a, mesh)
    other = np.full(1, a.itemsize, dtype=np.int64)
    for d, dim_lengths in enumerate(lengths):
        factor = np.ones(len(dim_lengths), dtype=np.int64) if d == split.dim else dim_lengths
        other = np.multiply.outer(other, factor).reshape(-1)
    stride = math.prod(len(x) for x in lengths[split.dim + 1 :])
    along = lengths[split.dim][(np.arange(len(other)) // stride) % len(lengths[split.dim])]
    sub = split.shard[split.dim]
    units = np.clip(along[:, None] - np.arange(split.parts) * sub, 0, sub)
    return other[:, None] * units


def _assign(arrays: tuple[ArraySpec, ...], mesh: Mesh) -> tuple[np.ndarray, ...]:
    """For every array, a (pieces, parts) array: the writer of each stored shard of each piece
    (by piece index; -1 for empty shards).

    The rule of ``assign_writers``, computed a block at a time: a block is the shards of one
    array that have one size, and the global order (size descending, array order, piece index)
    is the order of the blocks. The pieces of one array have disjoint replica sets, so each
    choice in a block reads and changes the loads of its own replicas only; the shards of one
    piece go to its least-loaded replicas in order, each to a different one.
    """
    replicas: dict[Any, np.ndarray] = {}
    units: dict[Any, tuple[np.ndarray, np.ndarray]] = {}
    members, nbytes, blocks = [], [], []
    for index, (a, split) in enumerate(zip(arrays, _splits(arrays, mesh))):
        m = a.mesh or mesh
        key = (m, a.spec.axes, a.stage_axes, a.stages)
        if key not in replicas:
            replicas[key] = _holders(_replicas(m, a.spec.axes), m, a.stage_axes, a.stages)
        members.append(replicas[key])
        shape = (tuple(a.shape), a.spec, a.itemsize, m, a.piece, split)
        if shape not in units:
            unit_bytes = _unit_bytes(a, m, split)
            units[shape] = unit_bytes, np.unique(unit_bytes)
        unit_bytes, distinct = units[shape]
        nbytes.append(unit_bytes)
        blocks += [(-size, index, len(distinct) == 1) for size in distinct.tolist() if size > 0]
    blocks.sort()
    loads = np.zeros(mesh.size, dtype=np.int64)
    # int32: ranks fit, and a fully sharded state has as many pieces as arrays times ranks.
    writers = [np.full(b.shape, -1, dtype=np.int32) for b in nbytes]
    for neg_size, index, whole in blocks:
        _assign_block(members[index], nbytes[index] == -neg_size, whole, loads, writers[index], -neg_size)
    for w in writers:
        w.flags.writeable = False
    return tuple(writers)


def _assign_block(
    members: np.ndarray, mask: np.ndarray, whole: bool, loads: np.ndarray, writers: np.ndarray, size: int
) -> None:
    """Give the shards ``mask`` marks (all of one size) to the least-loaded replicas of their
    pieces (ties to the lowest rank), and count their bytes in ``loads``."""
    if mask.shape[1] == 1:
        ids = slice(None) if whole else mask[:, 0]
        group = members[ids]
        # argmin takes the first least-loaded replica: rows are ascending, so the lowest rank.
        chosen = group[:, 0] if group.shape[1] == 1 else group[np.arange(len(group)), loads[group].argmin(axis=1)]
        loads[chosen] += size
        writers[ids, 0] = chosen
        return
    rows = np.flatnonzero(mask.any(axis=1))
    counts = mask[rows].sum(axis=1)
    order = np.argsort(loads[members[rows]], axis=1, kind="stable")
    for c in np.unique(counts).tolist():
        these = rows[counts == c]
        chosen = np.take_along_axis(members[these], order[counts == c][:, :c], axis=1)
        cols = np.nonzero(mask[these])[1].reshape(-1, c)
        writers[these[:, None], cols] = chosen
        loads[chosen.reshape(-1)] += size


# Saves of the same state plan the same assignment again; a process planning for many ranks
# (tests, benchmarks, tools) computes it once.
_writers_by_piece = functools.lru_cache(maxsize=4)(_assign)


def _writers(arrays: Sequence[ArraySpec], mesh: Mesh) -> tuple[np.ndarray, ...]:
    key = tuple(arrays)
    try:
        return _writers_by_piece(key, mesh)
    except TypeError:  # unhashable fields (a list for a shape): plan without the cache
        return _assign(key, mesh)


def assign_writers(arrays: Sequence[ArraySpec], mesh: Mesh) -> list[np.ndarray]:
    """For every array, an int array mapping each rank to the rank that writes its piece; a
    (ranks, parts) array where pieces are stored as several shards (``stored_shards``).

    Among the replicas of a piece exactly one rank writes each of its shards: shards are taken
    largest first (ties by array order, then piece index) and each goes to its least-loaded
    replica (ties to the lowest rank), the shards of one piece to different replicas. Empty
    shards have no writer (-1).
    """
    coords: dict[Mesh, np.ndarray] = {}
    out = []
    for a, by_piece in zip(arrays, _writers(arrays, mesh)):
        m = a.mesh or mesh
        if m not in coords:
            coords[m] = _mesh_coords(m)
        writers = by_piece[_piece_ids(a, m, coords[m])].astype(np.int64)
        out.append(writers[:, 0] if writers.shape[1] == 1 else writers)
    return out


def writer_rules(arrays: Sequence[ArraySpec], mesh: Mesh) -> list[tuple[int, int] | None]:
    """For every array, ``(start, step)`` where the rank that writes each of its stored shards
    is ``start + step * i``, ``i`` the shard's index in C order over its grid; None where no
    such rule holds (shards cut from replicated pieces go to the least-loaded replicas).

    An array stored as one shard has one, and so does an array without replicas whose spec
    names the mesh's axes in the mesh's order (FSDP, tensor parallelism alone). A reader of a
    packed checkpoint uses it to find a shard in its writer's own index, which holds a world's
    fraction of the keys (``storage/_packindex``).
    """
    out: list[tuple[int, int] | None] = []
    for a, split, by_piece in zip(arrays, _splits(tuple(arrays), mesh), _writers(arrays, mesh)):
        out.append(_writer_rule(a, a.mesh or mesh, split, by_piece) if by_piece.shape[1] == 1 else None)
    return out


def _writer_rule(a: ArraySpec, mesh: Mesh, split: Split, by_piece: np.ndarray) -> tuple[int, int] | None:
    """``writer_rules`` of one array whose pieces are stored whole (shard ``i`` is piece ``i``
    but for pieces past the array's end, which are empty and have no writer)."""
    writers = by_piece[:, 0]
    counts = split_counts(len(a.shape), a.spec, mesh)
    grid = tuple(-(-n // s) if s else 0 for n, s in zip(a.shape, split.shard))
    if grid == counts:  # the common case: every piece is a shard (an affine rule: none empty)
        rule = _affine(np.arange(len(writers)), writers)
        return rule if rule is not None and writers[-1] >= 0 else None
    coords = np.unravel_index(np.arange(len(writers)), counts) if counts else ()
    stored = writers >= 0
    for c, g in zip(coords, grid):
        stored &= c < g
    if not stored.any():
        return None
    cells = np.ravel_multi_index(tuple(c[stored] for c in coords), grid) if grid else np.zeros(1, np.int64)
    return _affine(cells, writers[stored])


def _affine(x: np.ndarray, y: np.ndarray) -> tuple[int, int] | None:
    """``(start, step)`` with ``y == start + step * x`` throughout, or None."""
    if len(x) == 0:
        return None
    step = 0 if len(x) == 1 else int(y[1] - y[0]) // max(int(x[1] - x[0]), 1)
    start = int(y[0]) - step * int(x[0])
    if start < 0 or (len(x) > 2 and y[2] != start + step * x[2]):  # most misses show at once
        return None
    return (start, step) if np.array_equal(y, start + step * x) else None


def writes_of(arrays: Sequence[ArraySpec], mesh: Mesh, rank: int) -> list[tuple[int, Box]]:
    """(array index, box) of every stored shard that ``rank`` writes.

    The assignment is global (every rank computes the same), but only this rank's entries
    are looked up: planning costs memory in the number of pieces, not arrays times ranks.
    """
    coords: dict[Mesh, dict[str, int]] = {}
    out = []
    splits = _splits(tuple(arrays), mesh)
    for index, (a, by_piece) in enumerate(zip(arrays, _writers(arrays, mesh))):
        m = a.mesh or mesh
        if m not in coords:
            coords[m] = m.coords(rank)
        row = by_piece[_piece_index(a.spec, m, coords[m])]
        mine = np.flatnonzero(row == rank).tolist()
        if not mine:
            continue
        box = shard_box(a.shape, a.spec, m, rank, a.piece)
        shards = shard_pieces(box, splits[index].shard) if len(row) > 1 else [box]
        out += [(index, shards[j]) for j in mine]
    return out


def shard_cell(box: Box, shape: Sequence[int], shard_shape: Sequence[int]) -> tuple[int, ...] | None:
    """The shard grid cell ``box`` covers exactly (clipped at the array's edge), or None where
    the box is part of a shard, spans several or is empty."""
    cell = []
    for (a, b), n, s in zip(box, shape, shard_shape):
        if a >= b or a % s or b != min(a + s, n):
            return None
        cell.append(a // s)
    return tuple(cell)


def chunks_touched(box: Box, chunk: Sequence[int]) -> int:
    """How many chunks of a regular grid of ``chunk`` the box overlaps."""
    count = 1
    for (start, stop), c in zip(box, chunk):
        if stop <= start:
            return 0
        count *= (stop - 1) // c - start // c + 1
    return count


def row_pieces(box: Box, rows: int, itemsize: int, piece_bytes: int) -> list[Box]:
    """``box`` cut along its first dimension at multiples of ``rows`` (an inner chunk's first
    dimension) into pieces of about ``piece_bytes``, so that no inner chunk is read by two
    pieces; the box itself where it is small enough or one chunk row deep."""
    shape = box_shape(box)
    nbytes = itemsize * math.prod(shape)
    if not box or nbytes <= piece_bytes or shape[0] <= rows:
        return [box]
    row_bytes = max(1, nbytes // shape[0])
    per_piece = max(rows, piece_bytes // row_bytes // rows * rows)
    start, stop = box[0]
    cuts = [start, *range(start // rows * rows + per_piece, stop, per_piece), stop]
    return [((a, b), *box[1:]) for a, b in itertools.pairwise(cuts)]


def shard_pieces(box: Box, shard_shape: Sequence[int]) -> list[Box]:
    """``box`` cut along the shard grid: one piece per stored shard it overlaps, in grid order."""
    per_dim = [
        [(max(a, c * s), min(b, (c + 1) * s)) for c in range(a // s, (b - 1) // s + 1)]
        for (a, b), s in zip(box, shard_shape)
    ]
    return [tuple(piece) for piece in itertools.product(*per_dim)]


# Ranks holding one box that share its read (``load(..., share_reads=True)``), at most: each
# sends its part to every other, so a rank's sends per box stay below this many while storage
# serves each box this many times less.
SHARE_GROUP = 8


def sharing_ranks(mesh: Mesh, spec: P, rank: int, stages: Sequence[str] = ()) -> tuple[int, ...]:
    """The ranks that share the read of ``rank``'s box under ``spec``, in rank order, ``rank``
    among them: the ranks at its coordinates along the axes the spec splits by and the
    ``stages`` axes (whose ranks hold other arrays), which hold the same box; in consecutive
    groups of at most ``SHARE_GROUP``."""
    used = {a for entry in spec for a in entry_axes(entry)} | set(stages)
    coords = mesh.coords(rank)
    free = [(a, mesh.axis_size(a)) for a in mesh.axis_names if a not in used]
    # The holders differ from ``rank`` along the free axes alone, so in rank order they run
    # through those axes' coordinates row-major: the group is found without listing them all
    # (a replicated array has as many holders as the world).
    at = 0
    for a, n in free:
        at = at * n + coords[a]
    first = at // SHARE_GROUP * SHARE_GROUP
    group = []
    for i in range(first, min(first + SHARE_GROUP, math.prod(n for _, n in free))):
        place = dict(coords)
        for a, n in reversed(free):
            i, place[a] = divmod(i, n)
        group.append(mesh.rank_of(place))
    return tuple(group)


def shared_parts(box: Box, rows: int, readers: int, offset: int = 0) -> list[Box | None]:
    """``box`` cut along its first dimension into ``readers`` parts, one per reader, at multiples
    of ``rows`` (an inner chunk's first dimension), so that no inner chunk is read by two of
    them; as even as whole chunk rows allow. Where there are fewer chunk rows than readers,
    some readers get None; ``offset`` rotates which (reader ``i`` takes part ``(i + offset) %
    readers``), so that many small boxes do not all fall to the first reader. A 0-d box is
    one part."""
    if not box:
        parts: list[Box | None] = [box] + [None] * (readers - 1)
    else:
        start, stop = box[0]
        cuts = [start, *range(start // rows * rows + rows, stop, rows), stop]
        units = len(cuts) - 1
        edges = [cuts[units * j // readers] for j in range(readers)] + [stop]
        parts = [((a, b), *box[1:]) if b > a else None for a, b in itertools.pairwise(edges)]
    return [parts[(i + offset) % readers] for i in range(readers)]
