"""Replicas: each rank's piece also goes to a peer rank's fast tier, so losing one node's tier
still restores from host memory or local disk.

The exchange runs on the manager's own (gloo) process group, issued from the caller's thread so
that it never interleaves with the training loop's collectives from another thread: first the
small headers, synchronously (each rank must know the sizes it receives), then the arrays as
point-to-point sends and receives tagged apart from everything else, which the tier's thread
waits for in the background. Every rank takes part in every round, with an empty header where
its own piece failed, so the rounds stay paired save after save.
"""

from __future__ import annotations

import socket
from typing import Any

import attrs

from ..format._format import CheckpointMeta
from ..torch._dist import Comm
from ..torch._torch import dist, torch
from ._local import Piece, empty_arrays, like, piece_from_header

# Tag rounds apart: a round's arrays may still be in flight when the next round's headers go.
_ROUNDS = 64
_ARRAYS_PER_ROUND = 1 << 14
_SERIALS = iter(range(1, 1 << 12))
# The members of a received piece's document that stay the same from step to step.
_REUSED = ("arrays", "tree", "mesh", "rules", "user_metadata")


class Replicator:
    """This rank's side of the replica exchange: it sends to ``peer`` and holds ``pred``'s."""

    def __init__(self, comm: Comm) -> None:
        if "gloo" not in str(dist.get_backend(comm.group)):
            raise ValueError(
                "replicas=1 sends each rank's host copy to a peer over the manager's process group, which "
                f"must be a gloo group (it is {dist.get_backend(comm.group)}); pass group=dist.new_group(backend='gloo')"
            )
        self.comm = comm
        hosts = [h.decode() for h in comm.all_gather_bytes(socket.gethostname().encode())]
        self.peer, self.pred = ring(comm.rank, hosts)
        # Managers are made in the same order on every rank, so their serials (and tags) agree.
        self._base = next(_SERIALS) * _ROUNDS * _ARRAYS_PER_ROUND
        self._round = 0
        self._last: CheckpointMeta | None = None  # the last piece received (``_like_last``)

    def headers(self, piece: Piece | None, acquire: Any, view: Any = None) -> Piece | None:
        """Swap headers with the peers (blocking, small); the piece ``pred`` sends, its arrays
        allocated from ``acquire(nbytes)`` (viewed by ``view``, see ``empty_arrays``) and not
        yet received (None if it sends nothing)."""
        self._round = (self._round + 1) % _ROUNDS
        tag = self._tag(0)
        header = piece.header() if piece is not None else b""
        size_out, size_in = torch.tensor([len(header)], dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
        self.comm.exchange([(self.peer, tag, size_out)], [(self.pred, tag, size_in)])
        got = torch.zeros(int(size_in.item()), dtype=torch.uint8)
        sends = [(self.peer, tag + 1, torch.frombuffer(bytearray(header), dtype=torch.uint8))] if header else []
        self.comm.exchange(sends, [(self.pred, tag + 1, got)] if got.numel() else [])
        if not got.numel():
            return None
        meta, rank_doc = piece_from_header(got.numpy().tobytes(), f"the replica of rank {self.pred}")
        meta = self._like_last(meta)
        return Piece(meta, empty_arrays(meta, acquire, view), rank_doc)

    def _like_last(self, meta: CheckpointMeta) -> CheckpointMeta:
        """``meta`` with the previous round's objects wherever its values equal them. A peer
        sends the same arrays every step, and the piece held for it lives for several steps:
        objects parsed anew each round would be promoted to the garbage collector's oldest
        generation, bringing on full collections that walk every object of the process."""
        last, self._last = self._last, meta
        if last is None or last.save_id != meta.save_id:  # ``save_id`` binds every array
            return meta
        self._last = attrs.evolve(meta, **{k: like(getattr(meta, k), getattr(last, k)) for k in _REUSED})
        return self._last

    def post(self, piece: Piece | None, incoming: Piece | None) -> list[Any]:
        """Start sending ``piece``'s arrays and receiving ``incoming``'s; the works to wait for."""
        works = []
        group, base = self.comm.group, self._tag(2)
        for i, v in enumerate(v for v in (piece.byte_views() if piece is not None else []) if v.numel()):
            works.append((dist.isend(v, self.comm._global(self.peer), group=group, tag=base + i), v))
        for i, v in enumerate(v for v in (incoming.byte_views() if incoming is not None else []) if v.numel()):
            works.append((dist.irecv(v, self.comm._global(self.pred), group=group, tag=base + i), v))
        return works

    def _tag(self, offset: int) -> int:
        return self._base + self._round * _ARRAYS_PER_ROUND + offset


def wait_all(works: list[Any]) -> None:
    """Wait for the posted sends and receives (on the tier's thread)."""
    for work, _ in works:
        work.wait()


def ring(rank: int, hosts: list[str]) -> tuple[int, int]:
    """(peer, predecessor): the rank this one sends its piece to, and the one it holds a piece
    for. The peer is the rank of the same local index on the next host, so a replica survives
    the loss of a whole node; on one host (or hosts of unequal sizes), the next rank."""
    world = len(hosts)
    order = list(dict.fromkeys(hosts))
    members = {h: [r for r, x in enumerate(hosts) if x == h] for h in order}
    even = len(order) > 1 and len({len(m) for m in members.values()}) == 1

    def next_of(r: int) -> int:
        if not even:
            return (r + 1) % world
        h = hosts[r]
        return members[order[(order.index(h) + 1) % len(order)]][members[h].index(r)]

    return next_of(rank), next(r for r in range(world) if next_of(r) == rank)
