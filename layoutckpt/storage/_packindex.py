"""Where each shard of a local packed checkpoint lies, read from its OCDBT B+tree.

A packed checkpoint's shards are values of an OCDBT database, each stored out of line as one
byte range of a data file. Knowing those ranges, layoutckpt's own shard reader reads a packed
checkpoint as it reads a plain one (only the index and the inner chunks a box needs, straight
into the destination) instead of going through TensorStore. ``PackIndex`` walks the B+tree on
demand: a lookup reads the nodes on the path to its key, each once per index, so a partial
read of one array reads a few small nodes, not the whole tree.

The merged root orders keys by array, so a rank's shards of an FSDP-style state lie in every one
of its leaves: at 16,384 ranks each loading rank would read and decode tens of leaves of 75,000
keys for its few hundred. Each writer's own database, under ``packs/``, holds its share of the
keys only. ``Router`` looks a load's shards up there where few ranks wrote them and the reader
knows which (the checkpoint's writer rules, or the few ranks that hold each piece), and in the
merged root otherwise.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import os
import threading
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import numpy as np

from ..format import _ocdbt
from ..layout._plan import piece_holders, split_counts
from . import _os
from ._shardread import Damaged, Extent, Files

if TYPE_CHECKING:
    from ..format._format import ArrayMeta
    from ..layout._plan import Box
    from ..layout._spec import Mesh

MANIFEST = "manifest.ocdbt"
# Where rank r's database lies until the commit merges it (its data files stay there).
PACKS = "packs"


def rank_base(rank: int) -> str:
    return f"{PACKS}/{rank:05d}"


_counts_lock = threading.Lock()
_nodes_read: Counter[str] = Counter()  # B+tree nodes read in this process, by database directory


def nodes_read() -> dict[str, int]:
    """B+tree nodes this process has read, by the directory of their database under the
    checkpoint ("" for the merged root): what tests and demos count."""
    with _counts_lock:
        return dict(_nodes_read)


class Inline(Exception):
    """The value of a key is stored inside its B+tree leaf, not in a data file (TensorStore
    writes values up to ``max_inline_value_bytes`` so, 100 by default): read it otherwise."""


class PackIndex:
    """The B+tree of the packed checkpoint at ``root``, decoded as lookups need its nodes, which
    it reads through ``files`` (a reader's: the nodes lie in the data files its shards do).
    ``base`` is the directory of another database under ``root`` (a writer's, ``packs/RRRRR/``)."""

    def __init__(self, root: Path, files: Files | None = None, base: str = "") -> None:
        self.root = root
        self.files = files if files is not None else Files(root)
        self.base = base
        self._lock = threading.Lock()
        self._tree: _ocdbt.Root | None = None
        self._nodes: dict[_ocdbt.Ref, Future[_ocdbt.Leaf | _ocdbt.Interior]] = {}
        self._decoded: dict[_ocdbt.Ref, _ocdbt.Leaf | _ocdbt.Interior] = {}

    def locate(self, key: str) -> Extent | None:
        """Where the value of ``key`` lies (None where the database has no such key); ``Inline``
        where it is stored in its leaf; ``Damaged`` where the tree does not decode."""
        tree = self.tree()
        ref, height, rest = tree.node, tree.height, key.encode()
        while ref is not None:
            node = self.node(ref, height)
            if isinstance(node, _ocdbt.Leaf):
                value = node.get(rest)
                if isinstance(value, bytes):
                    raise Inline(key)
                return None if value is None else Extent(value.path, value.offset, value.length)
            i = node.child(rest)
            if i is None or not rest.startswith(node.keys[i][: node.common[i]]):
                return None
            ref, height, rest = node.children[i], height - 1, rest[node.common[i] :]
        return None

    def tree(self) -> _ocdbt.Root:
        if self._tree is not None:  # every lookup starts here: no lock once it is read
            return self._tree
        with self._lock:  # every reading thread starts here: one reads the manifest, the rest wait
            if self._tree is None:
                name = self.base + MANIFEST
                try:
                    raw = _os.read_regular(self.root, name, _ocdbt.MAX_NODE_BYTES)
                except FileNotFoundError:
                    raise Damaged(True, f"the packed checkpoint's {name} does not exist") from None
                except OSError as err:
                    raise Damaged(False, f"the packed checkpoint's {name} cannot be read ({err})") from None
                with _decoding("manifest"):
                    self._tree = _ocdbt.decode_manifest(raw, self.base)
            return self._tree

    def node(self, ref: _ocdbt.Ref, height: int) -> _ocdbt.Leaf | _ocdbt.Interior:
        """The node at ``ref``, read and decoded once: threads that want it meanwhile wait for
        it (a merged root's leaf takes tens of milliseconds to decode, under the GIL)."""
        decoded = self._decoded.get(ref)  # every lookup passes here: no lock once it is decoded
        if decoded is not None:
            return decoded
        with self._lock:
            pending = self._nodes.get(ref)
            mine = pending is None
            if mine:
                pending = self._nodes[ref] = Future()
        if mine:
            try:
                raw = self._read(ref, "B+tree node")
                with _counts_lock:
                    _nodes_read[self.base] += 1
                with _decoding("B+tree node"):
                    self._decoded[ref] = decoded = _ocdbt.decode_node(raw, ref.base, height)
                pending.set_result(decoded)
            except BaseException as err:  # noqa: BLE001 - a waiter must get any failure, not hang
                pending.set_exception(err)
        return pending.result()

    def _read(self, ref: _ocdbt.Ref, what: str) -> bytes:
        """``ref``'s bytes, through ``Files`` (as ``open_regular`` opens them): the tree may name
        any path, and only a regular file inside the checkpoint is read."""
        if ref.length > _ocdbt.MAX_NODE_BYTES:
            raise Damaged(False, f"the packed checkpoint's {what} in {ref.path} claims {ref.length} bytes")
        try:
            fd, _, owned = self.files.open(Extent(ref.path, ref.offset, ref.length))
        except FileNotFoundError:
            raise Damaged(True, f"the packed checkpoint's {what} file {ref.path} does not exist") from None
        except OSError as err:
            raise Damaged(False, f"the packed checkpoint's {what} file {ref.path} cannot be read ({err})") from None
        try:
            raw = os.pread(fd, ref.length, ref.offset)
        finally:
            if owned:
                os.close(fd)
        if len(raw) != ref.length:
            raise Damaged(False, f"the packed checkpoint's {what} in {ref.path} is cut short")
        return raw


class Router:
    """Lookups of a packed checkpoint's keys (``locate``): in the databases of the ranks that
    wrote a load's shards where ``expect`` found few such ranks, else in the merged root.

    ``rules`` maps an array's path to its writer rule ``(start, step)``: the shard at C-order
    index ``i`` of its grid is in the database of rank ``start + step * i``. Where an array has
    none but its shards are its pieces, held by at most ``MOST_CANDIDATES`` ranks each (data
    parallelism over a few replicas: the save's balance chose one of them), each is looked up
    in those ranks' databases in turn. A load whose shards lie in at most half of the
    ``mesh``'s databases reads those: each holds about ``1 / world`` of the keys, fewer than the
    merged root's leaves such a load touches (all of them, for a rank's share of an FSDP
    state). A key its writer's database lacks, or a database that is missing or does not
    decode, is looked up in the merged root, which holds every key and is what a checkpoint's
    integrity rests on."""

    def __init__(self, root: Path, files: Files, rules: Mapping[str, tuple[int, int]], mesh: Mesh | None) -> None:
        self.root, self.files, self.rules, self.mesh = root, files, rules, mesh
        self.world = mesh.size if mesh is not None else 0
        self.merged = PackIndex(root, files)
        self._lock = threading.Lock()
        self._routed: dict[str, _Route] = {}  # by array path: the arrays a load routed
        self._known: dict[str, _Route | None] = {}  # by array path: each array's way, routed or not
        self._writers: dict[int, PackIndex | None] = {}  # None: passed over

    def expect(self, boxes: Iterable[tuple[ArrayMeta, Box]]) -> None:
        """Route the arrays of these boxes to their writers' databases where their shards lie
        in at most half of them."""
        routed: dict[str, _Route] = {}
        writers: set[int] = set()
        for meta, box in boxes:
            route = self._route(meta)
            shards = None if route is None else _cells(meta.shard_shape, box, route.strides)
            if shards is None:
                continue
            for i in shards:
                writers.update(route.candidates(i))
            if 2 * len(writers) > self.world:
                return
            routed[meta.path] = route
        with self._lock:
            self._routed.update(routed)

    def _route(self, meta: ArrayMeta) -> _Route | None:
        """How to find the writers of ``meta``'s shards (worked out once per array)."""
        if meta.path not in self._known:
            self._known[meta.path] = self._new_route(meta)
        return self._known[meta.path]

    def _new_route(self, meta: ArrayMeta) -> _Route | None:
        """Its rule, or the holders of its pieces; None where neither helps."""
        rule = self.rules.get(meta.path)
        if rule is not None:
            grid = tuple(-(-n // s) for n, s in zip(meta.shape, meta.shard_shape))
            return _Route(_strides(grid), meta.separator, *rule)
        mesh = meta.mesh or self.mesh
        if mesh is None or mesh.size != self.world:
            return None
        counts = split_counts(len(meta.shape), meta.spec, mesh)
        if tuple(meta.shard_shape) != tuple(-(-n // k) for n, k in zip(meta.shape, counts)):
            return None  # shards cut from pieces, or pieces not torch.chunk's
        holders = piece_holders(mesh, meta.spec.axes)
        if holders.shape[1] > MOST_CANDIDATES:
            return None
        # A shard is then the piece of the same coordinates, numbered over the pieces' grid.
        return _Route(_strides(counts), meta.separator, holders=holders)

    def locate(self, key: str) -> Extent | None:
        """``PackIndex.locate`` of ``key``, in its writer's database where ``expect`` routed it."""
        path, _, chunk = key.rpartition("/")
        route = self._routed.get(path)
        if route is not None:
            for rank in route.candidates(route.index(chunk)):
                found = self._in_writer(rank, key)
                if found is not None:
                    return found
        return self.merged.locate(key)

    def _in_writer(self, rank: int, key: str) -> Extent | None:
        """``key`` in rank ``rank``'s database; None where it is not there, the rank is out of
        range, or its database is missing or does not decode (then passed over from now on)."""
        if not 0 <= rank < self.world:
            return None
        index = self._writers.get(rank)
        if index is None and rank not in self._writers:
            with self._lock:
                index = self._writers.setdefault(rank, PackIndex(self.root, self.files, rank_base(rank) + "/"))
        if index is None:
            return None
        try:
            return index.locate(key)
        except (Damaged, Inline, _ocdbt.Unsupported):
            self._writers[rank] = None
            return None


# Where an array's writer is one of more ranks than this, its keys are looked up in the merged
# root: each miss in a candidate's database costs a lookup (and its first, a small read). A
# norm's few rows split over dp, replicated over pp x tp, have 32 candidates at 16,384 ranks.
MOST_CANDIDATES = 32


@attrs.frozen
class _Route:
    """Where an array's shards were written: the shard at index ``i`` (its coordinates times
    ``strides``) by rank ``start + step * i``, or by one of ``holders[i]``."""

    strides: tuple[int, ...]
    separator: str
    start: int = 0
    step: int = 0
    holders: np.ndarray | None = attrs.field(default=None, eq=False)

    def index(self, chunk: str) -> int:
        """The C-order index of the shard of chunk key ``chunk`` (``c.0.1``)."""
        return sum(int(c) * k for c, k in zip(chunk.split(self.separator)[1:], self.strides))

    def candidates(self, i: int) -> list[int]:
        if self.holders is None:
            return [self.start + self.step * i]
        return self.holders[i].tolist() if i < len(self.holders) else []


# A box that touches more shards than this is read through the merged root, where one array's
# keys lie together: a large read, whose shards' writers are many.
MOST_ROUTED_CELLS = 4096


def _strides(grid: tuple[int, ...]) -> tuple[int, ...]:
    """The C-order strides of a grid of cells."""
    strides = [1] * len(grid)
    for d in range(len(grid) - 2, -1, -1):
        strides[d] = strides[d + 1] * grid[d + 1]
    return tuple(strides)


# A model's arrays repeat a few shapes, and a load reads the same box of each: worked out once.
@functools.lru_cache(maxsize=256)
def _cells(shard: tuple[int, ...], box: Box, strides: tuple[int, ...]) -> tuple[int, ...] | None:
    """The indices (coordinates times ``strides``) of the shards of shape ``shard`` that ``box``
    touches; None above ``MOST_ROUTED_CELLS`` of them."""
    ranges = [range(a // s, (b - 1) // s + 1) for (a, b), s in zip(box, shard)]
    if math.prod(len(r) for r in ranges) > MOST_ROUTED_CELLS:
        return None
    return tuple(sum(c * k for c, k in zip(cell, strides)) for cell in itertools.product(*ranges))


@contextlib.contextmanager
def _decoding(what: str) -> Iterator[None]:
    """Bytes that do not decode are damage, named as such; a form this reader does not know is
    left to the caller (``Unsupported``), which reads through TensorStore instead."""
    try:
        yield
    except _ocdbt.Unsupported:
        raise
    except _ocdbt.Malformed as err:
        raise Damaged(False, f"the packed checkpoint's {what} is damaged: {err}") from None
