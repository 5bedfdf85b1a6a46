"""``StoreComm``, the commit's collectives over the job's key-value store, with two ranks as
threads over one in-process store: a rank that gives up waiting for rank 0 decides the outcome
for every rank, so that rank 0, late but alive, cannot commit what the others gave up on."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

import layoutckpt as lc
from layoutckpt.torch._dist import StoreComm


def _both(store, delay0: float, timeout: float) -> list[object]:
    got: list[object] = [None, None]

    def rank(r: int) -> None:
        if r == 0:
            time.sleep(delay0)
        try:
            got[r] = StoreComm(store, "save", r, 2, timeout).all_reduce([1 + r], "max")
        except lc.SaveError as err:
            got[r] = err

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return got


def test_a_rank_that_gives_up_on_a_slow_rank_0_fails_the_exchange_on_both():
    got = _both(dist.HashStore(), delay0=1.0, timeout=0.2)  # rank 1 waits 2 x 0.2 s, then gives up
    assert all(isinstance(g, lc.SaveError) for g in got), got
    assert str(got[0]) == str(got[1]) and "rank 1 waited" in str(got[0])


@pytest.mark.parametrize("delay0", [0.0, 0.1])
def test_rank_0_in_time_gives_both_its_result(delay0):
    assert _both(dist.HashStore(), delay0=delay0, timeout=1.0) == [[2], [2]]
