"""Page-locked host memory for copies between the host and a GPU, made by registering pageable
memory with CUDA (``cudaHostRegister``).

From pageable memory CUDA copies through a staging buffer of its own, at a fraction of the
link's speed, and blocks the caller; from page-locked memory a copy is one transfer at the
link's speed and does not block. Registering memory locks its pages several times faster than
CUDA's pinned allocation (``cudaHostAlloc``), which a save's staging buffers would otherwise
pay once per buffer and a load's host buffers once per load.

- ``page_locked``: a staging buffer for copies from the GPU, unregistered when it is freed.
- ``HostArena``: one allocation that a load reads its boxes bound for GPUs into, registered
  once the reads are done (pinning pages the reads touched already) and unregistered once the
  copies out of it have run.

Each registration covers whole pages that its memory alone holds. Where CUDA refuses to lock
memory (a limit on locked memory), a buffer is allocated pinned and an arena's copies run from
pageable memory: slower, with the same result.
"""

from __future__ import annotations

import logging
import math
import threading
import weakref
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import numpy as np

from ._torch import torch

logger = logging.getLogger("layoutckpt")

_PAGE = 4096
_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every device, not only the current one


def page_locked(nbytes: int) -> torch.Tensor:
    """A uint8 host tensor of ``nbytes``, page-locked for CUDA copies for as long as it lives."""
    if nbytes:
        memory = _pages(nbytes)
        if _lock(memory) is not None:
            return torch.from_numpy(memory[:nbytes])
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class HostArena:
    """One host allocation that holds a load's boxes bound for GPUs, each at its own offset."""

    def __init__(self, sizes: Mapping[Hashable, int]) -> None:
        self.offsets: dict[Hashable, int] = {}
        total = 0
        for key, nbytes in sizes.items():
            self.offsets[key] = total
            total += _whole_pages(nbytes)
        self.memory = _pages(total)
        self._unlock: weakref.finalize | None = None

    @property
    def pinned(self) -> bool:
        return self._unlock is not None

    def view(self, key: Hashable, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """The arena's memory for ``key``'s box, as an array of ``shape`` and ``dtype``."""
        start = self.offsets[key]
        return self.memory[start : start + math.prod(shape) * dtype.itemsize].view(dtype).reshape(shape)

    def pin(self) -> None:
        """Page-lock the arena for copies to a GPU (once the reads have filled it)."""
        if not self.pinned and self.memory.nbytes:
            self._unlock = _lock(self.memory)

    def unpin(self) -> None:
        """Unlock the arena; every copy out of it must have run (the caller synchronized)."""
        if self._unlock is not None:
            self._unlock()
            self._unlock = None


def _whole_pages(nbytes: int) -> int:
    return -(-nbytes // _PAGE) * _PAGE


def _pages(nbytes: int) -> np.ndarray:
    """``nbytes`` rounded up to whole pages, of memory that starts a page."""
    raw = np.empty(_whole_pages(nbytes) + _PAGE, np.uint8)
    skip = -raw.ctypes.data % _PAGE
    return raw[skip : skip + _whole_pages(nbytes)]


def _lock(memory: np.ndarray) -> weakref.finalize | None:
    """Register ``memory`` (a view of the allocation ``_pages`` made) with CUDA; what unlocks it
    (at the latest as the allocation is freed), or None where CUDA refused."""
    address = memory.ctypes.data
    err = _on_own_thread(lambda: torch.cuda.cudart().cudaHostRegister(address, memory.nbytes, _PORTABLE))
    if err != 0:
        logger.warning(
            "layoutckpt: CUDA could not page-lock %d bytes of host memory (cudaError %d); copies between it and "
            "the GPU run more slowly",
            memory.nbytes,
            err,
        )
        return None
    # NumPy clears an array's weak references before it frees the array's memory.
    unlock = weakref.finalize(memory.base, _unregister, address)
    unlock.atexit = False  # the process's end unlocks all, and CUDA may be gone by then
    return unlock


def _unregister(address: int) -> None:
    err = _on_own_thread(lambda: torch.cuda.cudart().cudaHostUnregister(address))
    if err != 0:
        logger.warning("layoutckpt: CUDA could not unlock host memory at %#x (cudaError %d)", address, err)


def _on_own_thread(call: Callable[[], Any]) -> int:
    """``call``'s CUDA error code, from a thread of its own: CUDA keeps a failed call's error as
    the thread's last error, which the caller's next kernel launch would report as its own."""
    out = [-1]

    def run() -> None:
        try:
            out[0] = int(call())
        except Exception:  # CUDA unusable here: the memory stays pageable
            logger.debug("layoutckpt: a CUDA registration call failed", exc_info=True)

    thread = threading.Thread(target=run, name="layoutckpt-pin")
    thread.start()
    thread.join()
    return out[0]
