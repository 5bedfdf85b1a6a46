"""Read plans: what a load under a target layout would fetch, rank by rank, without reading.

Pure, like ``_plan``: a function of the checkpoint's metadata, the target layout and a rank.
It follows the loader (``_load``): every leaf of the saved tree gets its box from the target
layout, leaves tied to one stored array read each distinct box once, and empty boxes read
nothing. Reading a box fetches, from every shard it overlaps, the shard's index and every
inner chunk it overlaps, whole (a chunk at the array's edge is stored padded).

*Read amplification* is the bytes of the inner chunks fetched over the bytes the boxes hold:
1.0 when every target box is a union of whole inner chunks. Index and checksum bytes are
counted apart, as ``overhead_bytes``. For uncompressed arrays ``bytes_read + overhead_bytes``
is what a load fetches from storage (checked in ``tests/integration/test_cli.py``): exactly, from a local
directory, whose shard files the loader reads itself (``_shardread.read_box``: each shard's index
once per box, then its chunks); but for a few bytes from an object store, where TensorStore
reads a box over ``IOConfig.piece_bytes`` in pieces and shares one fetch of a shard's index only
among reads in flight together, so a piece issued after the others are done (past the loader's
bytes-in-flight budget, say) fetches the index again: 16 bytes per inner chunk of the shard.
For compressed arrays ``bytes_read`` counts decoded bytes; storage returns fewer.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence

import attrs

from ..base._errors import LayoutError
from ..base._options import DEFAULT_IO, IOConfig
from ..format._dtypes import numpy_dtype
from ..format._format import ArrayMeta, CheckpointMeta
from ..format._shard import BINDING_BYTES, CRC_BYTES, INDEX_ENTRY_BYTES
from ..layout._layout import Layout
from ..layout._plan import Box, box_size, chunks_touched, row_pieces, shard_box
from ..layout._spec import P, check_spec
from ..layout._tree import leaf_nodes


@attrs.frozen
class BoxRead:
    """One box of one stored array that a rank reads, and what reading it costs."""

    array: str
    box: Box
    chunks: int  # inner chunks fetched
    shards: int  # shards overlapped: one index fetched from each
    bytes_needed: int
    bytes_read: int  # bytes of the inner chunks fetched, decoded
    overhead_bytes: int  # shard indexes and checksums
    compressed: bool = False

    @property
    def amplification(self) -> float:
        return self.bytes_read / self.bytes_needed if self.bytes_needed else 1.0


@attrs.frozen
class RankReads:
    """Every read one rank of the target layout issues."""

    rank: int
    reads: tuple[BoxRead, ...]

    @property
    def chunks(self) -> int:
        return sum(r.chunks for r in self.reads)

    @property
    def bytes_needed(self) -> int:
        return sum(r.bytes_needed for r in self.reads)

    @property
    def bytes_read(self) -> int:
        return sum(r.bytes_read for r in self.reads)

    @property
    def overhead_bytes(self) -> int:
        return sum(r.overhead_bytes for r in self.reads)

    @property
    def amplification(self) -> float:
        return self.bytes_read / self.bytes_needed if self.bytes_needed else 1.0


def target_boxes(
    meta: CheckpointMeta, layout: Layout, rank: int, select: Callable[[str], bool] | None = None
) -> list[tuple[str, Box]]:
    """(stored array, box) of every distinct read ``rank`` makes under ``layout``, in tree order.

    As ``load`` plans them: the spec is the one the layout gives the leaf's own name (a tied
    name may get another box than the array it shares), checked against the stored shape.
    """
    out: dict[tuple[str, Box], None] = {}
    for name, node in leaf_nodes(meta.tree):
        stored = node.get("array")
        if stored is None or (select is not None and not select(name)):
            continue
        a = meta.arrays[stored]
        spec = layout.spec_for(name)
        if not isinstance(spec, P):
            raise LayoutError(
                f"array {name!r}: the layout gives it {spec!r}; read plans cover P(...) rules only, not flat buffers"
            )
        check_spec(spec, layout.mesh, len(a.shape), name, a.shape)
        box = shard_box(a.shape, spec, layout.mesh, rank)
        if box_size(box) > 0:
            out[(stored, box)] = None
    return list(out)


def read_pieces(a: ArrayMeta, box: Box, io: IOConfig = DEFAULT_IO) -> list[Box]:
    """The reads the read engine issues for ``box`` on an object store: the box, or pieces of
    whole inner-chunk rows of about ``io.piece_bytes`` each (``TensorStoreReader.pieces``)."""
    rows = a.inner_chunk_shape[0] if a.inner_chunk_shape else 1
    return row_pieces(box, rows, numpy_dtype(a.dtype).itemsize, io.piece_bytes)


def box_read(name: str, a: ArrayMeta, box: Box) -> BoxRead:
    """What reading ``box`` of array ``a`` (stored as ``name``) fetches."""
    # Whether the shards are bound is part of the key: array documents compare equal without it.
    return _box_read(name, a, box, a.bound_to is not None)


# Cached: the replicas of a piece read the same boxes, so a plan for many ranks repeats them.
@functools.lru_cache(maxsize=4096)
def _box_read(name: str, a: ArrayMeta, box: Box, bound: bool) -> BoxRead:
    """``box_read``; a bound array's reads fetch each shard's binding block with its index."""
    itemsize = numpy_dtype(a.dtype).itemsize
    per_shard = math.prod(s // c for s, c in zip(a.shard_shape, a.inner_chunk_shape))
    # The inner grid starts at every shard's corner and the inner chunk divides the shard, so
    # it is one global grid: the chunks a box overlaps are counted on it directly.
    chunks = chunks_touched(box, a.inner_chunk_shape)
    shards = chunks_touched(box, a.shard_shape)
    return BoxRead(
        array=name,
        box=box,
        chunks=chunks,
        shards=shards,
        bytes_needed=itemsize * box_size(box),
        bytes_read=chunks * itemsize * math.prod(a.inner_chunk_shape),
        overhead_bytes=chunks * CRC_BYTES
        + shards * (INDEX_ENTRY_BYTES * per_shard + CRC_BYTES + (BINDING_BYTES if bound else 0)),
        compressed=a.compression is not None,
    )


def rank_reads(
    meta: CheckpointMeta, layout: Layout, rank: int, select: Callable[[str], bool] | None = None
) -> RankReads:
    """Every read ``rank`` makes when loading the checkpoint of ``meta`` under ``layout``."""
    reads = tuple(box_read(name, meta.arrays[name], box) for name, box in target_boxes(meta, layout, rank, select))
    return RankReads(rank, reads)


def plan_reads(
    meta: CheckpointMeta,
    layout: Layout,
    ranks: Iterable[int] | None = None,
    select: Callable[[str], bool] | None = None,
) -> list[RankReads]:
    """``rank_reads`` for ``ranks`` (default: every rank of the layout's mesh)."""
    chosen: Sequence[int] = range(layout.mesh.size) if ranks is None else list(ranks)
    for rank in chosen:
        layout.mesh.coords(rank)  # a rank outside the mesh: a LayoutError naming it
    return [rank_reads(meta, layout, rank, select) for rank in chosen]


def bytes_per_replica(meta: CheckpointMeta) -> int:
    """The bytes of every stored array once: what one whole copy of the checkpoint holds."""
    return sum(math.prod(a.shape) * numpy_dtype(a.dtype).itemsize for a in meta.arrays.values())
