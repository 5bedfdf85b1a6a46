"""CUDA staging: device-to-host copies into pinned buffers on a side stream.

These need a GPU and skip without one (CI has none); the CPU paths are covered everywhere else.
"""

from __future__ import annotations

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
