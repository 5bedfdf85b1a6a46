"""The restore side of a tiered ``CheckpointManager``: which step, from which tier, for every rank.

Every rank tells the others what its fast tier holds (its own pieces, and the pieces it keeps
for a peer); rank 0 adds the durable tier's committed steps. From the same gathered facts every
rank computes the same ``Choice``: the newest step that is either complete on the fast tiers
(each rank's piece on its own tier or on the tier of a rank holding its replica) or committed
durably, the fast tiers winning a tie. A step that only some ranks hold is never chosen, so a
rank that got further than the others before a crash cannot make the job resume inconsistently.
A rank whose piece is only on a peer's tier receives it from that peer, writes it into its own
tier (which heals the tier) and then reads it like the others.
"""

from __future__ import annotations

import errno
import json
from collections.abc import Mapping
from typing import Any

import attrs

from .._load import load
from .._steps import committed_steps
from ..base._errors import CheckpointNotFoundError
from ..layout._tree import flatten, unflatten
from ..storage._location import Location
from ..torch._dist import Comm
from ..torch._dtensor import from_local, is_dtensor, sharding_key
from ._local import LocalTier, Piece, empty_arrays, piece_from_header, read_piece, write_piece


@attrs.frozen
class Choice:
    """The step to restore and where from: ``tier`` is ``"local"`` (each rank's piece, from the
    rank in ``sources`` at its index: itself, or the peer holding its replica) or ``"durable"``."""

    step: int
    tier: str
    sources: tuple[int, ...] = ()
    durable: bool = False  # whether the durable tier holds the step too


def agree(tier: LocalTier, comm: Comm, durable: Location, step: int | None, layout_key: str | None) -> Choice:
    """The ``Choice`` every rank makes alike (collective); ``CheckpointNotFoundError`` where no
    tier holds ``step`` (default: any step) for every rank."""
    mine = tier.survey(comm.rank, comm.world)
    if comm.rank == 0:
        mine["durable"] = committed_steps(durable)
    everyone = [json.loads(raw) for raw in comm.all_gather_bytes(json.dumps(mine).encode())]
    durable_steps = set(everyone[0]["durable"])
    holders = _holders(everyone, layout_key)
    complete = {s for s, by_rank in holders.items() if all(by_rank[r] for r in range(comm.world))}
    if step is None:
        newest = max(complete | durable_steps, default=None)
        if newest is None:
            raise CheckpointNotFoundError(
                errno.ENOENT,
                f"no step to restore: the durable tier {durable.url!r} holds no committed checkpoint, and no "
                "step is on the fast tiers of every rank; save one first",
                durable.url,
            )
        step = newest
    if step in complete:
        by_rank = holders[step]
        sources = tuple(r if r in by_rank[r] else min(by_rank[r]) for r in range(comm.world))
        return Choice(step, "local", sources, step in durable_steps)
    if step in durable_steps:
        return Choice(step, "durable", durable=True)
    missing = [r for r in range(comm.world) if not holders.get(step, {}).get(r)]
    raise CheckpointNotFoundError(
        errno.ENOENT,
        f"step {step} cannot be restored: it is not committed on the durable tier {durable.url!r}, and no "
        f"fast tier holds it for rank(s) {missing}; restore a step that is complete (latest_step())",
        durable.url,
    )


def _holders(everyone: list[dict[str, Any]], layout_key: str | None) -> dict[int, dict[int, list[int]]]:
    """step -> rank -> the ranks whose fast tier holds that rank's piece of the step."""
    out: dict[int, dict[int, list[int]]] = {}
    world = len(everyone)

    def add(step: str, key: str, rank: int, holder: int) -> None:
        if layout_key is None or key == layout_key:
            out.setdefault(int(step), {r: [] for r in range(world)})[rank].append(holder)

    for holder, facts in enumerate(everyone):
        for step, key in facts["own"].items():
            add(step, key, holder, holder)
        for src, steps in facts["replicas"].items():
            for step, key in steps.items():
                if int(src) < world:
                    add(step, key, int(src), holder)
    return out


def fetch_missing(tier: LocalTier, comm: Comm, choice: Choice) -> str:
    """Bring every rank's piece of ``choice.step`` onto its own tier (collective); where this
    rank's came from: ``"local"`` or ``"peer"``."""
    moves = [(r, h) for r, h in enumerate(choice.sources) if r != h]
    if not moves:
        return "local"
    step = choice.step
    serving = {r: read_piece(tier.piece(step, r), tier.io) for r, h in moves if h == comm.rank}
    headers = {str(r): p.header().decode() for r, p in serving.items()}
    gathered = comm.all_gather_bytes(json.dumps(headers).encode())
    piece = None
    if choice.sources[comm.rank] != comm.rank:
        header = json.loads(gathered[choice.sources[comm.rank]])[str(comm.rank)].encode()
        meta, rank_doc = piece_from_header(header, f"the replica of rank {comm.rank}")
        piece = Piece(meta, empty_arrays(meta, _alloc), rank_doc)
    sends = [(r, i, v) for r, p in serving.items() for i, v in enumerate(v for v in p.byte_views() if v.numel())]
    recvs = []
    if piece is not None:
        recvs = [(choice.sources[comm.rank], i, v) for i, v in enumerate(v for v in piece.byte_views() if v.numel())]
    comm.exchange(sends, recvs)
    if piece is None:
        return "local"
    write_piece(tier.piece(step), piece, tier.io)
    return "peer"


def _alloc(nbytes: int) -> Any:
    from ..torch._torch import torch

    return torch.empty(nbytes, dtype=torch.uint8)


def piece_misfit(info: Mapping[str, Any], like: Any, *, by_layout: bool) -> str | None:
    """The first leaf for which a piece saved with ``info`` (its ``TIER_KEY``) does not give
    what a load of the durable tier into ``like`` would, or None. Each DTensor of the template
    must be sharded as the piece's was (the same ``sharding_key``). Other leaves load whole,
    which a piece holding them as a DTensor's shard cannot give, unless the load is ``by_layout``
    (the layout the piece was saved under, whose boxes it holds)."""
    saved = info.get("dtensors", {})
    if like is None:
        return None if by_layout else next(iter(saved), None)
    for name, leaf in flatten(like)[1].items():
        if is_dtensor(leaf) and saved.get(name) != sharding_key(leaf):
            return name
        if not is_dtensor(leaf) and not by_layout and name in saved:
            return name
    return None


def load_piece(url: str, like: Any = None, **options: Any) -> Any:
    """``lc.load`` of a piece into ``like``, which it fits (``piece_misfit``): the template's DTensors are
    read through their local shards, which is what the piece holds, and come back as DTensors."""
    if like is None:
        return load(url, None, **options)
    structure, leaves = flatten(like)
    shards = {name: leaf.to_local() for name, leaf in leaves.items() if is_dtensor(leaf)}
    out = load(url, None, like=unflatten(structure, lambda name, _: shards.get(name, leaves[name])), **options)
    if not shards:
        return out
    structure, got = flatten(out)
    return unflatten(structure, lambda name, _: _as_dtensor(got[name], leaves[name], shards.get(name)))


def _as_dtensor(value: Any, leaf: Any, shard: Any) -> Any:
    """``value``, loaded for the template ``leaf`` through its local ``shard``, as ``leaf`` is."""
    if shard is None:
        return value
    return leaf if value is shard else from_local(value, leaf, tuple(leaf.shape))
