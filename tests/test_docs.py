"""Docs that run: every ``python`` code block in ``docs/`` executes, and every JSON block parses."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def _blocks(kind: str) -> list[tuple[str, str]]:
    found = []
    for page in sorted(DOCS.glob("**/*.md")):
        for i, match in enumerate(m for m in BLOCK.finditer(page.read_text()) if m.group(1) == kind):
            found.append((f"{page.name}#{kind}{i}", match.group(2)))
    return found


@pytest.mark.parametrize(("where", "code"), _blocks("python"), ids=lambda v: v if "#" in str(v) else "")
def test_python_blocks_run(where, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(code, where, "exec"), {"__name__": "__docs__"})


@pytest.mark.parametrize(("where", "text"), _blocks("json"), ids=lambda v: v if "#" in str(v) else "")
def test_json_blocks_parse(where, text):
    json.loads(text)


def test_docs_have_runnable_blocks():
    assert _blocks("python"), "docs/ should show at least one runnable example"
