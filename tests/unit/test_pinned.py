"""The host arena a load reads boxes bound for a GPU into (its page-locking needs a GPU:
tests/integration/test_cuda.py)."""

from __future__ import annotations

import numpy as np

from layoutckpt.torch._pinned import HostArena


def test_each_box_has_its_own_pages_and_views_of_its_shape():
    arena = HostArena({"a": 10, "b": 4096, "c": 4097, "d": 0})
    assert arena.memory.ctypes.data % 4096 == 0
    assert arena.offsets == {"a": 0, "b": 4096, "c": 8192, "d": 16384}
    assert arena.memory.nbytes == 16384
    views = {
        "a": arena.view("a", (5,), np.dtype(np.int16)),
        "b": arena.view("b", (32, 32), np.dtype(np.float32)),
        "c": arena.view("c", (4097,), np.dtype(np.uint8)),
        "d": arena.view("d", (0, 3), np.dtype(np.float64)),
    }
    for i, (key, v) in enumerate(views.items()):
        assert v.flags.c_contiguous and v.shape == {"a": (5,), "b": (32, 32), "c": (4097,), "d": (0, 3)}[key]
        if v.size:
            assert v.ctypes.data == arena.memory.ctypes.data + arena.offsets[key]
        v[...] = i + 1
    for i, v in enumerate(views.values()):
        assert (v == i + 1).all()  # no box's writes reach another's


def test_an_empty_arena_pins_nothing():
    arena = HostArena({})
    arena.pin()  # no CUDA call: nothing to lock
    assert not arena.pinned and arena.memory.nbytes == 0
    arena.unpin()
