"""``lc.load(..., like=state, inplace=True)`` fills the template's own tensors: a box is read
straight into the first contiguous CPU leaf of the stored dtype that wants it, and copied into
every other leaf that wants it (a leaf tied to the same stored array, a view that is not
contiguous, a NumPy array); the result is the template's objects, their memory unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import layoutckpt as lc


def test_an_inplace_load_fills_every_leaf_of_the_template_once_read(tmp_path):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 4, generator=g)
    saved = {"w": w, "tied": w, "t": torch.randn(4, 6, generator=g), "n": np.arange(5.0), "e": torch.zeros(0, 2)}
    lc.save(tmp_path / "c", saved)
    assert set(lc.open(tmp_path / "c").meta.arrays) == {"w", "t", "n", "e"}  # "tied" is stored once

    holder = torch.full((6, 4), -1.0)
    like = {
        "w": torch.full((6, 4), -1.0),
        "tied": torch.full((6, 4), -1.0),  # wants the same stored box as "w"
        "t": holder.t(),  # not contiguous: cannot be read into, so copied
        "n": np.full(5, -1.0),
        "e": torch.zeros(0, 2),
    }
    addresses = {k: v.data_ptr() for k, v in like.items() if isinstance(v, torch.Tensor)}
    out = lc.load(tmp_path / "c", like=like, inplace=True)

    assert all(out[k] is like[k] for k in like)
    assert {k: v.data_ptr() for k, v in out.items() if isinstance(v, torch.Tensor)} == addresses
    assert torch.equal(out["w"], w) and torch.equal(out["tied"], w)
    assert torch.equal(holder, saved["t"].t())
    assert np.array_equal(out["n"], np.arange(5.0))


def test_a_template_that_cannot_take_the_bytes_is_refused_before_any_read(tmp_path):
    """A meta tensor has no memory to fill, and a tensor cannot take a stored plain value: both
    are typed errors naming the leaf, not a load that returns the template unfilled."""
    lc.save(tmp_path / "c", {"w": torch.arange(6.0).reshape(2, 3), "step": 7})
    with pytest.raises(lc.TemplateMismatchError, match=r"array 'w'.*meta device"):
        lc.load(tmp_path / "c", like={"w": torch.empty(2, 3, device="meta"), "step": 0}, inplace=True)
    # Without inplace a meta template gives the loaded tensors.
    assert torch.equal(
        lc.load(tmp_path / "c", like={"w": torch.empty(2, 3, device="meta"), "step": 0})["w"],
        torch.arange(6.0).reshape(2, 3),
    )
    step = torch.zeros((), dtype=torch.int64)
    for inplace in (False, True):
        with pytest.raises(lc.TemplateMismatchError, match=r"leaf 'step'.*plain value"):
            lc.load(tmp_path / "c", like={"w": torch.zeros(2, 3), "step": step}, inplace=inplace)


def test_parameters_that_take_a_copy_are_filled_in_place(tmp_path):
    # A contiguous parameter is read into straight; a transposed one or a fused one takes a
    # copy, which torch refuses on a leaf that requires grad unless it is detached.
    w = torch.arange(12.0).reshape(3, 4)
    lc.save(tmp_path / "plain", {"w": w})
    transposed = torch.nn.Parameter(torch.zeros(4, 3).t())
    lc.load(tmp_path / "plain", like={"w": transposed}, inplace=True)
    layout = lc.Layout(lc.Mesh({}), [(r"^qkv$", lc.Fused(lc.P(), [("q", 2), ("k", 1)]))])
    lc.save(tmp_path / "fused", {"qkv": w}, layout)
    fused = torch.nn.Parameter(torch.zeros(3, 4))
    lc.load(tmp_path / "fused", layout, like={"qkv": fused}, inplace=True)
    assert torch.equal(transposed.detach(), w) and torch.equal(fused.detach(), w)
    assert transposed.requires_grad and fused.requires_grad


@pytest.mark.parametrize("inplace", [False, True])
def test_a_numpy_scalar_in_the_template_comes_back_a_numpy_scalar(tmp_path, inplace):
    state = {"w": torch.arange(4.0), "step": np.int64(7)}
    lc.save(tmp_path / "ck", state)
    got = lc.load(tmp_path / "ck", like={"w": torch.zeros(4), "step": np.int64(0)}, inplace=inplace)
    assert type(got["step"]) is np.int64 and got["step"] == 7 and torch.equal(got["w"], state["w"])
