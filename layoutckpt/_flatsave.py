"""Saving flat (ZeRO-style) buffers: each rank's buffer checked, and the row blocks it writes.

A flat buffer's parameters are stored as arrays of their own (``layout/_flat.py`` plans which
rank writes which row block); the fragments of a block cut by a range boundary travel point to
point before the write. Over tensor-parallel pieces, the plan is that of this rank's pieces on
the mesh without the tensor-parallel axes, its ranks and boxes mapped back to the full mesh's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._pieces import Piece
from .base._errors import InconsistentShardsError
from .layout import _flat, _plan
from .layout._flat import Flat
from .layout._spec import Mesh
from .layout._tree import nested, replace_leaf
from .torch._dist import Comm


def flat_names(a: Piece, spec: Flat) -> list[str]:
    """The stored names of a flat buffer's parameters: under the buffer's own name."""
    return [f"{a.name}.{param}" for param, _ in spec.params]


def check_flat(a: Piece, spec: Flat, mesh: Mesh, rank: int) -> Flat:
    spec.check(mesh, a.name)
    local = spec.local(mesh, rank)
    piece, _ = local.flat.piece_of(local.mesh, local.rank)
    start, stop = local.flat.piece_range(local.mesh, piece)
    if len(a.shape) != 1 or a.shape[0] != stop - start:
        pieces = " (of its tensor-parallel pieces)" if spec.within else ""
        raise InconsistentShardsError(
            f"flat array {a.name!r}: rank {rank} holds shape {a.shape}, but {spec!r} on {mesh!r} gives it "
            f"elements [{start}, {stop}) of the {local.flat.total} concatenated{pieces}, a 1-D buffer of "
            f"{stop - start}; pass each rank's own flat buffer, or declare its bounds"
        )
    return spec


def expand_flats(structure: Any, flats: list[tuple[Piece, Flat]]) -> Any:
    """Each flat buffer's leaf becomes the tree of its parameters, stored as arrays of their own."""
    for a, spec in flats:
        structure = replace_leaf(structure, a.name, nested(a.name, [p for p, _ in spec.params]))
    return structure


def flat_writes(
    comm: Comm,
    flats: list[tuple[Piece, Flat]],
    shards: list[list[tuple[int, ...]]],
    mesh: Mesh,
    stages: tuple[tuple[str, ...], list[tuple[tuple[int, ...], ...]]] | None = None,
) -> list[tuple[str, _plan.Box, Any]]:
    """(stored name, box, data) of the row blocks this rank writes for its flat buffers.

    Blocks inside this rank's range are views of its buffer; the others are assembled from it
    and from the fragments the neighbouring ranks send, all exchanged in one batch.
    """
    if not flats:
        return []
    import torch

    from .torch._tensors import from_numpy

    out: list[tuple[str, _plan.Box, Any]] = []
    sends: list[tuple[int, int, Any]] = []
    recvs: list[tuple[int, int, Any]] = []
    axes = stages[0] if stages is not None else ()
    here = tuple(mesh.coords(comm.rank)[axis] for axis in axes)
    for tag, ((a, spec), shard_shapes) in enumerate(zip(flats, shards)):
        # Another stage's buffer, or one that the first stage holding it writes.
        if a.source is None or (stages is not None and stages[1][tag][0] != here):
            continue
        local = a.source if isinstance(a.source, torch.Tensor) else from_numpy(np.ascontiguousarray(a.source), a.dtype)
        local = local.detach()
        names = flat_names(a, spec)
        # Over tensor-parallel pieces, the plan is that of this rank's pieces on the mesh without
        # the tensor-parallel axes; its ranks and boxes are mapped back to the full mesh's.
        pieces = spec.local(mesh, comm.rank, fixed=axes)
        writes, to_send = _flat.save_plan(pieces.flat, pieces.mesh, pieces.rank, shard_shapes)
        for send in to_send:
            if pieces.writes[send.param]:
                sends.append((pieces.ranks[send.to], tag, local[send.lo : send.hi].contiguous()))
        for w in writes:
            if not pieces.writes[w.param]:
                continue
            shape, box = _plan.box_shape(w.box), pieces.to_global(w.box, w.param)
            if len(w.parts) == 1 and pieces.ranks[w.parts[0].rank] == comm.rank:
                part = w.parts[0]
                out.append((names[w.param], box, local[part.src : part.src + w.size].view(shape)))
                continue
            buf = torch.empty(w.size, dtype=local.dtype, device=local.device)
            for part in w.parts:
                if pieces.ranks[part.rank] == comm.rank:
                    buf[part.lo : part.hi].copy_(local[part.src : part.src + part.hi - part.lo])
                else:
                    recvs.append((pieces.ranks[part.rank], tag, buf[part.lo : part.hi]))
            out.append((names[w.param], box, buf.view(shape)))
    comm.exchange(sends, recvs)
    return out
