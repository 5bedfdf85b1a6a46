"""``layoutckpt plan``: which chunks and bytes each rank of a target layout would read, from the
pure ``engine._readplan.plan_reads`` (no data is read)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any

from ..base._errors import LayoutError
from ..engine import _readplan
from ..layout._layout import Layout
from ..layout._spec import Mesh
from ._common import UsageError, name_regex, open_checkpoint
from ._text import box_text, human, print_json, table


def parse_mesh(text: str) -> Mesh:
    """``dp=2,tp=4`` as ``Mesh({"dp": 2, "tp": 4})``."""
    axes: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",")):
        name, sep, size = part.partition("=")
        if not sep or not size.strip().isdigit():
            raise UsageError(f"bad --mesh {text!r}: {part!r} is not axis=size; write e.g. --mesh dp=2,tp=4")
        if name.strip() in axes:
            raise UsageError(f"bad --mesh {text!r}: axis {name.strip()!r} appears twice")
        axes[name.strip()] = int(size)
    try:
        return Mesh(axes)
    except LayoutError as err:
        raise UsageError(f"bad --mesh {text!r}: {err}") from None


def target_layout(args: argparse.Namespace) -> tuple[Layout, str]:
    mesh = parse_mesh(args.mesh) if args.mesh else None
    if args.spec is None:
        layout = Layout.replicated(mesh)
        return layout, f"every array whole on {layout.mesh!r}"
    if not os.path.isfile(args.spec):
        raise UsageError(f"no spec file {args.spec!r}; pass a TOML layout such as specs/fsdp.toml")
    try:
        layout = Layout.from_file(args.spec, mesh)
    except LayoutError as err:
        fix = "pass a --mesh with the axes its rules name" if mesh else "pass the mesh as --mesh axis=size,..."
        raise UsageError(f"{err}; {fix}") from None
    return layout, f"{args.spec} on {layout.mesh!r}"


def read_doc(r: _readplan.BoxRead) -> dict[str, Any]:
    return {
        "array": r.array,
        "box": [list(b) for b in r.box],
        "chunks": r.chunks,
        "shards": r.shards,
        "bytes_needed": r.bytes_needed,
        "bytes_read": r.bytes_read,
        "overhead_bytes": r.overhead_bytes,
        "amplification": r.amplification,
        "compressed": r.compressed,
    }


def totals_doc(plans: Sequence[_readplan.RankReads]) -> dict[str, Any]:
    needed = sum(p.bytes_needed for p in plans)
    read = sum(p.bytes_read for p in plans)
    return {
        "reads": sum(len(p.reads) for p in plans),
        "chunks": sum(p.chunks for p in plans),
        "bytes_needed": needed,
        "bytes_read": read,
        "overhead_bytes": sum(p.overhead_bytes for p in plans),
        "amplification": read / needed if needed else 1.0,
    }


def cmd_plan(args: argparse.Namespace) -> int:
    layout, described = target_layout(args)
    with open_checkpoint(args.path) as rd:
        meta = rd.meta
    if args.rank is not None and not 0 <= args.rank < layout.mesh.size:
        raise UsageError(f"--rank {args.rank} is outside {layout.mesh!r}, which has ranks 0 to {layout.mesh.size - 1}")
    select = name_regex(args.select).search if args.select else None
    try:
        plans = _readplan.plan_reads(meta, layout, None if args.rank is None else [args.rank], select)
    except LayoutError as err:
        raise UsageError(f"{err}; fix {args.spec or '--mesh'}") from None
    if args.json:
        print_json(
            {
                "path": args.path,
                "mesh": dict(layout.mesh.axes),
                "layout": layout.to_json(),
                "ranks": [{"rank": p.rank, **totals_doc([p]), "reads": [read_doc(r) for r in p.reads]} for p in plans],
                "total": totals_doc(plans),
                "checkpoint_bytes": _readplan.bytes_per_replica(meta),
            }
        )
        return 0
    print(f"load of {args.path} under {described}")
    if args.rank is not None:
        p = plans[0]
        rows = [["array", "box", "chunks", "shards", "needed", "read", "amplification"]]
        for r in p.reads:
            counts = [str(r.chunks), str(r.shards), human(r.bytes_needed), human(r.bytes_read)]
            rows.append([r.array, box_text(r.box), *counts, f"{r.amplification:.2f}x"])
        print(f"rank {p.rank} {layout.mesh.coords(p.rank)}:")
        for line in table(rows, right=(2, 3, 4, 5, 6)):
            print("  " + line)

    def row(label: str, t: dict[str, Any]) -> list[str]:
        sizes = [human(t[k]) for k in ("bytes_needed", "bytes_read", "overhead_bytes")]
        return [label, str(t["reads"]), str(t["chunks"]), *sizes, f"{t['amplification']:.2f}x"]

    rows = [["rank", "reads", "chunks", "needed", "read", "index+crc", "amplification"]]
    rows += [row(str(p.rank), totals_doc([p])) for p in plans]
    if len(plans) > 1:
        rows.append(row("all", totals_doc(plans)))
    for line in table(rows, right=range(7)):
        print("  " + line)
    if any(r.compressed for p in plans for r in p.reads):
        print("compressed arrays: 'read' counts decoded bytes; storage returns fewer")
    return 0
