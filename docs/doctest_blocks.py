"""A Griffe extension for the API reference: docstring doctests become code blocks.

The docstrings of layoutckpt show examples as bare doctests (``>>> P("tp", None)``), not under a
Google-style ``Examples:`` section. Rendered as Markdown, ``>>>`` would start a nested block
quote and ``\\.`` in a regex would lose its backslash, so the reference would show code that is
wrong. This turns each run of doctest lines into a fenced ``pycon`` block and drops
``# doctest:`` flags. mkdocs.yml loads it (``extensions:`` of the python handler).
"""

from __future__ import annotations

import re
import textwrap
from typing import Any

import griffe

_FLAG = re.compile(r"\s*#\s*doctest:.*$")


def fence_doctests(text: str) -> str:
    """``text`` with every doctest example (``>>>`` lines and their output) in a code fence.

    An example runs from a ``>>>`` line to the next blank line, as doctest reads it.
    """
    out: list[str] = []
    block: list[str] = []

    def flush() -> None:
        if block:
            if out and out[-1].strip():
                out.append("")
            out.extend(["```pycon", *textwrap.dedent("\n".join(block)).splitlines(), "```"])
            block.clear()

    for line in text.splitlines():
        if line.lstrip().startswith(">>>") or (block and line.strip()):
            block.append(_FLAG.sub("", line))
        else:
            flush()
            out.append(line)
    flush()
    return "\n".join(out)


class DoctestBlocks(griffe.Extension):
    """Fence the doctests of every docstring once the package is loaded."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        # An alias shares its target's docstring: fence it once.
        if obj.docstring is not None and ">>>" in obj.docstring.value and "```pycon" not in obj.docstring.value:
            obj.docstring.value = fence_doctests(obj.docstring.value)
