"""A way in from PyTorch DCP, in one process: ``lc.import_dcp`` and ``layoutckpt import``.

Checkpoints here are written by ``torch.distributed.checkpoint.save`` itself (one process needs
no process group), then imported and read back bit for bit. The pickles DCP writes are read only
on the caller's word (``trust_pickle``) and through unpicklers that refuse every class they do
not know: a pickle that would run ``os.system`` is refused, and the command it names never runs.
FSDP2 and tensor-parallel checkpoints on several ranks are in ``tests/multirank/test_dcp.py``.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.numpy import save_file

import layoutckpt as lc
from layoutckpt._dcp import RefusedPickleError, TrustRequiredError
from layoutckpt.cli import _main as _cli

# dcp.save in one process warns that it saves without a process group, as meant here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def bits(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes, so that equal means bit-exact whatever the dtype."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(bits(a), bits(b))


class RunsACommand:
    """Pickles as a call of ``os.system``: what a malicious pickle does."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def state_of_every_kind() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "w": torch.randn(37, 24, generator=g),
            "b": torch.randn(24, generator=g).to(torch.bfloat16),
            "fp8": torch.randn(16, generator=g).to(torch.float8_e4m3fn),  # saved as untyped bytes + dtype
            "t": torch.arange(12, dtype=torch.int64).reshape(3, 4).t(),  # saved with its transposed strides
            "mask": torch.arange(10) % 3 == 0,
            "empty": torch.zeros(0, 5),
        },
        "optim": {
            "step": torch.tensor(7.0),
            "param_groups": [{"lr": 0.01, "betas": (0.9, 0.95), "params": ["w", "b"]}],
        },
        "opaque": {1, 2},  # a set: a tree holds no such value, so it is left out and named
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    src = tmp_path_factory.mktemp("dcp") / "ckpt"
    state = state_of_every_kind()
    dcp.save(state, checkpoint_id=src)
    return src, state


def test_import_gives_back_every_tensor_bit_for_bit_and_the_nested_state(saved, tmp_path: Path) -> None:
    src, state = saved
    done = lc.import_dcp(src, tmp_path / "out", trust_pickle=True, step=7)
    assert (done.arrays, done.values, done.skipped) == (7, 3, ("opaque",))
    got = lc.load(tmp_path / "out")
    for name, want in state["model"].items():
        assert same_bits(got["model"][name], want), name
    assert same_bits(got["optim"]["step"], state["optim"]["step"])
    # The non-tensor values come back as they were saved, in their list.
    assert got["optim"]["param_groups"] == [{"lr": 0.01, "betas": (0.9, 0.95), "params": ["w", "b"]}]
    assert "opaque" not in got
    assert lc.open(tmp_path / "out").step == 7


def test_a_layout_chunks_the_arrays_and_any_slice_reads_back(saved, tmp_path: Path) -> None:
    src, state = saved
    layout = lc.Layout(lc.Mesh({"dp": 4}), [(r"\.w$", lc.P("dp", None)), (r".*", lc.P())])
    lc.import_dcp(src, tmp_path / "out", layout, trust_pickle=True, inner_chunk_bytes=256)
    with lc.open(tmp_path / "out") as rd:
        assert rd.info("model.w").spec == lc.P("dp", None)
        np.testing.assert_array_equal(rd.read("model.w", np.s_[5:30, 3:17]), state["model"]["w"][5:30, 3:17].numpy())


def test_without_trust_nothing_is_unpickled_and_the_error_says_how(saved, tmp_path: Path) -> None:
    src, _ = saved
    with pytest.raises(TrustRequiredError, match=r"is a Python pickle.*trust_pickle=True.*--trust"):
        lc.import_dcp(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_metadata_that_would_run_a_command_is_refused_unrun(saved, tmp_path: Path) -> None:
    src = tmp_path / "evil"
    src.mkdir()
    marker = tmp_path / "ran"
    (src / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": RunsACommand(marker)}))
    with pytest.raises(RefusedPickleError, match=r"asks for posix\.system, which the DCP importer does not admit"):
        lc.import_dcp(src, tmp_path / "out", trust_pickle=True)
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_a_value_whose_pickle_would_run_a_command_is_left_out_unrun(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    dcp.save({"w": torch.ones(3), "hook": RunsACommand(marker)}, checkpoint_id=tmp_path / "ckpt")
    done = lc.import_dcp(tmp_path / "ckpt", tmp_path / "out", trust_pickle=True)
    assert done.skipped == ("hook",) and not marker.exists()
    assert set(lc.load(tmp_path / "out")) == {"w"}


def test_a_data_item_that_names_another_file_outside_is_refused(saved, tmp_path: Path) -> None:
    """A crafted storage entry cannot send the reader out of the checkpoint's folder."""
    import shutil

    src, _ = saved
    copy = tmp_path / "ckpt"
    shutil.copytree(src, copy)
    meta = pickle.loads((copy / ".metadata").read_bytes())  # the test's own, trusted, unpickling
    info = next(v for k, v in meta.storage_data.items() if k.fqn == "model.w")
    info.relative_path = "../../etc/passwd"
    (copy / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(lc.FormatError, match="expected a file name in the checkpoint's folder"):
        lc.import_dcp(copy, tmp_path / "out", trust_pickle=True)


def run(capsys, *argv: object) -> tuple[int, str, str]:
    code = _cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_imports_dcp_only_with_trust(saved, tmp_path: Path, capsys) -> None:
    src, state = saved
    code, out, err = run(capsys, "import", "--from", "dcp", src, tmp_path / "out")
    assert code == 2 and out == "" and "is a Python pickle" in err and "add --trust" in err
    assert not (tmp_path / "out").exists()
    # --from is found from the folder (DCP's .metadata), --trust given.
    code, out, err = run(capsys, "import", src, tmp_path / "out", "--trust", "--step", "3")
    assert code == 0, err
    assert out.startswith(f"{tmp_path / 'out'}  7 arrays") and "(from dcp)" in out
    assert "skipped opaque: its pickle holds more than plain values" in out
    assert same_bits(lc.load(tmp_path / "out")["model"]["w"], state["model"]["w"])


def test_cli_imports_safetensors(tmp_path: Path, capsys) -> None:
    arrays = {"model.w": np.arange(20, dtype=np.float32).reshape(4, 5), "model.b": np.ones(3, np.int64)}
    save_file(arrays, tmp_path / "model.safetensors")
    code, out, err = run(capsys, "import", tmp_path / "model.safetensors", tmp_path / "out", "--mesh", "dp=2")
    assert code == 0, err
    assert out.startswith(f"{tmp_path / 'out'}  2 arrays") and "(from safetensors)" in out
    got = lc.load(tmp_path / "out")
    for name, want in arrays.items():
        np.testing.assert_array_equal(got[name].numpy(), want)
    # --trust means nothing to safetensors: said so, rather than ignored.
    code, _, err = run(capsys, "import", tmp_path / "model.safetensors", tmp_path / "again", "--trust")
    assert code == 2 and "--trust is for --from dcp" in err
