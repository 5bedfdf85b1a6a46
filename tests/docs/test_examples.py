"""Every script in examples/ runs as a user would run it, exits 0 and prints what it promises."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import EXAMPLES, REPO

SCRIPTS = sorted(EXAMPLES.glob("*.py"))

# Arguments given to an example (``{out}``: a path that does not exist yet; ``{tmp}``: an empty
# directory), so that what it writes stays in the test's temporary directory.
ARGS = {"demo.py": ["{out}"], "train_loop.py": ["{tmp}"]}
# Lines (substrings) each example must print: every script in examples/ is listed, so a new one
# says what it shows.
EXPECTED = {
    "demo.py": [
        "[1] save from 4 ranks, Mesh({'dp': 2, 'tp': 2})",
        "same as the model's",
        "[2] read in one plain process (no torch.distributed)",
        "step 100, metadata {'model': 'llama-tiny', 'tokens_seen': 409600}",
        "rows 0:8 -> (8, 256)",
        "matches the full tensor",
        "[3] resume on 3 ranks, Mesh({'tp': 3})",
        "arrays on every rank equal torch.chunk slices of the full tensors",
        "demo: OK",
    ],
    "train_loop.py": [
        "uninterrupted losses: [",
        "resumed at step 6:",
        "committed steps kept (keep_last=2): [5, 7]",
        "train_loop: OK",
    ],
}


def _run(script: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    return subprocess.run(
        [sys.executable, str(script), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_every_example_is_checked():
    assert any(s.name == "demo.py" for s in SCRIPTS)
    assert set(EXPECTED) == {s.name for s in SCRIPTS}, "list what each script in examples/ must print in EXPECTED"
    assert set(ARGS) <= set(EXPECTED)


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_example_ranks_end_by_returning(script: Path):
    """Users copy the examples: a rank ends with destroy_process_group and a return, not os._exit."""
    assert "os._exit" not in script.read_text()


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_example_runs(script: Path, tmp_path: Path):
    proc = _run(script, *(a.format(out=tmp_path / "out", tmp=tmp_path) for a in ARGS.get(script.name, [])))
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{script.name} exited {proc.returncode}:\n{output}"
    for line in EXPECTED.get(script.name, []):
        assert line in proc.stdout, f"{script.name} did not print {line!r}:\n{output}"
