"""Repository paths the tests read, named once so that no test counts ``.parent`` levels."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
GOLDEN = TESTS / "golden"
SPECS = REPO / "specs"
EXAMPLES = REPO / "examples"
BENCHMARKS = REPO / "benchmarks"
