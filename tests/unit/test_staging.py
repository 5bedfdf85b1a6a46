"""The staging pool's hand-over between the staging thread and the writer: a buffer goes back
to the pool only once no copy writes into it. A writer that gives up on a save while the
staging thread still copies into a buffer (a lazy save whose write failed) must not let the
next save take that buffer: the late copy would land in the next checkpoint's bytes."""

from __future__ import annotations

import torch

from layoutckpt.base._errors import SaveError
from layoutckpt.torch._staging import HostBuffers, Staged


class _OnePool:
    def __init__(self, pool: HostBuffers) -> None:
        self.pool = pool

    def get(self, pinned: bool) -> HostBuffers:
        return self.pool


def _kept(pool: HostBuffers) -> int:
    return pool.held_bytes - pool._used_bytes


def test_a_buffer_the_writer_gives_back_mid_copy_returns_after_the_copy() -> None:
    pool = HostBuffers()
    item = Staged(torch.ones(1024))
    dst, src = item._take(_OnePool(pool))  # the staging thread has the buffer and copies
    item.fail(SaveError("the save stopped before this shard was written"))
    item.release()  # the writer gives up on the save
    assert _kept(pool) == 0, "the buffer went back while a copy still writes into it"
    dst.copy_(src)
    item._mark_ready(None)
    assert _kept(pool) == 4096 and pool._used_bytes == 0


def test_a_buffer_given_back_before_the_writer_gives_up_is_not_returned_twice() -> None:
    pool = HostBuffers()
    item = Staged(torch.ones(256))
    item._take(_OnePool(pool))
    item._mark_ready(None)
    item.wait()
    item.release()
    item.fail(SaveError("late"))
    item.release()
    assert _kept(pool) == 1024 and pool._used_bytes == 0


def test_a_copy_that_fails_gives_its_buffer_back() -> None:
    pool = HostBuffers()
    item = Staged(torch.ones(256))
    item._take(_OnePool(pool))
    item.release()  # the writer, before the staging thread fails
    assert _kept(pool) == 0
    item.fail(RuntimeError("copy failed"))
    item._copy_failed()
    assert _kept(pool) == 1024 and pool._used_bytes == 0


def test_a_buffer_keeps_a_few_views_of_the_shapes_it_was_viewed_as() -> None:
    # A state whose shapes change views one buffer as ever new shapes; each view is cached, and
    # without a bound the cache grows by one tensor per step for as long as the buffer lives.
    pool = HostBuffers(None)
    buf = pool.acquire(64)
    for rows in (1, 2, 4, 8, 16, 32, 64):
        view = pool.view(buf, torch.uint8, (rows, 64 // rows))
        assert view.shape == (rows, 64 // rows) and view.data_ptr() == buf.data_ptr()
    assert len(pool._views[id(buf)]) == 4
    assert pool.view(buf, torch.uint8, (64, 1)) is view  # the latest views stay cached
