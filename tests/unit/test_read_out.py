"""``Reader.read(..., out=)`` fills a caller's buffer, on every read path, and refuses one that
cannot hold the result with an error naming the array."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

import layoutckpt as lc
from layoutckpt import TemplateMismatchError
from tests.support.paths import GOLDEN as GOLDENS

GOLDEN = GOLDENS / "v2" / "basic"


def _garbage(shape, dtype) -> np.ndarray:
    """A buffer whose every byte differs from what a read leaves in it (0xA5 is no value here)."""
    out = np.empty(shape, dtype)
    out.view(np.uint8).reshape(-1)[:] = 0xA5
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A float32 array and a bf16 one, each one shard of many inner chunks, and a JSON value."""
    path = str(tmp_path_factory.mktemp("out") / "ck")
    g = torch.Generator().manual_seed(3)
    state = {
        "w": torch.randn(64, 48, generator=g),
        "e": torch.randn(40, 24, generator=g).to(torch.bfloat16),
        "step": 7,
    }
    layout = lc.Layout(lc.Mesh({"a": 1}), [(r".*", lc.P())])
    lc.save(path, state, layout, inner_chunk_bytes=512)
    return path, state


@pytest.mark.parametrize("piecewise", [1 << 30, 1], ids=["small", "large"])
@pytest.mark.parametrize("index", [None, np.s_[5:50, 3:40], np.s_[0:1, :]])
def test_read_into_out_gives_the_plain_read_and_returns_out(saved, monkeypatch, piecewise, index):
    """Both the small path and the large one (one shard, streamed through a read-ahead)."""
    path, state = saved
    with lc.open(path, io=lc.IOConfig(large_read_bytes=piecewise)) as rd:
        want = rd.read("w", index)
        out = _garbage(want.shape, want.dtype)
        got = rd.read("w", index, out=out)
    assert got is out
    assert out.tobytes() == want.tobytes() == state["w"].numpy()[index if index is not None else ...].tobytes()


def test_read_into_a_strided_view_fills_only_it(saved):
    path, state = saved
    backing = _garbage((64, 96), np.float32)
    view = backing[:, ::2]  # every other column: not contiguous
    with lc.open(path) as rd:
        assert rd.read("w", out=view) is view
    assert np.array_equal(view, state["w"].numpy())
    assert (backing.view(np.uint8).reshape(64, 48, 2, 4)[:, :, 1] == 0xA5).all()  # the columns between: untouched


def test_read_into_a_bf16_tensor(saved):
    path, state = saved
    out = torch.empty(10, 24, dtype=torch.bfloat16)
    with lc.open(path) as rd:
        got = rd.read("e", np.s_[30:40, :], out=out)
    assert got is out
    assert torch.equal(out, state["e"][30:40])


def test_read_into_out_with_an_index_tensorstore_resolves(saved):
    """An integer index drops a dimension and a step is no box: TensorStore reads, then copies."""
    path, state = saved
    with lc.open(path) as rd:
        row = _garbage((48,), np.float32)
        assert rd.read("w", 9, out=row) is row
        every_third = _garbage((22, 48), np.float32)
        assert rd.read("w", np.s_[::3], out=every_third) is every_third
    assert np.array_equal(row, state["w"].numpy()[9])
    assert np.array_equal(every_third, state["w"].numpy()[::3])


@pytest.mark.parametrize("size", [(6, 4), (4000, 300)], ids=["small", "large"])
def test_read_into_out_from_an_object_store(tmp_path, size):
    """memory:// stands for an object store: TensorStore writes straight into ``out``."""
    url = f"memory://{tmp_path.name}/{size[0]}/ck"
    x = torch.arange(size[0] * size[1], dtype=torch.float32).reshape(size)
    lc.save(url, {"x": x}, lc.Layout.replicated())
    out = _garbage((size[0] - 2, size[1]), np.float32)
    assert lc.open(url).read("x", np.s_[1:-1, :], out=out) is out
    assert np.array_equal(out, x.numpy()[1:-1])


def test_read_of_the_golden_checkpoint_into_out_shard_by_shard(monkeypatch):
    """The multi-shard path of a checkpoint written by an earlier version."""
    rd = lc.open(GOLDEN, io=lc.IOConfig(large_read_bytes=1))
    want = rd.tensorstore("model.embed.weight").read().result()
    out = _garbage(want.shape, want.dtype)
    assert rd.read("model.embed.weight", out=out) is out
    assert out.tobytes() == want.tobytes()


@pytest.mark.parametrize(
    ("out", "words"),
    [
        (np.zeros((64, 47), np.float32), ["'w'", "[64, 47]", "[64, 48]", "shape and dtype"]),
        (np.zeros((64, 48), np.float64), ["'w'", "float64", "float32"]),
        (np.zeros((64, 48), ml_dtypes.bfloat16), ["'w'", "bfloat16", "float32"]),
        ([[0.0] * 48] * 64, ["'w'", "list", "NumPy array or a CPU tensor"]),
        (torch.empty(64, 48, device="meta"), ["'w'", "meta", "CPU tensor"]),
    ],
    ids=["shape", "dtype", "bf16-for-f32", "list", "not-cpu"],
)
def test_an_out_that_cannot_hold_the_result_is_refused(saved, out, words):
    path, _ = saved
    with lc.open(path) as rd, pytest.raises(TemplateMismatchError) as err:
        rd.read("w", out=out)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_a_read_only_out_and_a_json_value_are_refused(saved):
    path, _ = saved
    frozen = np.zeros((64, 48), np.float32)
    frozen.flags.writeable = False
    with lc.open(path) as rd:
        with pytest.raises(TemplateMismatchError, match="'w' is read-only"):
            rd.read("w", out=frozen)
        assert not frozen.any()
        with pytest.raises(TemplateMismatchError, match="'step' is a JSON value"):
            rd.read("step", out=np.zeros(()))
        assert rd.read("step") == 7


@pytest.mark.parametrize(
    "index",
    [
        np.s_[-8:, :],
        np.s_[1:-1, -40:-3],
        np.s_[-1],
        np.s_[..., -5],
        np.s_[10:1000],
        np.s_[::-1, 3],
        np.s_[50:10:-7, ::-2],
        np.s_[5:2],
        np.s_[-3:-20:-1],
        np.newaxis,
        np.s_[None, 2:5, None],
        ...,
    ],
    ids=str,
)
def test_an_index_means_what_it_means_to_numpy(saved, index):
    """Negative positions count from the end and slices stop at it, as in NumPy; TensorStore,
    whose domains can start below zero, would read them as coordinates."""
    path, state = saved
    want = state["w"].numpy()[index]
    with lc.open(path) as rd:
        got = rd.read("w", index)
        assert got.shape == want.shape and np.array_equal(got, want)
        assert np.array_equal(rd.read_async("w", index).result(), want)
        out = _garbage(want.shape, want.dtype)
        assert rd.read("w", index, out=out) is out and np.array_equal(out, want)


@pytest.mark.parametrize(
    ("index", "words"),
    [(np.s_[64], ["64", "dimension 0", "'w'", "size 64"]), (np.s_[0, -49], ["-49", "dimension 1", "size 48"])],
)
def test_an_index_out_of_range_names_the_array(saved, index, words):
    path, _ = saved
    with lc.open(path) as rd, pytest.raises(IndexError) as err:
        rd.read("w", index)
    assert all(w in str(err.value) for w in words), str(err.value)
