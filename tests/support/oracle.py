"""The tests' own account of torch.chunk sharding, written apart from ``layoutckpt.layout._plan``.

Expected values come from here, so a planner bug cannot also hide in the expectation.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch


def mesh_coords(axes: dict[str, int], rank: int) -> dict[str, int]:
    """Row-major coordinates of ``rank``, through NumPy's ``unravel_index``."""
    if not axes:
        return {}
    return dict(zip(axes, (int(c) for c in np.unravel_index(rank, tuple(axes.values())))))


def local_shard(full: torch.Tensor, spec: Iterable[object], axes: dict[str, int], rank: int) -> torch.Tensor:
    """This rank's piece of ``full``, cut as ``torch.chunk`` cuts each dimension (a missing tail
    piece is empty; several axes on one dimension are major to minor)."""
    coords = mesh_coords(axes, rank)
    out = full
    for dim, entry in enumerate(spec):
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        pieces, index = 1, 0
        for name in names:
            pieces, index = pieces * axes[name], index * axes[name] + coords[name]
        chunks = out.chunk(pieces, dim=dim)
        out = chunks[index] if index < len(chunks) else out.narrow(dim, 0, 0)
    return out


def leaves(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted name, leaf)`` of a tree of nested dicts, as a loaded state's global names."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from leaves(v, f"{prefix}{k}.")
    else:
        yield prefix[:-1], tree
