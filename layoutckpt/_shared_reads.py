"""Loads whose replicas share their reads (``load(..., share_reads=True)``).

A box that several ranks load (an array replicated over data-parallel ranks, a tensor-parallel
shard held by every data-parallel replica) is read from storage by each of them, so storage
serves it once per replica: at scale, hundreds of times the checkpoint. With shared reads, the
ranks holding one box (up to ``_plan.SHARE_GROUP`` of them) each read one part of it, whole
inner-chunk rows, and send their part to the others, which receive it straight into their
destination: storage serves each box once per group, and the reads stay exact.

The groups follow from the layout alone (``_plan.sharing_ranks``), so every rank plans them on
its own. One collective checks that the ranks of each pipeline stage load the same arrays with
the same specs, which makes every rank's groups agree; where they do not, every rank reads its
own boxes, as without the option.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping

import attrs
import numpy as np

from .format._dtypes import numpy_dtype
from .format._format import ArrayMeta
from .layout import _plan
from .layout._spec import Mesh, P
from .torch._dist import Comm, digest

Target = tuple[str, _plan.Box]
# The mesh and spec that place a box, and what else decides it that every rank of a stage must
# agree on: for a part of a fused or padded leaf, the view and the template's shape ("" else).
Holding = tuple[Mesh, P, str]


@attrs.frozen
class Sharing:
    """How one rank reads a box it shares: the sharers in rank order, each one's part (None
    where it reads none), and this rank's own."""

    ranks: tuple[int, ...]
    parts: tuple[_plan.Box | None, ...]
    mine: _plan.Box | None


@attrs.frozen
class Shared:
    """A shared box's destination, and how its parts are read."""

    out: np.ndarray = attrs.field(eq=False)
    sharing: Sharing


Stages = tuple[Mesh, tuple[str, ...]]  # the layout's mesh and its stage axes


def plan(
    holders: Mapping[Target, Holding], arrays: Mapping[str, ArrayMeta], rank: int, stages: Stages | None
) -> dict[Target, Sharing]:
    """The boxes this rank shares, each with its sharers and their parts (pure). ``holders``
    gives each box's mesh and spec; ranks at other coordinates of the stage axes hold other
    arrays, and share nothing."""
    out = {}
    for (stored, box), (mesh, spec, _) in holders.items():
        fixed = [a for a in stages[1] if a in mesh.axis_names] if stages is not None else []
        ranks = _plan.sharing_ranks(mesh, spec, rank, fixed)
        if len(ranks) < 2:
            continue
        meta = arrays[stored]
        rows = meta.inner_chunk_shape[0] if meta.inner_chunk_shape else 1
        # Where parts are fewer than sharers, which sharer reads depends on the array, the
        # same on every rank: small arrays spread over the sharers.
        parts = tuple(_plan.shared_parts(box, rows, len(ranks), zlib.crc32(stored.encode())))
        out[(stored, box)] = Sharing(ranks, parts, parts[ranks.index(rank)])
    return out


def agree(comm: Comm, stages: Stages | None, holders: Mapping[Target, Holding], lent: set[Target]) -> bool:
    """Whether every rank may share: the ranks of each pipeline stage load the same arrays with
    the same meshes, specs and views, and lend (``BoxReader.lend``) the same ones. One all-gather of
    a digest; the same answer on every rank."""
    mine = sorted(
        (stored, repr(m), repr(s), view, (stored, box) in lent) for (stored, box), (m, s, view) in holders.items()
    )
    found = comm.all_gather_bytes(b"".join(w.to_bytes(8, "little") for w in digest(mine)))
    by_stage: dict[tuple[int, ...], bytes] = {}
    for rank, got in enumerate(found):
        stage = () if stages is None else tuple(stages[0].coords(rank)[a] for a in stages[1])
        if by_stage.setdefault(stage, got) != got:
            return False
    return True


def destination(out: np.ndarray | None, meta: ArrayMeta, box: _plan.Box) -> np.ndarray:
    """The array a shared box is assembled in: the caller's, or a new one."""
    if out is not None:
        return out
    return np.empty(_plan.box_shape(box), dtype=numpy_dtype(meta.dtype))


def rows(out: np.ndarray, box: _plan.Box, part: _plan.Box) -> np.ndarray:
    """The rows of ``out`` (which holds ``box``) that ``part`` covers: contiguous in it."""
    if not box:
        return out
    start = box[0][0]
    return out[part[0][0] - start : part[0][1] - start]


def exchange(comm: Comm, shared: Mapping[Target, Shared]) -> None:
    """Send this rank's part of every shared box to the other sharers, and receive theirs into
    the destinations; in one batch, in the same order on every rank (sorted by box)."""
    sends, recvs = [], []
    for key in sorted(shared):
        s = shared[key]
        mine = s.sharing.mine
        for rank, part in zip(s.sharing.ranks, s.sharing.parts):
            if rank == comm.rank:
                continue
            if mine is not None:
                sends.append((rank, 0, _bytes(rows(s.out, key[1], mine))))
            if part is not None:
                recvs.append((rank, 0, _bytes(rows(s.out, key[1], part))))
    comm.during("while the ranks shared a load's reads").exchange(sends, recvs)


def _bytes(a: np.ndarray) -> object:
    """``a`` (contiguous) as a tensor of its bytes, sharing its memory."""
    import torch

    return torch.from_numpy(a.reshape(-1).view(np.uint8))
