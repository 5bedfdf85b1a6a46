"""Staging: copy the shards a rank writes out of the live tensors into reused host buffers.

The optimizer mutates parameters in place right after a checkpoint call returns, so an async
save must own a copy of the bytes it writes. The copy is the only part of a save the training
loop has to wait for; everything after it (writes, commit) runs in the background.

- Buffers are reused from save to save (keyed by byte size): steady-state saves allocate nothing,
  so the copy runs at memcpy speed instead of page-faulting fresh memory every step.
- A byte budget caps the host memory held by staging. A save larger than the budget stages in
  waves: staging waits for written buffers to come back (back-pressure) instead of running out of
  memory. One buffer larger than the whole budget is still allowed when nothing else is held, or
  a large array could never be saved.
- CUDA tensors are copied into pinned buffers on a side stream, so device-to-host copies overlap
  the caller's kernels; an event per shard says when its bytes are on the host. The buffers are
  pageable memory registered with CUDA (``_pinned.page_locked``), which pins a new buffer
  several times faster than CUDA's pinned allocation.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any

import numpy as np

from ..base import _faults
from ._pinned import page_locked
from ._tensors import to_numpy
from ._torch import installed, is_tensor, torch

# Views kept per buffer: one for a state saved alike every step, a few where shapes alternate.
_VIEWS_PER_BUFFER = 4


class HostBuffers:
    """A pool of uint8 host buffers with a byte budget; thread-safe."""

    def __init__(self, budget: int | None = None, *, pinned: bool = False) -> None:
        self.budget = budget
        self.pinned = pinned
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._free_bytes = 0
        self._used_bytes = 0
        self._cond = threading.Condition()
        self._views: dict[int, dict[Any, torch.Tensor]] = {}  # by id of a live buffer

    @property
    def held_bytes(self) -> int:
        """Bytes this pool holds now, in use or kept for reuse."""
        with self._cond:
            return self._free_bytes + self._used_bytes

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A buffer of exactly ``nbytes``; waits while the budget is used by buffers in flight."""
        _faults.point("save.stage_buffer", nbytes=nbytes)
        with self._cond:
            while True:
                free = self._free.get(nbytes)
                if free:
                    buf = free.pop()
                    self._free_bytes -= nbytes
                    self._used_bytes += nbytes
                    return buf
                self._evict_until(nbytes)
                if self.budget is None or self._used_bytes == 0 or self._fits(nbytes):
                    self._used_bytes += nbytes
                    break
                self._cond.wait()
        # Allocate outside the lock: touching fresh pages is the slow part.
        try:
            if self.pinned:
                return page_locked(nbytes)
            if not installed():  # NumPy-only: NumPy buffers
                return np.empty(nbytes, dtype=np.uint8)
            return torch.empty(nbytes, dtype=torch.uint8)
        except BaseException:
            with self._cond:
                self._used_bytes -= nbytes
                self._cond.notify_all()
            raise

    def release(self, buf: torch.Tensor) -> None:
        nbytes = buf.numel()
        with self._cond:
            self._used_bytes -= nbytes
            if self.budget is None or self._fits(nbytes):
                self._free[nbytes].append(buf)
                self._free_bytes += nbytes
            self._cond.notify_all()

    def view(self, buf: torch.Tensor, dtype: Any, shape: Any) -> torch.Tensor:
        """``buf`` (one of this pool's) as a tensor of ``dtype`` and ``shape``: the same object
        each time the buffer is viewed alike. A loop that saves the same state every step views
        its buffers alike; a new tensor per buffer per step would be objects that live as long
        as the copy they hold, which the garbage collector promotes to its oldest generation,
        bringing on full collections that walk every object of the process."""
        with self._cond:
            views = self._views.get(id(buf))
            if views is None:
                views = self._views[id(buf)] = {}
                # Gone with the buffer, before its id can name another one.
                weakref.finalize(buf, self._views.pop, id(buf), None)
            key = (dtype, tuple(shape))
            out = views.get(key)
            if out is None:
                if len(views) >= _VIEWS_PER_BUFFER:  # a state whose shapes change: the oldest goes
                    del views[next(iter(views))]
                out = views[key] = buf.view(dtype).view(shape)
            return out

    def trim(self, wanted: Counter[int]) -> None:
        """Keep for reuse at most ``wanted[n]`` free buffers of each size ``n`` (what the save
        about to stage takes): a state whose shapes change from save to save would otherwise
        keep every size it ever had."""
        with self._cond:
            for size, free in self._free.items():
                while len(free) > wanted[size]:
                    free.pop()
                    self._free_bytes -= size

    def clear(self) -> None:
        """Drop every buffer kept for reuse (buffers in use are unaffected)."""
        with self._cond:
            self._free.clear()
            self._free_bytes = 0

    def _fits(self, nbytes: int) -> bool:
        assert self.budget is not None
        return self._used_bytes + self._free_bytes + nbytes <= self.budget

    def _evict_until(self, nbytes: int) -> None:
        """Free kept buffers of other sizes until ``nbytes`` more fit the budget."""
        if self.budget is None:
            return
        for size in sorted(self._free, reverse=True):
            while self._free[size] and not self._fits(nbytes):
                self._free[size].pop()
                self._free_bytes -= size
            if self._fits(nbytes):
                return


_POOLS: dict[bool, HostBuffers] = {}
_POOLS_LOCK = threading.Lock()


def pool(*, pinned: bool, budget: int | None) -> HostBuffers:
    """The process's staging pool (one for pinned, one for pageable memory); the latest budget wins."""
    with _POOLS_LOCK:
        p = _POOLS.get(pinned)
        if p is None:
            p = _POOLS[pinned] = HostBuffers(budget, pinned=pinned)
        with p._cond:
            p.budget = budget
            p._evict_until(0)  # a lowered budget also caps the buffers kept from earlier saves
            p._cond.notify_all()
        return p


# One lock and condition for every staged item of the process, not an Event and a Lock each:
# thousands of such objects alive for a whole save are promoted to the garbage collector's
# oldest generation, which brings on full collections that walk all of torch's objects.
# Items are marked ready by one staging thread, a batch at a time, and waited for by a few
# writer threads, so one condition costs nothing in contention.
_ITEMS = threading.Condition(threading.Lock())


class Staged:
    """One shard's bytes on the host, and the buffer to give back once they are written."""

    __slots__ = ("_buffer", "_copying", "_dropped", "_dst", "_error", "_event", "_pool", "_ready", "data", "source")

    def __init__(self, source: Any) -> None:
        self.source = source
        self.data: np.ndarray | None = None
        self._dst: Any = None  # the staged tensor, until the writer asks for its NumPy view
        self._buffer: torch.Tensor | None = None
        self._pool: HostBuffers | None = None
        self._event: Any = None
        self._error: BaseException | None = None
        self._ready = False  # staged, or given up on; guarded by _ITEMS
        # A copy into the buffer is under way (from taking it to ``_mark_ready``), and the
        # writer gave the buffer back meanwhile: it goes back to the pool only once the copy
        # is over, or a later save would take a buffer still being written. Guarded by _ITEMS.
        self._copying = False
        self._dropped = False

    def _set_ready(self) -> None:
        """With ``_ITEMS`` held."""
        self._ready = True
        _ITEMS.notify_all()

    def view(self) -> None:
        """No copy: the caller is blocked until the write ends (synchronous ``save``)."""
        src = self.source
        if is_tensor(src):
            self.data = to_numpy(src)  # a device tensor is copied to the host here
        else:
            self.data = np.asarray(src)
        self.source = None
        with _ITEMS:
            self._set_ready()

    def fail(self, err: BaseException) -> None:
        """The save gave up before this item was staged: whoever waits for it gets ``err``."""
        with _ITEMS:
            if not self._ready:
                self._error = err
                self._set_ready()

    @property
    def nbytes(self) -> int:
        src = self.source
        if is_tensor(src):
            return src.numel() * src.element_size()
        return np.asarray(src).nbytes if src is not None else 0

    def _take(self, pools: _Pools) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Take a buffer; a (destination, source) pair for torch sources, whose copy the caller
        batches. NumPy sources and empty arrays are done here."""
        with _ITEMS:
            self._copying = True  # before the buffer is taken: a release now must wait
        src = self.source
        if is_tensor(src):
            src = src.detach()
            if src.numel() == 0:
                self.data = to_numpy(torch.empty(src.shape, dtype=src.dtype))
                return None
            self._pool = pools.get(src.is_cuda)
            self._buffer = self._pool.acquire(src.numel() * src.element_size())
            # The NumPy view is made by the writer (``wait``), off the caller's blocked time.
            self._dst = self._pool.view(self._buffer, src.dtype, src.shape)
            return self._dst, src
        src = np.asarray(src)
        if src.nbytes == 0:
            self.data = np.empty(src.shape, src.dtype)
            return None
        self._pool = pools.get(False)
        self._buffer = self._pool.acquire(src.nbytes)
        raw = self._buffer if isinstance(self._buffer, np.ndarray) else self._buffer.numpy()
        dst = raw.view(src.dtype).reshape(src.shape)
        np.copyto(dst, src, casting="no")
        self.data = dst
        return None

    def _mark_ready(self, event: Any, error: BaseException | None = None) -> None:
        """The copy is queued (CUDA: ``event`` says when it is done) or finished.

        If the writer gave up on this item meanwhile, the buffer goes back once the copy is.
        """
        self.source = None  # do not keep the caller's tensor alive
        with _ITEMS:
            cancelled = self._ready or self._dropped
            self._event = event
            self._error = error
            self._copying = False
            self._set_ready()
        if cancelled:
            self.release()

    def _copy_failed(self) -> None:
        """Staging failed (``fail`` told the writer): a buffer taken for a copy goes back."""
        with _ITEMS:
            taken, self._copying = self._copying, False
        if taken:
            self.release()

    def wait(self) -> np.ndarray:
        """The staged bytes, once the copy (host or device) is complete."""
        with _ITEMS:
            while not self._ready:
                _ITEMS.wait()
        if self._error is not None:
            raise self._error
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        if self.data is None and self._dst is not None:
            self.data, self._dst = to_numpy(self._dst), None
        assert self.data is not None
        return self.data

    def release(self) -> None:
        """Give the buffer back for reuse, once no copy writes into it; safe to call twice,
        from any thread."""
        with _ITEMS:
            if self._copying:
                self._dropped = True  # ``_mark_ready`` calls again once the copy is over
                return
            buf, self._buffer = self._buffer, None
            event, self._event = self._event, None
            self.data = self._dst = None
        if event is not None:
            event.synchronize()  # a device copy still queued into the buffer
        if buf is not None and self._pool is not None:
            self._pool.release(buf)


def side_stream(sources: Iterable[Any]) -> Any:
    """A CUDA stream for copying ``sources`` to the host, ordered after the caller's pending
    kernels, or None where none is on a CUDA device.

    Made on the caller's thread, at the save: the current stream is per thread in CUDA, and a
    stream ordered later (on a staging thread) would also wait for the kernels the caller queues
    after the save, such as the next step's forward, which the copy is meant to overlap.
    """
    devices = {s.device for s in sources if is_tensor(s) and s.is_cuda}
    if not devices:
        return None
    if len(devices) > 1:
        raise ValueError(
            f"the state holds tensors on several CUDA devices {sorted(map(str, devices))}; save each device's state separately"
        )
    (device,) = devices
    stream = torch.cuda.Stream(device=device)
    # The side stream must not read a tensor before the kernels that produce it have run.
    stream.wait_stream(torch.cuda.current_stream(device))
    return stream


def stage_all(items: list[Staged], budget: int | None, stream: Any) -> None:
    """Copy every item; CUDA copies are queued on ``stream``.

    Within the budget, every buffer is taken first and all torch copies run as one batched
    ``_foreach_copy_``: one call releases the GIL once, where one call per shard would win it
    back from the writer thread hundreds of times. Over the budget, items go one at a time so
    the writer can return buffers in between (back-pressure).
    """
    _trim_pools(items)
    try:
        if budget is None or sum(s.nbytes for s in items) <= budget:
            _copy_batch(items, budget, stream)
        else:
            for s in items:
                _copy_batch([s], budget, stream)
    except BaseException as err:
        for s in items:
            s.fail(err)
            s._copy_failed()
        raise


def _trim_pools(items: list[Staged]) -> None:
    """Free the kept buffers that this save, the only one staging, will not take."""
    wanted: dict[bool, Counter[int]] = {False: Counter(), True: Counter()}
    for s in items:
        src = s.source
        wanted[is_tensor(src) and src.is_cuda][s.nbytes] += 1
    with _POOLS_LOCK:
        pools = dict(_POOLS)
    for pinned, p in pools.items():
        p.trim(wanted[pinned])


class _Pools:
    """The staging pools of one batch, looked up (and their budget set) once, not per item."""

    def __init__(self, budget: int | None) -> None:
        self._budget = budget
        self._pools: dict[bool, HostBuffers] = {}

    def get(self, pinned: bool) -> HostBuffers:
        found = self._pools.get(pinned)
        if found is None:
            found = self._pools[pinned] = pool(pinned=pinned, budget=self._budget)
        return found


def _copy_batch(items: list[Staged], budget: int | None, stream: Any) -> None:
    todo = [s for s in items if not s._ready]  # the writer may have given up on some
    pools = _Pools(budget)
    pairs = [p for p in (s._take(pools) for s in todo) if p is not None]
    event = None
    host = [p for p in pairs if p[1].is_cpu]
    device = [p for p in pairs if not p[1].is_cpu]
    if host:
        torch._foreach_copy_([d for d, _ in host], [s for _, s in host])
    if device:
        with torch.cuda.stream(stream):
            torch._foreach_copy_([d for d, _ in device], [s for _, s in device], non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        for _, src in device:
            src.record_stream(stream)  # the source must outlive the queued copy
    for s in todo:
        s._mark_ready(event)
