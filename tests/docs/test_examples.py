"""Every script in examples/ runs as a user would run it, exits 0 and prints what it promises;
the demo's figures are the bytes the library's read plan says each read costs."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

import layoutckpt as lc
from layoutckpt.engine._readplan import box_read, plan_reads
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


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess[str], Path]]:
    """Each example's run (made once, by the first test that needs it) and its directory."""
    return {}


def _run_once(script: Path, runs: dict, tmp_path_factory) -> tuple[subprocess.CompletedProcess[str], Path]:
    if script.name not in runs:
        tmp = tmp_path_factory.mktemp(script.stem)
        proc = _run(script, *(a.format(out=tmp / "out", tmp=tmp) for a in ARGS.get(script.name, [])))
        runs[script.name] = (proc, tmp)
    return runs[script.name]


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_example_runs(script: Path, runs, tmp_path_factory):
    proc, _ = _run_once(script, runs, tmp_path_factory)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{script.name} exited {proc.returncode}:\n{output}"
    for line in EXPECTED.get(script.name, []):
        assert line in proc.stdout, f"{script.name} did not print {line!r}:\n{output}"


def test_demo_help_prints_usage_and_writes_nothing(tmp_path: Path):
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "demo.py"), "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0 and proc.stdout.startswith("usage: demo.py"), proc.stdout + proc.stderr
    assert list(tmp_path.iterdir()) == []  # not a checkpoint under ./--help


def _demo_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("layoutckpt_demo", EXAMPLES / "demo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="the demo counts reads in Linux's /proc/self/io")
def test_demo_figures_are_the_bytes_read_and_written(runs, tmp_path_factory):
    """The bytes the demo prints are what was written and read: the save writes the model once,
    the slice reads a small part of its array, and each resuming rank reads what the read plan
    says its boxes cost (plus the root metadata document it opens)."""
    proc, tmp = _run_once(EXAMPLES / "demo.py", runs, tmp_path_factory)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    figures = json.loads((tmp / "out" / "figures.json").read_text())
    ckpt = tmp / "out" / "ckpt"
    files = [p for p in ckpt.rglob("*") if p.is_file()]

    save = figures["save"]
    assert save["written"] == sum(r["written"] for r in save["ranks"]) == figures["model_bytes"]
    assert all(r["written"] > 0 for r in save["ranks"])
    assert (save["files"], save["on_disk"]) == (len(files), sum(p.stat().st_size for p in files))
    assert figures["model_bytes"] < save["on_disk"] < 1.05 * figures["model_bytes"]

    # Rows 0:8: the shard index and the inner chunks holding them, a small part of the array.
    demo = _demo_module()
    meta = lc.open(ckpt).meta
    part = figures["slice"]
    rows = box_read(part["name"], meta.arrays[part["name"]], ((0, 8), (0, meta.arrays[part["name"]].shape[1])))
    assert part["read"] == rows.bytes_read + rows.overhead_bytes, part
    assert part["asked"] < part["read"] <= part["array"] // 4, part
    plans = plan_reads(meta, lc.Layout(lc.Mesh(demo.RESUME_MESH), demo.RESUME_RULES))
    root_doc = (ckpt / "zarr.json").stat().st_size
    ranks = figures["resume"]["ranks"]
    assert len(ranks) == len(plans) == 3
    for plan, got in zip(plans, ranks):
        assert got["loaded"] == plan.bytes_needed, (plan.rank, got)
        assert got["read"] == plan.bytes_read + plan.overhead_bytes + root_doc, (plan.rank, got)
    # tp=3 cuts fall inside inner chunks: the middle rank crosses the most chunk edges.
    assert ranks[1]["read"] > ranks[0]["read"] > ranks[0]["loaded"]
