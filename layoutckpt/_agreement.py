"""What the ranks of a save must agree on, and what to tell them when they do not.

A save checks in one collective that every rank passed the same state (names, dtypes, specs,
the tree) to the same place with the same options; when they differ, the ranks exchange just
enough to name the first rank and the first arrays or options that differ.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from .base._errors import InconsistentShardsError
from .base._options import SaveOptions
from .storage._location import Location
from .torch._dist import Comm, fail_together, told


def agree(comm: Comm, error: BaseException | None, words: list[int]) -> tuple[list[int], list[int]]:
    """Exchange success and ``words`` in one collective; if any rank failed, all raise.

    The failing rank re-raises its own error; the others raise one that names it, so no rank is
    left waiting in a collective its peers have abandoned. A rank that left the world before it
    reported is named too (``RankLostError``).
    """
    comm = comm.during("before the save's ranks agreed on what to save (nothing was written)")
    return fail_together(
        comm, error, told("save refused on other ranks, nothing was written", InconsistentShardsError), words
    )


def call_of(final: Location, options: SaveOptions) -> dict[str, Any]:
    """What every rank must pass alike besides the state: the destination, the step, the
    metadata (only rank 0's is stored) and how arrays are stored (each rank writes part of it)."""
    try:
        metadata = json.dumps(options.metadata, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError):
        metadata = repr(options.metadata)  # refused by the local checks on this rank
    return {
        "path": final.url,
        "step": options.step,
        "metadata": metadata,
        "overwrite": options.overwrite,
        "inner_chunk_bytes": options.inner_chunk_bytes,
        "compression": options.compression,
        "packing": options.packing,
    }


def describe_call_disagreement(comm: Comm, call: dict[str, Any]) -> str:
    """Which rank passed which path, step, metadata or storage option unlike rank 0."""
    everyone = [json.loads(raw) for raw in comm.all_gather_bytes(json.dumps(call).encode())]
    parts = []
    for r, other in enumerate(everyone[1:], start=1):
        for field, value in other.items():
            if value != everyone[0][field] and len(parts) < 3:
                parts.append(f"{field} {everyone[0][field]!r} on rank 0 but {value!r} on rank {r}")
    return (
        "ranks disagree about where or how to save, and nothing was written: "
        + "; ".join(parts)
        + "; every rank must pass the same path, step, metadata, overwrite, inner_chunk_bytes and compression "
        "(per-rank values go in rank_state=)"
    )


def describe_disagreement(comm: Comm, signature: list[Any]) -> str:
    mine = repr(signature).encode()
    everyone = comm.all_gather_bytes(mine)
    differing = [r for r, s in enumerate(everyone) if s != everyone[0]]
    if not differing:
        return (
            "ranks hold the same arrays but different JSON values, tree structure, or rank_state "
            "presence; non-tensor leaves must be equal on every rank (per-rank values go in "
            "rank_state=, which every rank passes or none)"
        )
    r = differing[0]
    first = {n: tuple(rest) for n, *rest in eval_signature(everyone[0])}
    other = {n: tuple(rest) for n, *rest in eval_signature(everyone[r])}
    only0 = sorted(set(first) - set(other))[:3]
    onlyr = sorted(set(other) - set(first))[:3]
    changed = [n for n in first if n in other and first[n] != other[n]][:3]
    parts = []
    if only0:
        parts.append(f"arrays only on rank 0: {only0}")
    if onlyr:
        parts.append(f"arrays only on rank {r}: {onlyr}")
    for n in changed:
        what = "(dtype, ndim, spec, stages holding it)" if len(first[n]) > 3 else "(dtype, ndim, spec)"
        parts.append(f"array {n!r} is {what} {first[n]} on rank 0 but {other[n]} on rank {r}")
    return (
        "ranks disagree about the state to save: "
        + "; ".join(parts)
        + "; every rank must pass the same names, dtypes and ranks, and the same layout"
    )


def eval_signature(raw: bytes) -> list[tuple[Any, ...]]:
    return [tuple(x) for x in ast.literal_eval(raw.decode())]
