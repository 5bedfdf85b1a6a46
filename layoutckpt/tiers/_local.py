"""One rank's fast tier: its own pieces, and the pieces it holds for a peer as replicas.

    LOCAL/                          a directory (``/nvme/run/{rank}``) or ``memory://run/{rank}``
      step_00000100/                this rank's piece of step 100
      replica_00003/step_00000100/  rank 3's piece of step 100, held here for rank 3

A piece is an ordinary layoutckpt checkpoint of the arrays one rank holds, as a world of one
would save them (each local shard whole, mesh ``{}``): ``lc.open`` and the command line read
it. It is committed as every checkpoint is (the marker last, a rename on a file system), so a
rank that dies mid-write leaves its previous pieces intact. A ``memory://`` tier holds a piece
as the host arrays the save copied the state into (``storage._held``): nothing is encoded, a
restore copies boxes straight out of them, and the buffers go back to the tier's pool when the
piece is retired; in this process, ``lc.open`` and ``lc.load`` read it by its URL all the same. Its user metadata carries
``TIER_KEY``: the rank, the world size and the layout it was saved under, which a restore
checks before it takes the piece for that rank.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from .. import _rankstate
from .._steps import committed_steps, remove_leftovers, retire_step, step_dir, to_delete
from ..base._options import IOConfig
from ..base._version import __version__
from ..format import _hierarchy as hierarchy
from ..format._dtypes import numpy_dtype, zarr_name
from ..format._format import ArrayMeta, CheckpointMeta, parse_root_document, root_document
from ..layout import _plan
from ..layout._spec import Mesh, P
from ..layout._tree import name_to_path
from ..storage import _held, _store
from ..storage._commit import new_token
from ..storage._location import Location, locate
from ..torch._tensors import tensor_zarr_dtype, to_numpy, torch_dtype
from ..torch._torch import is_tensor, torch

TIER_KEY = "layoutckpt.tier"
REPLICA_PREFIX = "replica_"
# Inner chunks of a piece: what a partial read of it fetches (as for lc.save).
_INNER_CHUNK_BYTES = 2 << 20


def layout_key(layout: Any) -> str:
    """A short digest of the layout a piece was saved under: a piece holds the shards this
    layout gave its rank, so another layout cannot take them."""
    return hashlib.sha256(repr(layout).encode()).hexdigest()[:16]


@attrs.frozen
class Piece:
    """One rank's state of one step, in host memory: the checkpoint's root document (``meta``),
    its arrays by name, and the rank's ``rank_state`` document."""

    meta: CheckpointMeta
    arrays: dict[str, Any]
    rank_doc: bytes | None = None

    def header(self) -> bytes:
        """What a peer needs to receive the arrays and store the piece (no array bytes)."""
        doc = self.rank_doc.decode() if self.rank_doc is not None else None
        return json.dumps({"root": root_document(self.meta).decode(), "rank_doc": doc}).encode()

    def byte_views(self) -> list[Any]:
        """Every array as a flat uint8 tensor sharing its memory, in ``meta.arrays`` order."""
        return [as_bytes(self.arrays[name]) for name in self.meta.arrays]


def as_bytes(data: Any) -> Any:
    if is_tensor(data):
        return data.reshape(-1).view(torch.uint8)
    return torch.from_numpy(np.ascontiguousarray(data).reshape(-1).view(np.uint8))


# A tier saves the same leaves every step: their documents are made once (frozen values).
@functools.lru_cache(maxsize=1 << 14)
def array_meta(name: str, shape: tuple[int, ...], dtype: str, itemsize: int, kind: str) -> ArrayMeta:
    """A piece's array: one shard, the whole local tensor (at least 1 along each dimension, as
    the format requires: an empty tensor's shard stores nothing)."""
    shard = tuple(max(1, n) for n in shape)
    chunk = _plan.chunk_shape_for(shard, itemsize, _INNER_CHUNK_BYTES)
    return ArrayMeta(name_to_path(name), shape, dtype, shard, chunk, P(), kind)


def leaf_meta(name: str, leaf: Any) -> ArrayMeta:
    """The document of an array leaf (a CPU or device tensor, or a NumPy array) as held."""
    if is_tensor(leaf):
        return array_meta(name, tuple(leaf.shape), tensor_zarr_dtype(leaf, name), leaf.element_size(), "torch")
    kind = "numpy" if isinstance(leaf, np.ndarray) else "numpy_scalar"
    a = np.asarray(leaf)
    return array_meta(name, a.shape, zarr_name(a.dtype.newbyteorder("="), name), a.itemsize, kind)


def piece_meta(
    arrays: dict[str, ArrayMeta], tree: Any, step: int, metadata: dict[str, Any], info: dict[str, Any], ranked: bool
) -> CheckpointMeta:
    return CheckpointMeta(
        arrays=arrays,
        tree=tree,
        mesh=Mesh({}),
        rules=(),
        step=step,
        user_metadata={**metadata, TIER_KEY: info},
        library_version=__version__,
        rank_state_world=1 if ranked else None,
        all_chunks_stored=True,
    )


def like(new: Any, old: Any) -> Any:
    """``new`` made of ``old``'s objects wherever their values are equal: ``old`` itself where
    all of it is, else a dict or list whose equal parts are ``old``'s. A piece lives for several
    steps, so objects made anew for each save's equal values would be garbage the collector
    promotes (``HostBuffers.view``)."""
    if type(new) is not type(old):
        return new
    if type(new) is dict:
        out = {k: like(v, old[k]) if k in old else v for k, v in new.items()}
        return old if out.keys() == old.keys() and all(out[k] is old[k] for k in out) else out
    if type(new) is list:
        items = [like(v, o) for v, o in zip(new, old)] + new[len(old) :]
        return old if len(new) == len(old) and all(a is b for a, b in zip(items, old)) else items
    return old if same(new, old) else new


def same(a: Any, b: Any) -> bool:
    """Whether two JSON values are the same: equal, of one type (``1 == 1.0 == True``), and
    of one sign where they are floats (``-0.0 == 0.0``)."""
    if type(a) is not type(b) or a != b:
        return False
    return type(a) is not float or math.copysign(1.0, a) == math.copysign(1.0, b)


def empty_arrays(meta: CheckpointMeta, acquire: Any, view: Any = None) -> dict[str, Any]:
    """Host arrays to receive ``meta``'s arrays into, from ``acquire(nbytes)`` (uint8 tensors),
    a tensor leaf as ``view(buffer, dtype, shape)`` where given (a pool's ``HostBuffers.view``)."""
    out: dict[str, Any] = {}
    for name, a in meta.arrays.items():
        nbytes = int(np.prod(a.shape, dtype=np.int64)) * a.itemsize
        if a.kind == "torch" and nbytes and view is not None:
            out[name] = view(acquire(nbytes), torch_dtype(a.dtype), a.shape)
            continue
        buf = acquire(nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)
        if a.kind == "torch":
            out[name] = buf.view(torch_dtype(a.dtype)).view(a.shape)
        else:
            out[name] = buf.numpy().view(numpy_dtype(a.dtype)).reshape(a.shape)
    return out


def piece_from_header(header: bytes, where: str) -> tuple[CheckpointMeta, bytes | None]:
    body = json.loads(header)
    doc = body["rank_doc"]
    return parse_root_document(body["root"].encode(), where, keep=False), doc.encode() if doc is not None else None


def write_piece(final: Location, piece: Piece, io: IOConfig, done: Callable[[], None] | None = None) -> int:
    """Write ``piece`` at ``final`` and commit it; the array bytes written. A piece already
    there (a step saved again after a restart) is replaced.

    ``done`` runs once ``final`` no longer needs the piece's host arrays: when they are written,
    for a directory; when the piece is retired or replaced, for a memory tier, which keeps the
    arrays themselves; when the write fails, for what the location did not keep."""
    loan = _Loan(done)
    try:
        if final.committed():
            final.retire()
        if final.is_local:
            Path(final.url).parent.mkdir(parents=True, exist_ok=True)
        final.prepare()
        tmp = final.staging(new_token())
        try:
            final.claim(tmp, piece.meta.save_id)
            written = _write_arrays(tmp, piece, io, loan)
            final.commit(tmp, root_document(piece.meta), overwrite=False, save_id=piece.meta.save_id)
        except BaseException:
            tmp.discard()
            loan.recall()
            raise
    finally:
        loan.seal()
    return written


class _Loan:
    """A piece's host arrays lent to a location (``storage._held.HeldArray``): ``done`` runs
    once every one is given back and no more are lent."""

    def __init__(self, done: Callable[[], None] | None) -> None:
        self._done = done
        self._sealed = False
        self._out: dict[int, _held.HeldArray] = {}  # lent and not given back yet, by id
        self._lock = threading.Lock()

    def lend(self, data: np.ndarray) -> _held.HeldArray:
        lent = _held.HeldArray(data, self)
        with self._lock:
            self._out[id(lent)] = lent
        return lent

    def give_back(self, lent: _held.HeldArray) -> None:
        with self._lock:
            if self._out.pop(id(lent), None) is None:
                return  # given back already
            last = self._sealed and not self._out
        if last and self._done is not None:
            self._done()

    def recall(self) -> None:
        """The write failed: what the writer still keeps (a shard it never started) comes back."""
        with self._lock:
            out = list(self._out.values())
        for lent in out:
            lent.release()

    def seal(self) -> None:
        """No more are lent: ``done`` runs now if every one is back, else with the last."""
        with self._lock:
            self._sealed = True
            last = not self._out
        if last and self._done is not None:
            self._done()


def _write_arrays(tmp: Location, piece: Piece, io: IOConfig, loan: _Loan) -> int:
    writer = tmp.box_writer(io)
    try:
        for name, a in piece.meta.arrays.items():
            if 0 in a.shape:
                continue  # nothing to store; a load of the piece reads nothing for it either
            box = tuple((0, n) for n in a.shape)  # a piece's shard is the whole local array
            # The host copy is the piece's own: written as it is (or kept), no second copy.
            writer.write(a, box, loan.lend(_numpy_of(piece.arrays[name])))
        tmp.write_many(hierarchy.documents(piece.meta))
        if piece.rank_doc is not None:
            tmp.write(_rankstate.file_name(0), piece.rank_doc)
        written = writer.join()
        tmp.make_durable()
    finally:
        writer.close()
    return written


def _numpy_of(data: Any) -> np.ndarray:
    """A piece's array as NumPy, sharing its memory: for a tensor, the same array each time.
    Torch's ``numpy()`` makes a tensor object that lives as long as the array, which a memory
    tier keeps for several steps, so a new one per save would be promoted by the garbage
    collector. A piece's tensors are views of the tier's own buffers, never resized."""
    if not is_tensor(data):
        return np.asarray(data)
    out = getattr(data, "_layoutckpt_numpy", None)
    if out is None:
        out = data._layoutckpt_numpy = to_numpy(data)
    return out


def read_piece(loc: Location, io: IOConfig) -> Piece:
    """The piece committed at ``loc``, read into host memory (a replica sent back to its rank)."""
    from .._reader import Reader

    meta = _store.read_meta(loc)
    with Reader(loc.url, io=io) as rd:
        arrays = {name: rd.read(name) for name in meta.arrays}
    return Piece(meta, arrays, loc.read(_rankstate.file_name(0)))


class LocalTier:
    """The fast tier of one rank, at ``url`` (its ``{rank}`` already filled in)."""

    def __init__(self, url: str, io: IOConfig) -> None:
        if url.startswith(_held.SCHEME):
            _held.register(url)  # pieces here are held as host arrays, not encoded (``_held``)
        self.root = locate(url)
        self.io = io
        if self.root.is_local:
            Path(self.root.url).mkdir(parents=True, exist_ok=True)

    def where(self, src: int | None = None) -> Location:
        """The root of this rank's own pieces (``src`` None), or of those it holds for ``src``."""
        return self.root if src is None else self.root.child(f"{REPLICA_PREFIX}{src:05d}")

    def piece(self, step: int, src: int | None = None) -> Location:
        return self.where(src).child(step_dir(step))

    def clean(self) -> None:
        """Remove what a crash left half written (this rank's own root and replica roots)."""
        if self.root.is_local:
            for src in [None, *self.replica_sources()]:
                remove_leftovers(Path(self.where(src).url))

    def retire(self, keep_last: int, src: int | None = None) -> None:
        where = self.where(src)
        for step in to_delete(committed_steps(where), keep_last, None):
            retire_step(where, step)

    def replica_sources(self) -> list[int]:
        """The ranks whose pieces this tier holds (committed or not)."""
        if self.root.is_local:
            names = os.listdir(self.root.url) if os.path.isdir(self.root.url) else []
        else:
            names = [k.split("/", 1)[0] for k in self.root.keys(REPLICA_PREFIX)]  # type: ignore[attr-defined]
        found = {n.removeprefix(REPLICA_PREFIX) for n in names if n.startswith(REPLICA_PREFIX)}
        return sorted(int(n) for n in found if n.isdigit())

    def survey(self, rank: int, world: int) -> dict[str, Any]:
        """What this rank could restore from here: ``{"own": {step: layout key}, "replicas":
        {src: {step: layout key}}}``, for pieces saved by the same ranks of the same world."""
        own = self._valid(None, rank, world)
        replicas = {src: self._valid(src, src, world) for src in self.replica_sources() if src != rank}
        return {"own": own, "replicas": {str(s): v for s, v in replicas.items() if v}}

    def _valid(self, src: int | None, rank: int, world: int) -> dict[str, str]:
        out = {}
        for step in committed_steps(self.where(src)):
            try:
                info = _store.read_meta(self.piece(step, src)).user_metadata.get(TIER_KEY, {})
            except (OSError, ValueError):
                continue  # retired meanwhile, or damaged: not a piece to restore from
            if info.get("rank") == rank and info.get("world") == world:
                out[str(step)] = str(info.get("layout"))
        return out
