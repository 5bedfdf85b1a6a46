"""``save_async`` and ``load_async`` on real gloo ranks.

What this file proves:

- the checkpoint holds the values at the call, although the caller overwrites every tensor and
  array in place right after ``save_async`` returns (or after ``wait_staged()`` with ``lazy=True``);
- a ``host_memory_budget`` smaller than the state stages in waves, and the staging pool never
  holds more than the budget; a second save of the same state reuses the pooled buffers;
- one save is in flight per process: a new save waits for the previous one;
- a failure on one rank fails every rank's future with one ``SaveError`` naming the rank and the
  cause, leaves no checkpoint and no temporary directory, and spares older checkpoints; an
  unobserved failure is raised by the next ``save_async``;
- ``SaveResult`` adds up: every box is written once, and the caller is blocked for part of it;
- ``load_async`` gives what ``load`` gives, and refuses a bad template at the call.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import layoutckpt as lc
from layoutckpt.base import _faults
from layoutckpt.torch import _staging
from tests.support.oracle import local_shard

AXES = {"dp": 2, "tp": 2}
MESH = lc.Mesh(AXES)
SHARDED = lc.P("tp", None)
LAYOUT = lc.Layout(MESH, [(r"^(model\.w|model\.emb|np\.w)$", SHARDED), (r".*", lc.P())])


def full_state() -> dict:
    """The global arrays: float32 with nan/-0.0/inf, bf16 (sharded and replicated), int64, NumPy."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(12, 10, generator=g)
    w[0, 0], w[0, 1], w[1, 0] = float("nan"), -0.0, float("inf")
    return {
        "model": {
            "w": w,
            "emb": torch.randn(9, 6, generator=g).to(torch.bfloat16),  # 9 rows: uneven 5 + 4
            "b": torch.randn(10, generator=g).to(torch.bfloat16),
            "count": torch.arange(7, dtype=torch.int64),
        },
        "np": {"w": np.arange(8 * 5, dtype=np.float64).reshape(8, 5) / 3, "b": np.array([1, -2, 3], np.int32)},
        "step": 5,
    }


def spec_of(name: str) -> lc.P:
    return LAYOUT.spec_for(name)


def local_state(rank: int) -> dict:
    """This rank's shards of ``full_state()``, each in its own memory."""
    full = full_state()
    out: dict = {"model": {}, "np": {}, "step": full["step"]}
    for group in ("model", "np"):
        for key, value in full[group].items():
            spec = spec_of(f"{group}.{key}")
            if isinstance(value, np.ndarray):
                out[group][key] = local_shard(torch.from_numpy(value), spec, AXES, rank).numpy().copy()
            else:
                out[group][key] = local_shard(value, spec, AXES, rank).clone()
    return out


def overwrite_in_place(state: dict) -> None:
    """What an optimizer step does to the state: every element changes, in the same memory."""
    for group in ("model", "np"):
        for value in state[group].values():
            if isinstance(value, np.ndarray):
                value.fill(123)
            else:
                value.fill_(123)
    state["model"]["w"].add_(1)


def bits(x) -> tuple:
    """(type, dtype, shape, raw bytes): equal iff two arrays are bit-identical (nan and -0.0 included)."""
    if isinstance(x, torch.Tensor):
        raw = x.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return "torch", str(x.dtype), tuple(x.shape), raw
    return "numpy", str(x.dtype), tuple(x.shape), np.ascontiguousarray(x).tobytes()


def assert_full_state(path: Path | str) -> None:
    """The checkpoint at ``path``, loaded whole in this process, is ``full_state()`` bit for bit."""
    out = lc.load(path)
    want = full_state()
    assert out["step"] == want["step"]
    for group in ("model", "np"):
        assert set(out[group]) == set(want[group])
        for key in want[group]:
            assert bits(out[group][key]) == bits(want[group][key]), f"{group}.{key}"


def total_bytes(state: dict) -> int:
    return sum(v.nbytes for g in ("model", "np") for v in state[g].values())


def distinct_boxes() -> int:
    """Distinct pieces of the state under ``LAYOUT``: 2 per array split over tp, 1 per replicated one."""
    full = full_state()
    return sum(2 if spec_of(f"{g}.{k}") == SHARDED else 1 for g in ("model", "np") for k in full[g])


# --- the state at the call is what gets saved ---------------------------------------------------


def _save_then_overwrite(rank, group, path, lazy):
    state = local_state(rank)
    metadata = {"lazy": lazy, "losses": [1.0]}
    fut = lc.save_async(path, state, LAYOUT, group=group, lazy=lazy, metadata=metadata)
    metadata["losses"].append(float("nan"))  # the loop's own dict goes on: the save keeps the call's
    assert isinstance(fut, lc.SaveFuture)
    if lazy:
        fut.wait_staged()
    assert fut.staged()
    overwrite_in_place(state)
    result = fut.result()
    assert fut.done() and fut.exception() is None
    return result


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_mutating_right_after_the_call_does_not_change_the_checkpoint(ranks, tmp_path, lazy):
    path = tmp_path / "ck"
    results = ranks.run(_save_then_overwrite, 4, str(path), lazy)
    assert_full_state(path)
    assert lc.open(path).metadata == {"lazy": lazy, "losses": [1.0]}
    # Every box is written once, by one rank; an async save stages exactly what it writes.
    assert sum(r.bytes_written for r in results) == total_bytes(full_state())
    assert sum(r.arrays_written for r in results) == distinct_boxes()
    for r in results:
        assert r.path == os.fspath(path)
        assert r.staged_bytes == r.bytes_written
        assert 0 < r.blocked_seconds <= r.seconds


def _load_async_sharded(rank, group, path):
    layout = lc.Layout(lc.Mesh({"r": 2}), [(r"^model\.w$", lc.P(None, "r")), (r".*", lc.P("r"))])
    fut = lc.load_async(path, layout, group=group)
    assert isinstance(fut, lc.LoadFuture)
    out = fut.result()
    again = lc.load(path, layout, group=group)
    return bits(out["model"]["w"]), bits(out["np"]["w"]), bits(again["model"]["w"]), bits(again["np"]["w"])


def test_load_async_under_another_layout_matches_load(ranks, tmp_path):
    path = tmp_path / "ck"
    ranks.run(_save_then_overwrite, 4, str(path), False)
    full = full_state()
    for rank, (w, npw, w_sync, npw_sync) in enumerate(ranks.run(_load_async_sharded, 2, str(path))):
        assert w == w_sync == bits(full["model"]["w"].chunk(2, dim=1)[rank])
        assert npw == npw_sync == bits(np.array_split(full["np"]["w"], [4])[rank])


# --- staging memory: budget and reuse -----------------------------------------------------------

SPLIT_OVER_ALL = lc.P(("dp", "tp"), None)
WAVE_LAYOUT = lc.Layout(MESH, [(r".*", SPLIT_OVER_ALL)])


def wave_full(i: int) -> torch.Tensor:
    return torch.arange(16 * 64, dtype=torch.float32).reshape(16, 64) * (i + 1)


def wave_state(rank: int) -> dict:
    """Eight float32 arrays split over all four ranks: 1 KiB per rank each, and each rank writes its own."""
    return {f"layer{i}": local_shard(wave_full(i), SPLIT_OVER_ALL, AXES, rank).clone() for i in range(8)}


def _save_recording_pool_size(pool, path, state, layout, budget, group=None):
    """Save with ``budget``; the pool's size right after every acquire (it only grows there, so
    this includes the peak)."""
    held_after_acquire = []
    real_acquire = pool.acquire

    def acquire(nbytes):
        buf = real_acquire(nbytes)
        held_after_acquire.append(pool.held_bytes)
        return buf

    pool.acquire = acquire
    try:
        result = lc.save_async(path, state, layout, group=group, host_memory_budget=budget).result()
    finally:
        del pool.acquire
    return result, held_after_acquire


def _save_within_budget(rank, group, path):
    pool = _staging.pool(pinned=False, budget=None)
    pool.clear()  # only this save's buffers are measured
    state = wave_state(rank)
    local = sum(t.nbytes for t in state.values())
    budget = local // 4
    result, held_after_acquire = _save_recording_pool_size(pool, path, state, WAVE_LAYOUT, budget, group)
    assert pool is _staging.pool(pinned=False, budget=budget)
    return local, budget, held_after_acquire, pool.held_bytes, result.staged_bytes


def test_host_memory_budget_smaller_than_the_state_stages_in_waves(ranks, tmp_path):
    path = tmp_path / "ck"
    for rank, (local, budget, held, held_after, staged) in enumerate(ranks.run(_save_within_budget, 4, str(path))):
        assert staged == local, rank  # every byte was staged, in 8 acquires
        assert len(held) == 8
        assert max(held) <= budget, (rank, held, budget)
        assert held_after <= budget
    out = lc.load(path)
    for i in range(8):
        assert bits(out[f"layer{i}"]) == bits(wave_full(i))


def test_a_budget_also_caps_buffers_kept_from_earlier_saves(tmp_path):
    # Regression: the budget once applied to new allocations only, so buffers kept from an
    # earlier save without a budget stayed in the pool, above the budget, for the whole save.
    pool = _staging.pool(pinned=False, budget=None)
    pool.clear()
    state = {f"x{i}": torch.arange(256, dtype=torch.float32) + i for i in range(8)}  # 8 x 1 KiB
    # What an earlier save without a budget leaves behind: one kept buffer per array.
    kept = [pool.acquire(1024) for _ in range(8)]
    for buf in kept:
        pool.release(buf)
    assert pool.held_bytes == 8 * 1024
    budget = 2 * 1024
    try:
        result, held_after_acquire = _save_recording_pool_size(
            pool, tmp_path / "ck", state, lc.Layout.replicated(), budget
        )
    finally:
        _forget_staging_pools()
    assert result.staged_bytes == 8 * 1024
    out = lc.load(tmp_path / "ck")
    assert all(torch.equal(out[k], v) for k, v in state.items())
    assert max(held_after_acquire) <= budget, f"the pool held {held_after_acquire} bytes under a {budget}-byte budget"


@pytest.mark.parametrize("lazy", [False, True])
def test_a_staging_failure_fails_the_save_and_commits_nothing(tmp_path, monkeypatch, lazy):
    # Regression: with lazy=True a copy that failed left the writer waiting for the items it
    # never staged, and the future never settled.
    from layoutckpt import _save

    def fail(*_a, **_k):
        raise MemoryError("no host memory for the staging copy")

    monkeypatch.setattr(_save, "stage_all", fail)
    state = {f"x{i}": torch.arange(256, dtype=torch.float32) + i for i in range(4)}
    started = time.monotonic()
    with pytest.raises((lc.SaveError, MemoryError), match="no host memory"):
        lc.save_async(tmp_path / "ck", state, lc.Layout.replicated(), lazy=lazy, timeout=30).result()
    assert time.monotonic() - started < 20
    assert not (tmp_path / "ck").exists()


def reuse_full(i: int) -> torch.Tensor:
    return torch.arange((i + 1) * 4 * 8, dtype=torch.float32).reshape(-1, 8)


def reuse_state(rank: int) -> dict:
    """Shards of distinct byte sizes, so a save needs one buffer of each size."""
    return {f"a{i}": local_shard(reuse_full(i), SPLIT_OVER_ALL, AXES, rank).clone() for i in range(5)}


def _save_twice(rank, group, root):
    pool = _staging.pool(pinned=False, budget=None)
    pool.clear()
    state = reuse_state(rank)
    first = lc.save_async(os.path.join(root, "one"), state, WAVE_LAYOUT, group=group).result()
    held_first = pool.held_bytes
    # Holding the pooled tensors keeps their memory alive: a fresh allocation cannot reuse the address.
    kept = [t for bufs in pool._free.values() for t in bufs]
    views = {id(v) for by_kind in pool._views.values() for v in by_kind.values()}
    second = lc.save_async(os.path.join(root, "two"), state, WAVE_LAYOUT, group=group).result()
    held_second = pool.held_bytes
    now = [t for bufs in pool._free.values() for t in bufs]
    same_objects = sorted(map(id, kept)) == sorted(map(id, now))
    same_memory = sorted(t.data_ptr() for t in kept) == sorted(t.data_ptr() for t in now)
    # The staged tensors too: a new view per buffer per save would be garbage the collector promotes.
    same_views = len(views) == len(kept) and views == {id(v) for d in pool._views.values() for v in d.values()}
    return (
        first.staged_bytes,
        second.staged_bytes,
        held_first,
        held_second,
        len(kept),
        same_objects and same_views,
        same_memory,
    )


def test_second_save_of_the_same_state_reuses_every_staging_buffer(ranks, tmp_path):
    for staged1, staged2, held1, held2, n, same_objects, same_memory in ranks.run(_save_twice, 4, str(tmp_path)):
        assert staged1 == staged2 == sum(t.nbytes for t in reuse_state(0).values())
        assert n == 5
        assert held1 == held2 == staged1
        assert same_objects and same_memory
    for name in ("one", "two"):
        out = lc.load(tmp_path / name)
        for i in range(5):
            assert bits(out[f"a{i}"]) == bits(reuse_full(i))


# --- one save in flight -------------------------------------------------------------------------


def _slow_write(**_):
    time.sleep(0.2)  # so that the first save is surely still writing when the second starts


def _two_saves_in_a_row(rank, group, root):
    with _faults.hooks({"save.write": _slow_write}):
        first = lc.save_async(os.path.join(root, "a"), local_state(rank), LAYOUT, group=group)
        first_done_at_start = first.done()
        second = lc.save_async(os.path.join(root, "b"), local_state(rank), LAYOUT, group=group)
        first_done_when_second_returned = first.done()
        second.result()
        third = lc.save_async(os.path.join(root, "c"), local_state(rank), LAYOUT, group=group)
        third_done_at_start = third.done()
        sync = lc.save(os.path.join(root, "d"), local_state(rank), LAYOUT, group=group)
        third_done_when_sync_returned = third.done()
    first.result()
    third.result()
    return (
        first_done_at_start,
        first_done_when_second_returned,
        third_done_at_start,
        third_done_when_sync_returned,
        sync.staged_bytes,
    )


def test_a_new_save_waits_for_the_one_in_flight(ranks, tmp_path):
    for row in ranks.run(_two_saves_in_a_row, 4, str(tmp_path)):
        assert row == (False, True, False, True, 0)
    for name in "abcd":
        assert_full_state(tmp_path / name)


# --- synchronous save -----------------------------------------------------------------------------


def _save_sync(rank, group, path):
    return lc.save(path, local_state(rank), LAYOUT, group=group)


def test_synchronous_save_stages_nothing(ranks, tmp_path):
    path = tmp_path / "ck"
    results = ranks.run(_save_sync, 4, str(path))
    assert_full_state(path)
    assert sum(r.bytes_written for r in results) == total_bytes(full_state())
    for r in results:
        assert isinstance(r, lc.SaveResult)
        assert r.staged_bytes == 0
        assert r.blocked_seconds == r.seconds > 0


# --- failures -----------------------------------------------------------------------------------


def _disk_on_fire(**_):
    raise OSError("disk on fire")


_ON_FIRE = contextlib.ExitStack()


def _set_disk_on_fire(on: bool) -> None:
    """Every box this rank writes fails as it lands, whichever writer wrote it (a shard file, or
    TensorStore): the fault point ``save.box_written`` raises."""
    if on:
        _ON_FIRE.enter_context(_faults.hooks({"save.box_written": _disk_on_fire}))
    else:
        _ON_FIRE.close()


def _forget_staging_pools():
    """Start this rank's later saves from fresh staging pools. A failed save can leave buffers
    counted as in use (see ``test_a_failed_save_gives_its_staging_buffers_back``), and these
    processes serve every other test of the session."""
    _staging._POOLS.clear()


def _fail_on_rank_1(rank, group, path):
    if rank == 1:
        _set_disk_on_fire(True)
    try:
        fut = lc.save_async(path, local_state(rank), LAYOUT, group=group)
        with pytest.raises(lc.SaveError) as info:
            fut.result()
        assert fut.done()
        assert fut.exception() is info.value
        return type(info.value).__name__, str(info.value)
    finally:
        _set_disk_on_fire(False)
        _forget_staging_pools()


def test_failure_on_one_rank_fails_every_rank_and_leaves_nothing(ranks, tmp_path):
    parent = tmp_path / "ckpts"
    parent.mkdir()
    ranks.run(_save_sync, 4, str(parent / "good"))
    errors = ranks.run(_fail_on_rank_1, 4, str(parent / "bad"))
    messages = {message for _, message in errors}
    assert len(messages) == 1, "every rank raises the same message"
    (message,) = messages
    assert "rank 1" in message and "disk on fire" in message and "OSError" in message
    assert "nothing was committed" in message and str(parent / "bad") in message
    assert not any(f"rank {r}:" in message for r in (0, 2, 3))
    assert not (parent / "bad").exists()
    assert sorted(os.listdir(parent)) == ["good"]  # no .bad.tmp-* left behind
    assert_full_state(parent / "good")


def _failure_nobody_looks_at(rank, group, root):
    if rank == 1:
        _set_disk_on_fire(True)
    try:
        fut = lc.save_async(os.path.join(root, "bad"), local_state(rank), LAYOUT, group=group)
        finished = threading.Event()
        fut.add_done_callback(lambda f: finished.set())
        assert finished.wait(60)  # done() and callbacks do not count as looking at the failure
    finally:
        _set_disk_on_fire(False)
    try:
        try:
            lc.save_async(os.path.join(root, "next"), local_state(rank), LAYOUT, group=group)
        except Exception as err:  # noqa: BLE001 - returned to the test, which asserts on it
            refused = (type(err).__name__, str(err))
        else:
            refused = None
        # The failure has now been reported; the following save works.
        result = lc.save_async(os.path.join(root, "after"), local_state(rank), LAYOUT, group=group).result()
        return refused, result.bytes_written
    finally:
        _forget_staging_pools()


def test_an_unobserved_failure_is_raised_by_the_next_save(ranks, tmp_path):
    rows = ranks.run(_failure_nobody_looks_at, 4, str(tmp_path))
    for rank, (refused, _) in enumerate(rows):
        assert refused is not None, f"rank {rank}: the next save_async did not raise"
        kind, message = refused
        # Every rank's own previous save failed (with the same SaveError), so every rank raises.
        assert kind == "SaveError", (rank, refused)
        assert "the previous save_async failed" in message
        assert "rank 1" in message and "disk on fire" in message
    assert sum(written for _, written in rows) == total_bytes(full_state())
    assert sorted(os.listdir(tmp_path)) == ["after"]
    assert_full_state(tmp_path / "after")


def _staging_buffers_in_use_after_failure(rank, group, path):
    _forget_staging_pools()
    if rank == 1:
        _set_disk_on_fire(True)
    try:
        fut = lc.save_async(path, local_state(rank), LAYOUT, group=group)
        with pytest.raises(lc.SaveError):
            fut.result()
        return _staging.pool(pinned=False, budget=None)._used_bytes
    finally:
        _set_disk_on_fire(False)
        _forget_staging_pools()


def test_a_failed_save_gives_its_staging_buffers_back(ranks, tmp_path):
    # Regression: a failure while opening the arrays once skipped the release of the staged
    # buffers, and a later save with a budget then waited forever for them.
    used = ranks.run(_staging_buffers_in_use_after_failure, 4, str(tmp_path / "bad"))
    assert used == [0, 0, 0, 0], f"bytes of staging buffers still in use after the failed save, by rank: {used}"


@pytest.mark.parametrize("lazy", [False, True])
def test_a_write_that_fails_at_once_gives_the_staging_buffers_back(tmp_path, lazy):
    # Regression: a failure before the writer was made (a full disk refusing the first file)
    # skipped the release, and a later save with a budget could wait forever for the buffers.
    pool = _staging.pool(pinned=False, budget=None)
    used = pool._used_bytes
    state = {f"x{i}": torch.arange(256, dtype=torch.float32) + i for i in range(8)}

    def disk_full(**_):
        raise OSError(28, "No space left on device")

    with _faults.hooks({"save.write": disk_full}):
        fut = lc.save_async(tmp_path / "ck", state, lc.Layout.replicated(), lazy=lazy)
        with pytest.raises(lc.SaveError, match="No space left on device"):
            fut.result()
    assert pool._used_bytes == used
    assert not (tmp_path / "ck").exists()


# --- load_async ---------------------------------------------------------------------------------


def test_load_async_equals_load_and_checks_the_template_at_the_call(tmp_path):
    path = tmp_path / "ck"
    full = full_state()
    lc.save(path, full, lc.Layout.replicated())
    fut = lc.load_async(path)
    assert isinstance(fut, lc.LoadFuture)
    out = fut.result()
    assert fut.done()
    want = lc.load(path)
    assert out["step"] == want["step"] == 5
    for group in ("model", "np"):
        for key in full[group]:
            assert bits(out[group][key]) == bits(want[group][key]) == bits(full[group][key])

    like = {"model": {k: torch.empty_like(v) for k, v in full["model"].items()}, "np": dict(full["np"])}
    like["model"]["w"] = torch.empty(12, 11)
    with pytest.raises(lc.TemplateMismatchError, match=r"'model\.w'.*\(12, 11\)"):
        lc.load_async(path, like=like)
    with pytest.raises(lc.LayoutError, match=r"'model\.w'"):
        lc.load_async(path, lc.Layout(lc.Mesh({"tp": 1}), [(r"^model\.w$", lc.P(None, None, "tp")), (".*", lc.P())]))


_EXITS_AT_ONCE = """
import sys, torch, layoutckpt as lc
w = torch.arange(4096 * 1024, dtype=torch.float32).reshape(4096, 1024)  # 16 MiB: written by a thread pool
lc.save_async(sys.argv[1], {"w": w}, lc.Layout.replicated(), step=2, overwrite=True)
"""


def test_a_script_that_ends_right_after_save_async_still_commits(tmp_path: Path) -> None:
    """Exit hooks run newest first: the save's finishes before concurrent.futures refuses new
    work to the thread pools the save writes through."""
    import subprocess
    import sys

    path = tmp_path / "ck"
    lc.save(path, {"w": torch.zeros(4)}, lc.Layout.replicated(), step=1)
    done = subprocess.run(
        [sys.executable, "-c", _EXITS_AT_ONCE, str(path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "failed" not in done.stderr, done.stderr
    with lc.open(path) as rd:
        assert rd.step == 2
        np.testing.assert_array_equal(rd.read("w"), np.arange(4096 * 1024, dtype=np.float32).reshape(4096, 1024))


def test_the_pool_keeps_only_the_buffers_of_the_latest_save(tmp_path: Path) -> None:
    """A state whose shapes change from save to save: the pool holds one save's worth, not
    every size it ever staged."""
    pool = _staging.pool(pinned=False, budget=None)
    pool.clear()
    for i in range(8):
        state = {"w": torch.ones(1000 + i, 64), "b": torch.ones(7 + i)}
        lc.save_async(tmp_path / f"ck{i}", state, lc.Layout.replicated()).result()
        assert pool.held_bytes == (1000 + i) * 64 * 4 + (7 + i) * 4, i


def test_ctrl_c_in_a_synchronous_save_leaves_the_last_checkpoint_and_no_staging(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    lc.save(path, {"w": torch.zeros(4)}, lc.Layout.replicated(), step=1)

    def interrupted(**_: object) -> None:
        raise KeyboardInterrupt

    with _faults.hooks({"save.box_written": interrupted}), pytest.raises(KeyboardInterrupt):
        lc.save(path, {"w": torch.ones(4)}, lc.Layout.replicated(), step=2, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert lc.open(path).step == 1


def test_a_forked_child_exits_while_its_parent_saves(tmp_path: Path) -> None:
    """A DataLoader worker forked during a save inherits the save in flight but not the threads
    that finish it: it must exit at once rather than wait for it at exit."""
    import multiprocessing

    fut = lc.save_async(tmp_path / "ck", {"w": torch.ones(16 << 20)}, lc.Layout.replicated(), lazy=True)  # 64 MiB
    child = multiprocessing.get_context("fork").Process(target=int)
    child.start()
    child.join(30)
    alive = child.is_alive()
    if alive:
        child.kill()
    fut.result()
    assert not alive and child.exitcode == 0
