"""What a newcomer meets first: the argument order of ``save`` and ``load`` (the path first,
unlike ``torch.save``) caught in one line before anything is written; a missing checkpoint
named once, without ``[Errno 2]``, with what the path holds instead; ``demo.py --help``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import layoutckpt as lc
from tests.support.paths import REPO

STATE = {"w": torch.arange(12.0).reshape(3, 4), "b": np.zeros(3)}


def _one_line(err: BaseException) -> str:
    text = str(err)
    assert "\n" not in text
    return text


@pytest.mark.parametrize("verb", [lc.save, lc.save_async])
def test_a_state_where_the_path_goes_is_refused_before_anything_is_written(tmp_path, monkeypatch, verb):
    monkeypatch.chdir(tmp_path)
    for state in (STATE, STATE["w"], STATE["b"]):
        with pytest.raises(TypeError) as info:
            verb(state, "ckpt")  # torch.save's order
        text = _one_line(info.value)
        assert f"lc.{verb.__name__}(path, state, layout) takes the path first" in text
        assert "swap them" in text
    with pytest.raises(TypeError, match=r"takes a state .* pass lc.get_state"):
        verb("ckpt", torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"takes an lc.Layout \(or None\) as layout, got a str"):
        verb("ckpt", STATE, "ckpt2")
    assert list(tmp_path.iterdir()) == []
    # A TensorStore kvstore spec is a dict too, and still a path.
    done = verb({"driver": "memory", "path": f"order-{verb.__name__}/"}, STATE)
    if isinstance(done, lc.SaveFuture):
        done.result()
    assert lc.open({"driver": "memory", "path": f"order-{verb.__name__}/"}).keys() == ["w", "b"]


@pytest.mark.parametrize("verb", [lc.load, lc.load_async])
def test_load_says_which_argument_is_of_the_wrong_kind(tmp_path, verb):
    path = tmp_path / "ck"
    lc.save(path, STATE)
    with pytest.raises(TypeError, match=r"takes the path first; .* swap them"):
        verb(STATE, path)
    with pytest.raises(TypeError, match=r"second argument, got a dict .*; pass a template as like="):
        verb(path, {"w": torch.empty(3, 4)})
    with pytest.raises(TypeError, match=r"as layout, got a str"):
        verb(path, "cpu")  # torch.load's map_location
    with pytest.raises(TypeError, match="got a torch Tensor as path"):
        verb(STATE["w"])


def test_a_missing_checkpoint_is_named_once_and_says_what_is_there(tmp_path):
    (tmp_path / "runs" / "a").mkdir(parents=True)
    lc.save(tmp_path / "runs" / "step_00000002", STATE)
    lc.save(tmp_path / "runs" / "step_00000009", STATE)
    (tmp_path / "half" / "w").mkdir(parents=True)
    (tmp_path / "half" / "w" / "zarr.json").write_text('{"zarr_format": 3, "node_type": "array"}')
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    cases = {
        tmp_path / "nope": "",
        tmp_path
        / "runs": f"holds checkpoints, not one: name one of them, e.g. '{tmp_path / 'runs' / 'step_00000009'}'",
        tmp_path / "half": "holds Zarr arrays but no commit marker zarr.json at its top: a save or copy that never",
        tmp_path / "empty": "is not a checkpoint: it holds no commit marker zarr.json and no Zarr arrays",
        tmp_path / "file": "it is a file",
    }
    for path, hint in cases.items():
        with pytest.raises(lc.CheckpointNotFoundError) as info:
            lc.open(path)
        text = _one_line(info.value)
        assert "Errno" not in text and text.count(f"'{path}'") == 1, text
        assert text.startswith(f"no committed layoutckpt checkpoint at '{path}'") and hint in text, text
        assert info.value.errno == 2 and info.value.filename == str(path)
    # A run root holding other checkpoints only two levels down says so too.
    with pytest.raises(lc.CheckpointNotFoundError, match="holds checkpoints, not one"):
        lc.load(tmp_path)
    # The manager's own errors print the same way.
    with lc.CheckpointManager(tmp_path / "empty") as mgr, pytest.raises(lc.CheckpointNotFoundError) as info:
        mgr.load()
    assert "Errno" not in str(info.value) and str(info.value).count(str(tmp_path / "empty")) == 1


def test_the_demo_prints_its_help_and_writes_nothing(tmp_path):
    demo = Path(REPO) / "examples" / "demo.py"
    proc = subprocess.run(
        [sys.executable, str(demo), "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage:") and "OUTPUT_DIR" in proc.stdout
    assert list(tmp_path.iterdir()) == []
