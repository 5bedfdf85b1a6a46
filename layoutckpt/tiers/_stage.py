"""Copy a rank's state into host buffers that become the fast tier's piece of one step.

The copy is all the training loop waits for (or, with ``lazy``, all that ``wait_staged`` waits
for). The call checks the state and describes the piece; taking the buffers is part of the copy,
so a lazy save's call leaves that per-array work to the staging thread. Buffers come from the
tier's own pool and go back once the piece is written (a memory tier keeps them as the piece
itself: once it is retired), replicated and persisted, so a loop that checkpoints every step
allocates nothing after the first steps.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import numpy as np

from .. import _rankstate
from ..format._hierarchy import user_metadata
from ..layout._tree import flatten, is_array_leaf
from ..torch._dtensor import is_dtensor, sharding_key
from ..torch._staging import HostBuffers, side_stream
from ..torch._torch import is_tensor, torch
from ._local import Piece, leaf_meta, like, piece_meta, same


@attrs.frozen
class Tree:
    """A save's structure and its JSON leaves (by name, as given): what the next save compares
    its own with."""

    structure: Any
    values: dict[str, Any]


@attrs.define(eq=False)
class Staging:
    """One step's piece and the copies that fill it; ``holds`` counts who still reads its
    buffers (the tier's writer, the piece a memory tier keeps, a persist), which go back to the
    pool when it reaches 0."""

    piece: Piece  # its arrays are filled by ``copy``
    leaves: dict[str, Any]  # the state's leaves: JSON values as given, arrays (once copied) as host copies
    structure: Any
    dtensors: dict[str, Any]  # name -> the DTensor whose local shard the piece holds
    sources: dict[str, Any]  # name -> the array to copy, until ``copy``
    pool: HostBuffers
    stream: Any = None  # the CUDA side stream of the device copies, ordered at the save
    buffers: list[Any] = attrs.field(factory=list)
    holds: int = 1
    event: Any = None  # a CUDA event: the device copies are done once it has passed
    values: dict[str, Any] = attrs.field(factory=dict)  # the state's JSON leaves, as given
    metadata: dict[str, Any] = attrs.field(factory=dict)  # the user's, as of the save (what a persist stores)
    _lock: threading.Lock = attrs.field(factory=threading.Lock)

    def hold(self) -> None:
        with self._lock:
            self.holds += 1

    def drop(self) -> None:
        with self._lock:
            self.holds -= 1
            done, self.buffers = (self.buffers, []) if self.holds == 0 else ([], self.buffers)
        for buf in done:
            self.pool.release(buf)

    def copy(self) -> None:
        """Take a buffer for every source from the pool and copy the source into it (device
        sources on the side stream)."""
        host: list[tuple[Any, Any]] = []
        device: list[tuple[Any, Any]] = []
        arrays = self.piece.arrays
        # Kept buffers of sizes this save does not take go back to the system: a state whose
        # shapes change would otherwise keep one of every size it ever had.
        self.pool.trim(collections.Counter(map(_nbytes, self.sources.values())))
        for name, s in self.sources.items():
            d = arrays[name] = _buffer(s, self.pool, self.buffers)
            if not is_tensor(s):
                np.copyto(d, s, casting="no")
            else:
                (host if s.is_cpu else device).append((d, s))
        # The live tensors are not kept alive by the piece.
        self.sources, self.leaves = {}, {**self.leaves, **arrays}
        if not host and not device:
            return  # torch may not even be installed
        # No autograd (not a detach per tensor: with thousands of leaves that is a cost of its own).
        with torch.no_grad():
            if host:
                # One call for all: it releases the GIL once (see torch/_staging.stage_all).
                torch._foreach_copy_([d for d, _ in host], [s for _, s in host])
            if device:
                self._copy_device(device)

    def _copy_device(self, device: list[tuple[Any, Any]]) -> None:
        stream = self.stream
        with torch.cuda.stream(stream):
            torch._foreach_copy_([d for d, _ in device], [s for _, s in device], non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(stream)
        for _, s in device:
            s.record_stream(stream)

    def synchronize(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def tree(self) -> Any:
        """The state as it was at the save, built on the host copies (DTensors rebuilt around
        them): what the durable tier's ordinary save writes."""
        from ..layout._tree import unflatten

        def leaf(name: str, node: Mapping[str, Any]) -> Any:
            value = self.leaves[name]
            d = self.dtensors.get(name)
            if d is not None:
                from torch.distributed.tensor import DTensor

                return DTensor.from_local(
                    value, d.device_mesh, d.placements, run_check=False, shape=d.shape, stride=d.stride()
                )
            return value

        return unflatten(self.structure, leaf)


def stage(
    state: Any,
    pool_of: Callable[[bool], HostBuffers],
    *,
    step: int,
    metadata: Mapping[str, Any] | None,
    rank_state: Any,
    info: dict[str, Any],
    last: Tree | None = None,
) -> Staging:
    """Check ``state`` and describe its piece; ``Staging.copy`` copies it. Bad input (a leaf
    that cannot be stored, metadata that is not JSON) raises here. ``last`` is the previous
    save's structure and JSON leaves, whose parts are kept where this one's are equal (``like``)."""
    metadata = user_metadata(metadata)
    structure, leaves = flatten(state)
    rank_doc = _rankstate.document(rank_state, 0, 1) if rank_state is not None else None
    sources, dtensors, values = {}, {}, {}
    cuda = False
    for name, leaf in leaves.items():
        if not is_array_leaf(leaf):
            values[name] = leaf
            continue
        if is_dtensor(leaf):
            dtensors[name] = leaf
            leaf = leaf.to_local()
        if is_tensor(leaf):
            cuda = cuda or leaf.is_cuda
            sources[name] = leaf
        else:  # stored bytes are little-endian (as lc.save stores them): a big-endian array is converted
            a = np.asarray(leaf)
            sources[name] = a.astype(a.dtype.newbyteorder("="))
    structure = _like_last(structure, values, last)
    # One pool per save: pinned host memory where the state is on a device.
    pool = pool_of(cuda)
    metas = {name: leaf_meta(name, src if is_tensor(src) else leaves[name]) for name, src in sources.items()}
    if dtensors:  # a restore takes the piece for a DTensor only where it is sharded alike (``piece_misfit``)
        info = {**info, "dtensors": {name: sharding_key(d) for name, d in dtensors.items()}}
    piece = Piece(piece_meta(metas, structure, step, metadata, info, rank_doc is not None), {}, rank_doc)
    # Ordered here, on the caller's thread: a lazy copy then overlaps the next step's kernels.
    stream = side_stream(sources.values()) if cuda else None
    return Staging(piece, leaves, structure, dtensors, sources, pool, stream, values=values, metadata=metadata)


def _like_last(structure: Any, values: dict[str, Any], last: Tree | None) -> Any:
    """``like(structure, last.structure)``. A loop saves the same tree every step: where the
    whole structure compares equal (one comparison in C) and its JSON values are the same,
    types included (``1 == True``), the last one is kept without a walk in Python."""
    if last is None:
        return structure
    if structure == last.structure and all(same(v, last.values.get(k, _ABSENT)) for k, v in values.items()):
        return last.structure
    return like(structure, last.structure)


_ABSENT = object()


def _nbytes(src: Any) -> int:
    return src.numel() * src.element_size() if is_tensor(src) else src.nbytes


def _buffer(src: Any, pool: HostBuffers, held: list[Any]) -> Any:
    """A host array of ``src``'s shape and dtype, from ``pool`` (its buffer added to ``held``)."""
    if is_tensor(src):
        nbytes = src.numel() * src.element_size()
        if nbytes == 0:
            return torch.empty(src.shape, dtype=src.dtype)
        buf = pool.acquire(nbytes)
        held.append(buf)
        return pool.view(buf, src.dtype, src.shape)
    if src.nbytes == 0:
        return np.empty(src.shape, src.dtype)
    buf = pool.acquire(src.nbytes)
    held.append(buf)
    raw = buf if isinstance(buf, np.ndarray) else buf.numpy()
    return raw.view(src.dtype).reshape(src.shape)  # NumPy arrays are no garbage collector's concern
