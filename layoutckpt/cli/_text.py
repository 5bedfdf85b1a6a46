"""Output shared by the commands: human sizes, aligned tables, strict JSON and progress bars."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from typing import Any

from ..layout._plan import Box


def human(nbytes: int) -> str:
    """``80 B``, ``1.5 KiB``, ``2.0 GiB``."""
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{nbytes} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def box_text(box: Box) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in box) + "]"


def table(rows: list[list[str]], right: Sequence[int] = ()) -> list[str]:
    """Rows of cells as aligned text columns (the columns in ``right`` aligned right).

    The last cell of a row is not padded, so it does not widen its column either (a value after
    a tree label may be long), unless its column is aligned right.
    """
    widths = [
        max((len(r[i]) for r in rows if i < len(r) - 1 or (i == len(r) - 1 and i in right)), default=0)
        for i in range(max(map(len, rows)))
    ]
    lines = []
    for r in rows:
        cells = [c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(r)]
        lines.append("  ".join(cells).rstrip())
    return lines


def json_safe(value: Any) -> Any:
    """Non-finite floats as the strings ``"nan"``, ``"inf"``, ``"-inf"``: the output stays strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def print_json(doc: Any) -> None:
    print(json.dumps(json_safe(doc), indent=2, allow_nan=False))


def progress(args: argparse.Namespace, total: int, what: str) -> Any:
    """A byte-counting bar on stderr: shown when stderr is a terminal, unless told otherwise."""
    from tqdm import tqdm

    shown = args.progress if getattr(args, "progress", None) is not None else sys.stderr.isatty()
    return tqdm(
        total=total,
        desc=what,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=sys.stderr,
        disable=not shown,
        leave=False,
        dynamic_ncols=True,
    )
