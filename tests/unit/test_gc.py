"""A load or a save holds the cyclic garbage collector off while it runs and leaves nothing for
it: every object it made is freed by reference counting, so the pause loses nothing."""

from __future__ import annotations

import gc
from collections.abc import Callable

import pytest
import torch

import layoutckpt as lc


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gc") / "ck")
    g = torch.Generator().manual_seed(5)
    state = {
        "model": {f"layers.{i}.weight": torch.randn(64, 48, generator=g) for i in range(6)},
        "step": 7,
        "opt": [torch.randn(100, generator=g), (torch.arange(5),)],
    }
    lc.save(path, state, lc.Layout(lc.Mesh({"dp": 1}), [(".*", lc.P())]))
    return path, state


@pytest.mark.parametrize("kind", ["fresh", "inplace", "async"])
def test_a_load_leaves_no_cyclic_garbage(saved, kind):
    path, state = saved
    template = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "step": 0}
    template["opt"] = [torch.zeros(100), (torch.zeros(5, dtype=torch.int64),)]

    def load() -> None:
        if kind == "async":
            out = lc.load_async(path, like=template).result()
        else:
            out = lc.load(path, like=template, inplace=kind == "inplace")
        assert torch.equal(out["model"]["layers.3.weight"], state["model"]["layers.3.weight"])
        assert out["step"] == 7

    assert _cyclic_garbage(load) == []


def _cyclic_garbage(run: Callable[[], None]) -> list[str]:
    """The types of the objects that only the cyclic collector would free after ``run()``."""
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        run()
        gc.collect()
        return [type(o).__qualname__ for o in gc.garbage]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


def test_the_collector_is_back_on_after_a_load_and_after_a_failed_one(saved, tmp_path):
    path, _ = saved
    assert gc.isenabled()
    lc.load(path)
    assert gc.isenabled()
    with pytest.raises(lc.CheckpointNotFoundError):
        lc.load(str(tmp_path / "absent"))
    assert gc.isenabled()
    gc.disable()  # the caller's choice stands
    try:
        lc.load(path)
        assert not gc.isenabled()
    finally:
        gc.enable()


def _save(kind: str, path: str, state: dict, manager: lc.CheckpointManager) -> None:
    layout = lc.Layout(lc.Mesh({"dp": 1}), [(".*", lc.P())])
    if kind == "save":
        lc.save(path, state, layout)
    elif kind == "async":
        lc.save_async(path, state, layout).result()
    else:
        manager.save(int(path.rsplit("_", 1)[1]), state, layout).result()


@pytest.mark.parametrize("kind", ["save", "async", "tier"])
def test_a_save_leaves_no_cyclic_garbage(saved, tmp_path, kind):
    """What a save pauses the collector for is freed by reference counting once it ends."""
    _, state = saved
    with lc.CheckpointManager(tmp_path / "d", local=f"memory://gc-{kind}", persist_every=10**6) as manager:
        _save(kind, str(tmp_path / "s_1"), state, manager)  # buffers and caches made once
        assert _cyclic_garbage(lambda: _save(kind, str(tmp_path / "s_2"), state, manager)) == []


def test_the_collector_is_back_on_after_a_save_and_after_a_failed_one(saved, tmp_path):
    _, state = saved
    layout = lc.Layout(lc.Mesh({"dp": 1}), [(".*", lc.P())])
    lc.save(str(tmp_path / "a"), state, layout)
    assert gc.isenabled()
    with pytest.raises(lc.CheckpointExistsError):
        lc.save_async(str(tmp_path / "a"), state, layout)
    assert gc.isenabled()
    lc.save_async(str(tmp_path / "b"), state, layout).result()
    assert gc.isenabled()
    gc.disable()  # the caller's choice stands
    try:
        lc.save(str(tmp_path / "c"), state, layout)
        assert not gc.isenabled()
    finally:
        gc.enable()
