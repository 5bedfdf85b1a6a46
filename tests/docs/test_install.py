"""The package as a user installs it: an sdist and a wheel built from this checkout, the wheel
installed into a fresh venv without torch, and the command line and a NumPy save and load run
from a directory outside the source tree.

The build calls setuptools' PEP 517 hooks as ``python -m build --no-isolation`` does (sdist
first, then the wheel from the unpacked sdist, so the sdist is shown to hold all a build needs).
The venv gets its dependencies as links to the ones installed here, chosen by the wheel's own
``Requires-Dist``, and pip installs the wheel with ``--no-index``: nothing is downloaded, and
pip refuses if a declared dependency is missing. ``make check-wheel`` does the same with
``python -m build`` and the package index, torch included, and runs the demo.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import layoutckpt
from tests.support.paths import GOLDEN, REPO

# What the sdist is made from: the files pyproject.toml and setuptools read.
SOURCES = ("pyproject.toml", "README.md", "layoutckpt")


def _build(tmp: Path) -> tuple[Path, Path]:
    """(sdist, wheel) built from a copy of the checkout, so that no build output lands in it."""
    src, out = tmp / "src", tmp / "dist"
    src.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, src / name)
    out.mkdir()
    hook = "import sys; from setuptools import build_meta as b; print(getattr(b, sys.argv[1])(sys.argv[2]))"
    sdist = out / _call(hook, "build_sdist", out, cwd=src)
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp / "unpacked", filter="data")
    (unpacked,) = (tmp / "unpacked").iterdir()
    wheel = out / _call(hook, "build_wheel", out, cwd=unpacked)
    return sdist, wheel


def _call(code: str, *args: object, cwd: Path) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.strip().splitlines()[-1]


def _closure(requires: list[str]) -> list[md.Distribution]:
    """The installed distributions ``requires`` (Requires-Dist lines, no extras) needs, transitively."""
    found: dict[str, md.Distribution] = {}
    todo = [(Requirement(r), "") for r in requires]
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        dist = md.distribution(req.name)
        assert req.specifier.contains(dist.version, prereleases=True), f"{req}, but {dist.version} is installed"
        if name not in found:
            found[name] = dist
            todo += [(Requirement(r), "") for r in dist.requires or []]
        for wanted in req.extras:
            todo += [(Requirement(r), wanted) for r in dist.requires or []]
    return list(found.values())


def _venv_with(tmp: Path, dists: list[md.Distribution]) -> Path:
    """A fresh venv (no pip, no system site-packages) whose site-packages links to ``dists``."""
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    (site,) = venv.glob("lib/python*/site-packages")
    for dist in dists:
        top = {Path(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")} - {"__pycache__"}
        for name in top:
            target = Path(dist.locate_file(name))
            if target.exists() and not (site / name).exists():
                (site / name).symlink_to(target)
    return venv


def _metadata(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as z:
        (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        return z.read(meta).decode()


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("install")
    sdist, wheel = _build(tmp)
    metadata = _metadata(wheel).splitlines()
    requires = [line.split(": ", 1)[1] for line in metadata if line.startswith("Requires-Dist: ")]
    venv = _venv_with(tmp, _closure([r for r in requires if "extra ==" not in r]))
    pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--no-index"]
    proc = subprocess.run([*pip, str(wheel)], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    away = tmp / "elsewhere"
    away.mkdir()
    return {"sdist": sdist, "wheel": wheel, "venv": venv, "cwd": away}


def _run(installed: dict[str, Path], *argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = str(installed["venv"] / "bin") + os.pathsep + env.get("PATH", "")
    proc = subprocess.run(argv, cwd=installed["cwd"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{argv} exited {proc.returncode}:\n{proc.stdout}{proc.stderr}"
    return proc


def test_the_sdist_and_wheel_hold_the_package(installed):
    version = layoutckpt.__version__
    assert installed["sdist"].name == f"layoutckpt-{version}.tar.gz"
    assert installed["wheel"].name == f"layoutckpt-{version}-py3-none-any.whl"
    with tarfile.open(installed["sdist"]) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert {"pyproject.toml", "README.md", "layoutckpt/__init__.py", "layoutckpt/cli/_main.py"} <= names
    with zipfile.ZipFile(installed["wheel"]) as z:
        files = set(z.namelist())
        (entry,) = [n for n in files if n.endswith(".dist-info/entry_points.txt")]
        assert "layoutckpt = layoutckpt.cli._main:main" in z.read(entry).decode()
    # Every module of the package is in the wheel, and nothing from tests/ or examples/.
    modules = {p.relative_to(REPO).as_posix() for p in (REPO / "layoutckpt").rglob("*.py")}
    assert modules <= files
    assert not any(n.startswith(("tests/", "examples/", "benchmarks/")) for n in files)
    # torch is an extra, not a dependency.
    metadata = _metadata(installed["wheel"])
    assert 'Requires-Dist: torch<3,>=2.6; extra == "torch"' in metadata
    assert not [
        line for line in metadata.splitlines() if line.startswith("Requires-Dist: torch") and "extra" not in line
    ]


def test_the_installed_command_line_runs_without_torch(installed):
    venv_bin = installed["venv"] / "bin"
    proc = _run(installed, str(venv_bin / "layoutckpt"), "--version")
    assert proc.stdout.strip() == f"layoutckpt {layoutckpt.__version__}"
    golden = GOLDEN / "v2" / "basic"
    saved = json.loads((golden / "zarr.json").read_text())["attributes"]["layoutckpt"]
    listing = json.loads(_run(installed, str(venv_bin / "layoutckpt"), "ls", str(golden), "--json").stdout)
    assert (listing["step"], listing["format_version"]) == (saved["step"], saved["format_version"])
    proc = _run(installed, str(venv_bin / "python"), "-m", "layoutckpt", "verify", str(golden))
    assert ": OK (" in proc.stdout


def test_the_installed_package_saves_and_loads_numpy_without_torch(installed):
    code = textwrap.dedent(
        """
        import importlib.util, json, sys
        import numpy as np
        import layoutckpt as lc

        assert importlib.util.find_spec("torch") is None  # not installed, not merely hidden
        state = {"w": np.arange(64 * 32, dtype=np.float32).reshape(64, 32), "step": 7}
        lc.save("ck", state, lc.Layout.replicated(), step=7)
        out = lc.load("ck")
        part = lc.open("ck").read("w", np.s_[3:5, :4])
        print(json.dumps({"file": lc.__file__, "prefix": sys.prefix, "step": out["step"],
                          "same": bool(np.array_equal(out["w"], state["w"])), "part": part.tolist()}))
        """
    )
    got = json.loads(_run(installed, str(installed["venv"] / "bin" / "python"), "-c", code).stdout)
    assert Path(got["file"]).is_relative_to(installed["venv"]), got["file"]  # the wheel's copy, not the checkout
    assert Path(got["prefix"]) == installed["venv"]
    assert got["step"] == 7 and got["same"]
    assert got["part"] == np.arange(64 * 32, dtype=np.float32).reshape(64, 32)[3:5, :4].tolist()
