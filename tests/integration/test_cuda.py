"""CUDA staging: device-to-host copies into pinned buffers on a side stream, for ``save_async``
and for a manager's fast tier; and GPU tensors sent between gloo ranks, which carry host memory.

These need a GPU and skip without one (CI has none); the CPU paths are covered everywhere else.
"""

from __future__ import annotations

import uuid

import pytest
import torch

import layoutckpt as lc
from layoutckpt.torch import _staging

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    return {
        "w": torch.randn(1024, 512, device="cuda", generator=g),
        "h": torch.randn(333, 77, device="cuda", generator=g).to(torch.bfloat16),
        "t": torch.randn(64, 64, device="cuda", generator=g).t(),  # not contiguous
    }


@pytest.mark.parametrize("lazy", [False, True])
def test_cuda_state_is_staged_before_mutation(tmp_path, lazy):
    state = _state()
    expected = {k: v.cpu().clone() for k, v in state.items()}
    fut = lc.save_async(tmp_path / "ck", state, lc.Layout.replicated(), lazy=lazy)
    if lazy:
        fut.wait_staged()
    for t in state.values():
        t.add_(1)  # the optimizer step, queued on the current stream
    fut.result()
    out = lc.load(tmp_path / "ck")
    for k, v in expected.items():
        assert torch.equal(out[k], v), k


def test_cuda_staging_uses_reused_pinned_buffers(tmp_path):
    state = _state()
    lc.save_async(tmp_path / "a", state, lc.Layout.replicated()).result()
    pool = _staging.pool(pinned=True, budget=None)
    held = pool.held_bytes
    buffers = {b.data_ptr() for bufs in pool._free.values() for b in bufs}
    assert held >= sum(t.numel() * t.element_size() for t in state.values())
    assert all(b.is_pinned() for bufs in pool._free.values() for b in bufs)
    lc.save_async(tmp_path / "b", state, lc.Layout.replicated()).result()
    assert pool.held_bytes == held
    assert {b.data_ptr() for bufs in pool._free.values() for b in bufs} == buffers


def test_cuda_template_load_lands_on_the_device(tmp_path):
    state = _state()
    lc.save(tmp_path / "ck", state, lc.Layout.replicated())
    out = lc.load(tmp_path / "ck", like=state)
    for k, v in state.items():
        assert out[k].device == v.device
        assert torch.equal(out[k], v), k


def _lazy_save(kind: str, tmp_path, state: dict) -> tuple[object, object]:
    """A lazy save of ``state`` by ``save_async`` or by a manager with a memory fast tier; the
    future and what to close."""
    if kind == "save_async":
        return lc.save_async(tmp_path / "ck", state, lc.Layout.replicated(), lazy=True), None
    mgr = lc.CheckpointManager(tmp_path / "d", local=f"memory://{uuid.uuid4().hex}/{{rank}}", persist_every=1)
    return mgr.save(1, state, lc.Layout.replicated(), lazy=True), mgr


@pytest.mark.parametrize("kind", ["save_async", "manager"])
def test_lazy_copy_overlaps_kernels_queued_after_the_save(tmp_path, kind):
    """The side stream is ordered after the kernels queued before the save, not after those the
    caller queues next (the next step's forward and backward, which the copy overlaps)."""
    state = _state()
    expected = {k: v.cpu().clone() for k, v in state.items()}
    fut, mgr = _lazy_save(kind, tmp_path, state)
    torch.cuda._sleep(4_000_000_000)  # about 2 s of the GPU's time on the caller's stream
    fut.wait_staged()
    assert not torch.cuda.current_stream().query(), "the copy waited for the kernel queued after the save"
    torch.cuda.synchronize()
    for t in state.values():
        t.add_(1)
    fut.result()
    out = mgr.load(lc.Layout.replicated()) if mgr is not None else lc.load(tmp_path / "ck")
    for k, v in expected.items():
        assert torch.equal(out[k], v), k
    if mgr is not None:
        mgr.close()


def test_cuda_state_in_tiers_restores_bit_exact_from_each_tier(tmp_path):
    state = _state()
    expected = {k: v.cpu().clone() for k, v in state.items()}
    layout = lc.Layout.replicated()
    local = f"memory://{uuid.uuid4().hex}/{{rank}}"
    with lc.CheckpointManager(tmp_path / "d", local=local, persist_every=1) as mgr:
        mgr.save(1, state, layout, lazy=True).wait_staged()
        for t in state.values():
            t.add_(1)  # the optimizer step, once the copy is done
        mgr.wait()
        assert mgr.tier_metrics().persists_committed == 1
        into = {k: torch.zeros_like(v) for k, v in state.items()}
        out = mgr.load(layout, like=into, inplace=True)
        assert mgr.tier_metrics().restored_from == "local"
        for k, v in expected.items():
            assert out[k].device.type == "cuda" and out[k].data_ptr() == into[k].data_ptr()
            assert torch.equal(out[k].cpu(), v), k
    durable = lc.load(tmp_path / "d" / "step_00000001")
    for k, v in expected.items():
        assert torch.equal(durable[k], v), k


def test_a_memory_tier_restores_onto_the_gpu_straight_from_its_pinned_buffers(tmp_path, monkeypatch):
    """A held piece's arrays are the pinned buffers its save staged into: a restore onto the GPU
    copies from them, in place or into new tensors, with no read into host memory between."""
    from layoutckpt.storage._held import HeldReader

    state = _state()
    expected = {k: v.cpu().clone() for k, v in state.items()}
    layout = lc.Layout.replicated()
    with lc.CheckpointManager(tmp_path / "d", local=f"memory://{uuid.uuid4().hex}/{{rank}}") as mgr:
        mgr.save(1, state, layout).result()

        def no_read(*_args, **_kwargs):
            raise AssertionError("a box lent for a device copy was read into host memory")

        monkeypatch.setattr(HeldReader, "read", no_read)
        into = {k: torch.zeros_like(v) for k, v in state.items()}
        out = mgr.load(layout, like=into, inplace=True)
        fresh = mgr.load(layout, like=into)
        assert mgr.tier_metrics().restored_from == "local"
        for k, v in expected.items():
            assert out[k].data_ptr() == into[k].data_ptr()
            assert fresh[k].device.type == "cuda" and fresh[k].data_ptr() != into[k].data_ptr()
            assert torch.equal(out[k].cpu(), v) and torch.equal(fresh[k].cpu(), v), k


def test_a_piece_retired_during_a_restore_onto_the_gpu_fails_the_restore(tmp_path, monkeypatch):
    from layoutckpt.storage._held import HeldReader

    lend = HeldReader.lend

    def lend_then_retire(self, name, meta, box):
        lease = lend(self, name, meta, box)
        self.location.array(meta).alive = False  # what a retirement racing the copy does
        return lease

    monkeypatch.setattr(HeldReader, "lend", lend_then_retire)
    state = _state()
    with lc.CheckpointManager(tmp_path / "d", local=f"memory://{uuid.uuid4().hex}/{{rank}}") as mgr:
        mgr.save(1, state, lc.Layout.replicated()).result()
        with pytest.raises(lc.IntegrityError, match="retired while it was being read"):
            mgr.load(lc.Layout.replicated(), like=state, inplace=True)


def test_a_durable_restore_onto_the_gpu_copies_from_page_locked_host_memory(tmp_path, monkeypatch):
    """Boxes bound for the GPU are read into one host arena, page-locked for the copies once the
    reads are done and unlocked once they ran; a box also wanted on the host is read apart."""
    from layoutckpt.torch._pinned import HostArena

    state = _state()
    lc.save(tmp_path / "ck", state, lc.Layout.replicated())
    arenas: list[tuple[HostArena, bool]] = []
    unpin = HostArena.unpin

    def spy(self):
        arenas.append((self, self.pinned))
        unpin(self)

    monkeypatch.setattr(HostArena, "unpin", spy)
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    out = lc.load(tmp_path / "ck", like=into, inplace=True)
    fresh = lc.load(tmp_path / "ck", like={**state, "w": state["w"].cpu()})
    for k, v in state.items():
        assert out[k].data_ptr() == into[k].data_ptr() and torch.equal(out[k], v), k
        assert torch.equal(fresh[k].to(v.device), v), k
    assert fresh["w"].device.type == "cpu" and fresh["h"].device.type == "cuda"
    assert [pinned for _, pinned in arenas] == [True, True]
    assert len(arenas[0][0].offsets) == 3 and len(arenas[1][0].offsets) == 2  # "w" read for the host
    cudart = torch.cuda.cudart()
    for arena, _ in arenas:
        assert not arena.pinned
        address = arena.memory.ctypes.data  # unregistered: registering it again succeeds
        assert int(cudart.cudaHostRegister(address, arena.memory.nbytes, 0)) == 0
        assert int(cudart.cudaHostUnregister(address)) == 0


def _exchange_gpu_tensors(rank: int, group, n: int) -> list[float]:
    """Rank 0 sends a GPU tensor to rank 1, which receives into one: gloo carries host memory
    only, so both travel as host copies."""
    from layoutckpt.torch._dist import comm_for

    comm = comm_for(group)
    t = torch.arange(n, dtype=torch.float32, device="cuda") if rank == 0 else torch.zeros(n, device="cuda")
    comm.exchange([(1, 5, t)] if rank == 0 else [], [(0, 5, t)] if rank == 1 else [])
    assert t.device.type == "cuda"
    return t.cpu().tolist()


def test_ranks_exchange_gpu_tensors_over_gloo(ranks):
    got = ranks.run(_exchange_gpu_tensors, 2, 1000)
    assert got[1] == [float(i) for i in range(1000)]


def _save_flat_buffer_on_the_gpu(rank: int, group, path: str, full: dict, params: list) -> None:
    """A ZeRO-style flat buffer held on the GPU, split over two ranks: the row blocks that
    straddle the split are assembled from a fragment the other rank sends."""
    mesh = lc.Mesh({"dp": 2})
    flat = lc.Flat(params, "dp")
    cat = torch.cat([torch.from_numpy(full[name]).reshape(-1) for name, _ in params])
    start, stop = flat.piece_range(mesh, flat.piece_of(mesh, rank)[0])
    buf = torch.zeros(stop - start)
    part = cat[start : min(stop, cat.numel())]
    buf[: part.numel()] = part
    lc.save(path, {"exp_avg": buf.cuda()}, lc.Layout(mesh, [(r"^exp_avg$", flat)]), group=group)


def test_a_flat_buffer_on_the_gpu_saves_across_ranks(ranks, tmp_path):
    import numpy as np

    rng = np.random.default_rng(0)
    params = [("a", (37, 5)), ("b", (11,)), ("c", (3, 4, 5))]
    full = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in params}
    path = str(tmp_path / "ck")
    ranks.run(_save_flat_buffer_on_the_gpu, 2, path, full, params)
    reader = lc.open(path)
    for name, _ in params:
        np.testing.assert_array_equal(reader.read(f"exp_avg.{name}"), full[name])
