"""The cyclic garbage collector held off while a load or a save makes its many short-lived objects."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Hold off the cyclic garbage collector for the block; it is on again after, if it was.

    A load plans and builds tens of thousands of small objects (the parsed metadata of every
    array, boxes, requests) that live until it ends, and a save as many (pieces, plans,
    documents, staging buffers' views). Enough of them outlive the young generations to bring
    on a full collection, which walks every object of a training process: 0.15-0.2 s in the
    benchmark's, a third of a warm 1 GB load or half of what ``save_async`` blocks for 4,000
    small arrays. None of them form cycles (a load or a save frees all it made by reference
    counting; ``tests/unit/test_gc.py``), so the pause costs nothing; the garbage of other
    threads waits for the end of the block.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
