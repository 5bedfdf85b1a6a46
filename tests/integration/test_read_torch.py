"""``Reader.read_torch``: a CPU tensor of the stored dtype for every dtype (bfloat16 and float8,
which ``torch.from_numpy`` refuses, included), bit for bit, sharing the read's memory; slices
with negative steps and integer indexes; ``out=``; and a clear ImportError without torch while
``read`` keeps working.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

import layoutckpt as lc
from layoutckpt.torch._tensors import ZARR_NAMES

DTYPES = [getattr(torch, name) for name in ZARR_NAMES]


def _tensor(dtype: torch.dtype) -> torch.Tensor:
    values = torch.linspace(-3, 3, 6 * 5).reshape(6, 5)
    if dtype == torch.bool:
        return values > 0
    if not dtype.is_floating_point:
        values = values * 7
        if dtype in (torch.uint8, torch.uint16, torch.uint32, torch.uint64):
            values = values.abs()
    return values.to(dtype)


CARRIERS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _bits(t: torch.Tensor) -> np.ndarray:
    """A tensor's bits as unsigned integers of its width, which NumPy can index and compare for
    every dtype (torch has no comparisons or flips of float8)."""
    carrier = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.reshape(-1).view(carrier).numpy().view(CARRIERS[t.element_size()]).reshape(t.shape)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("read_torch") / "ck"
    state = {str(dtype).removeprefix("torch."): _tensor(dtype) for dtype in DTYPES}
    state["np"] = np.arange(20, dtype=np.int32).reshape(4, 5)
    state["config"] = {"lr": 0.1}
    lc.save(path, state, inner_chunk_bytes=16)  # small inner chunks: a slice crosses several
    return path, state


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_comes_back_as_the_saved_tensor(saved, dtype):
    path, state = saved
    name = str(dtype).removeprefix("torch.")
    with lc.open(path) as rd:
        whole = rd.read_torch(name)
        part = rd.read_torch(name, np.s_[4:0:-2, ::-1])
        one = rd.read_torch(name, np.s_[2, 3])
    saved_bits = _bits(state[name])
    for got, want in ((whole, saved_bits), (part, saved_bits[4:0:-2, ::-1]), (one, saved_bits[2, 3])):
        assert isinstance(got, torch.Tensor) and got.dtype == dtype and got.device.type == "cpu"
        assert got.shape == want.shape and np.array_equal(_bits(got), want)


def test_the_tensor_shares_the_memory_of_the_read(saved, monkeypatch):
    path, _ = saved
    with lc.open(path) as rd:
        for name in ("bfloat16", "float8_e5m2", "float32"):
            arrays = []
            read = rd.read

            def spy(*args, _read=read, _arrays=arrays, **kwargs):
                _arrays.append(_read(*args, **kwargs))
                return _arrays[-1]

            monkeypatch.setattr(rd, "read", spy)
            t = rd.read_torch(name, np.s_[1:5])
            monkeypatch.undo()
            (a,) = arrays
            assert t.data_ptr() == a.ctypes.data  # no copy in between
            a[...] = a[::-1].copy()  # and a write to one is seen in the other
            assert np.array_equal(_bits(t), a.view(CARRIERS[a.itemsize]))


def test_out_values_and_numpy_leaves(saved):
    path, state = saved
    with lc.open(path) as rd:
        buf = torch.empty(2, 5, dtype=torch.bfloat16)
        assert rd.read_torch("bfloat16", np.s_[0:2], out=buf) is buf
        assert np.array_equal(_bits(buf), _bits(state["bfloat16"])[0:2])
        with pytest.raises(TypeError, match="pass a CPU tensor"):
            rd.read_torch("float32", out=np.empty((6, 5), np.float32))
        with pytest.raises(TypeError, match=r"'config.lr' is a JSON value.*Reader.read\('config.lr'\)"):
            rd.read_torch("config.lr")
        got = rd.read_torch("np")
        assert got.dtype == torch.int32 and torch.equal(got, torch.from_numpy(state["np"]))


NO_TORCH = """
import sys
sys.modules["torch"] = None  # as if torch were not installed
import layoutckpt as lc
rd = lc.open(sys.argv[1])
assert rd.read("float32").shape == (6, 5)
try:
    rd.read_torch("float32")
except ImportError as err:
    print(err)
"""


def test_without_torch_read_works_and_read_torch_says_what_it_needs(saved):
    path, _ = saved
    proc = subprocess.run(
        [sys.executable, "-c", NO_TORCH, str(path)], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert "read_torch('float32') needs PyTorch" in proc.stdout and "Reader.read" in proc.stdout


@pytest.mark.parametrize("index", [np.s_[0::-1], np.s_[2:1:-1], np.s_[:, 3:2:-1], np.s_[::-1]], ids=str)
def test_a_reversed_slice_reads_as_the_numpy_read_does(tmp_path, index):
    # A reversed slice of one element keeps its negative stride through ``ascontiguousarray``.
    w = np.arange(12.0).reshape(3, 4)
    lc.save(tmp_path / "ck", {"w": w})
    with lc.open(tmp_path / "ck") as rd:
        assert torch.equal(rd.read_torch("w", index), torch.from_numpy(w[index].copy()))
