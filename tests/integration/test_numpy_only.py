"""Without torch installed, layoutckpt still reads: ``lc.open``, ``lc.load`` (NumPy arrays), the
command line and ``layoutckpt.jax``.

Each case runs in a fresh interpreter where ``import torch`` fails, as it does where torch is not
installed (``sys.modules['torch'] = None`` makes every ``import torch...`` raise ImportError).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import torch

import layoutckpt as lc

NO_TORCH = "import sys; sys.modules['torch'] = None\n"


def _run(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-c", NO_TORCH + textwrap.dedent(code), *args], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return proc


def _checkpoint(tmp_path):
    path = tmp_path / "ck"
    state = {
        "w": torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32),
        "e": torch.arange(16, dtype=torch.bfloat16),
        "meta": {"step": 5, "name": "tiny"},
    }
    lc.save(path, state, metadata={"run": "a"}, rank_state={"rng": torch.arange(4, dtype=torch.uint8)})
    return path


def test_open_and_load_without_torch(tmp_path):
    path = _checkpoint(tmp_path)
    proc = _run(
        """
        import json, numpy as np, layoutckpt as lc
        path = sys.argv[1]
        assert "torch" not in [m for m in sys.modules if sys.modules[m] is not None]
        with lc.open(path) as rd:
            part = rd.read("w", np.s_[3:5, :4])
            meta = rd.metadata
        out = lc.load(path)
        assert isinstance(out["w"], np.ndarray) and str(out["e"].dtype) == "bfloat16"
        (rank0,) = lc.open(path).rank_states()  # torch tensors saved there come back as NumPy
        assert rank0["rng"].tolist() == [0, 1, 2, 3] and isinstance(rank0["rng"], np.ndarray)
        print(json.dumps({"part": part.tolist(), "meta": meta, "step": out["meta"]["step"],
                          "e": out["e"].astype(np.float32).tolist(), "sum": float(out["w"].sum())}))
        """,
        str(path),
    )
    got = json.loads(proc.stdout)
    assert got["part"] == np.arange(64 * 32, dtype=np.float32).reshape(64, 32)[3:5, :4].tolist()
    assert got["meta"] == {"run": "a"} and got["step"] == 5
    assert got["e"] == list(range(16)) and got["sum"] == float(np.arange(64 * 32).sum())


def test_numpy_save_without_torch(tmp_path):
    _run(
        """
        import numpy as np, layoutckpt as lc
        lc.save(sys.argv[1], {"x": np.arange(10.0)})
        assert lc.open(sys.argv[1]).read("x").tolist() == list(np.arange(10.0))
        """,
        str(tmp_path / "np"),
    )


def test_cli_without_torch(tmp_path):
    path = _checkpoint(tmp_path)
    proc = _run(
        """
        from layoutckpt.cli._main import main
        raise SystemExit(main(["ls", sys.argv[1], "--json"]))
        """,
        str(path),
    )
    listing = json.loads(proc.stdout)
    assert "w" in json.dumps(listing) and "bfloat16" in json.dumps(listing)
    proc = _run(
        """
        from layoutckpt.cli._main import main
        raise SystemExit(main(["verify", sys.argv[1]]))
        """,
        str(path),
    )
    out = tmp_path / "part.npy"
    _run(
        """
        from layoutckpt.cli._main import main
        raise SystemExit(main(["read", sys.argv[1], "w", "--slice", "0:8,:", "--out", sys.argv[2]]))
        """,
        str(path),
        str(out),
    )
    np.testing.assert_array_equal(np.load(out), np.arange(64 * 32, dtype=np.float32).reshape(64, 32)[:8])
