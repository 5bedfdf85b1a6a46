"""``layoutckpt plan``: which chunks and bytes each rank of a target layout would read, from the
pure ``engine._readplan`` (no data is read).

A layout whose ranks hold different names (stage axes, name rules) or whose rules fuse or pad
tensors is planned as a load with each rank's own model as ``like=`` reads: a stored part of a
fused tensor is read with the fused rule's inner spec, a padded array with the padded rule's (its
pieces as ``torch.chunk`` cuts the logical rows), and an array that a ``Renumber`` rule places on
one stage coordinate is read by that coordinate's ranks only. The output says which rule, spec,
stage and local name each stored array gets.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from ..base._errors import LayoutError
from ..engine import _readplan
from ..format._format import CheckpointMeta
from ..layout._layout import Layout
from ..layout._names import Renumber
from ..layout._spec import Mesh, P
from ..layout._views import Fused, Padded, part_name
from ._common import UsageError, name_regex, open_checkpoint
from ._text import box_text, human, plural, print_json, table


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
        # The fix names the command's option, and only where the mesh is what is wrong.
        text = str(err).replace("pass mesh= to Layout.from_file", "pass --mesh axis=size,...")
        fix = "pass a --mesh with the axes its rules name" if mesh else "pass the mesh as --mesh axis=size,..."
        about_mesh = "mesh" in text.lower() and "--mesh" not in text
        raise UsageError(f"{text}; {fix}" if about_mesh else text) from None
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


# ----------------------------------------------------------------------------- views and stages


def has_views(layout: Layout) -> bool:
    """Whether ranks hold different names, or rules fuse or pad tensors: then ``plan`` shows
    how each stored array is read, and by which stage."""
    return bool(layout.stage_axes or layout.names or layout.replicas) or any(
        isinstance(s, Fused | Padded) for _, s in layout.rules
    )


@attrs.frozen
class Applied:
    """How a load under the layout reads one stored array, and which ranks hold it."""

    array: str
    rule: str | None  # the pattern of the rule that decides it
    spec: Any  # that rule's spec (a fused part's: the fused rule's)
    read: Any  # the spec the stored array is read with (a P, but for rules plan cannot cover)
    fused: str | None = None  # the fused tensor it is a part of
    part: str | None = None
    stage: tuple[tuple[str, int | None], ...] = ()  # (axis, coordinate holding it; None: no coordinate)
    local: str | None = None  # its name on that stage (the fused tensor's, for a part)

    def held_by(self, coords: dict[str, int]) -> bool:
        return all(coords[axis] == c for axis, c in self.stage)

    def doc(self) -> dict[str, Any]:
        return {
            "array": self.array,
            "rule": self.rule,
            "spec": repr(self.spec) if self.spec is not None else None,
            "read_spec": self.read.to_json() if isinstance(self.read, P) else None,
            "fused": self.fused,
            "part": self.part,
            "stage": {axis: c for axis, c in self.stage} if self.stage else None,
            "local": self.local,
        }


def _fused_of(layout: Layout, name: str, stored: set[str]) -> tuple[str, str, str, Fused] | None:
    """(fused name, part, pattern, rule) where ``name`` is the stored part of a tensor a Fused rule
    decides (and which is not itself stored)."""
    for pattern, spec in layout.rules:
        if not isinstance(spec, Fused):
            continue
        head, _, last = name.rpartition(".")
        for part, _ in spec.parts:
            if head.endswith("." + part):
                fused = f"{head[: -len(part) - 1]}.{last}"  # "a.qkv.q.weight" of "a.qkv.weight"
            elif last == part:
                fused = head  # "x.q" of "x", a name without a dot
            else:
                continue
            if part_name(fused, part) != name or fused in stored:
                continue
            rule = layout.rule_for(fused)
            if rule is not None and rule[0] == pattern and rule[1] is spec:
                return fused, part, pattern, spec
    return None


def _unnumbered(layout: Layout, name: str) -> tuple[tuple[tuple[str, int | None], ...], str]:
    """The stage coordinates the ``Renumber`` rules place ``name`` on, and its local name there."""
    stage: list[tuple[str, int | None]] = []
    local = name
    for rule in layout.names:
        if not isinstance(rule, Renumber):
            continue
        match = re.search(rule.pattern, local)
        if match is None:
            continue
        number = int(match.group(1))
        at = None
        for c in range(layout.mesh.axis_size(rule.axis)):
            first, end = rule.span(c)
            if first <= number and (end is None or number < end):
                at = c
                local = f"{local[: match.start(1)]}{number - first}{local[match.end(1) :]}"
                break
        stage.append((rule.axis, at))
    return tuple(stage), local


def applied(layout: Layout, name: str, stored: set[str]) -> Applied:
    """How ``name`` (a stored array, or a leaf of the stored tree) is read under ``layout``."""
    found = _fused_of(layout, name, stored)
    if found is not None:
        fused, part, pattern, spec = found
        stage, local = _unnumbered(layout, fused)
        return Applied(name, pattern, spec, spec.spec, fused, part, stage, local)
    rule = layout.rule_for(name)
    pattern, spec = rule if rule is not None else (None, None)
    read = spec.spec if isinstance(spec, Fused | Padded) else spec
    stage, local = _unnumbered(layout, name)
    return Applied(name, pattern, spec, read, stage=stage, local=local)


class ViewedLayout:
    """What ``_readplan`` asks of a layout (``mesh``, ``spec_for``), for a layout with views:
    each stored array's spec as ``applied`` finds it."""

    def __init__(self, layout: Layout, meta: CheckpointMeta) -> None:
        self.layout, self.mesh = layout, layout.mesh
        self.stored = set(meta.arrays)
        self.arrays = {name: applied(layout, name, self.stored) for name in meta.arrays}
        self.tied: dict[str, Applied] = {}  # other names of the stored tree's leaves

    def shown(self, select: Callable[[str], bool] | None) -> list[Applied]:
        """The stored arrays ``select`` picks, in the checkpoint's order."""
        return [a for name, a in self.arrays.items() if select is None or select(name)]

    def of(self, name: str) -> Applied:
        if name in self.arrays:
            return self.arrays[name]
        if name not in self.tied:
            self.tied[name] = applied(self.layout, name, self.stored)
        return self.tied[name]

    def spec_for(self, name: str) -> Any:
        a = self.of(name)
        return a.read if a.spec is not None else self.layout.spec_for(name)  # no rule: the layout's error

    def select(self, rank: int, select: Callable[[str], bool] | None) -> Callable[[str], bool]:
        """The leaves ``rank`` reads: those of its stage coordinates (and ``select``'s)."""
        coords = self.mesh.coords(rank)
        return lambda name: (select is None or select(name)) and self.of(name).held_by(coords)


def _spans(rule: Renumber, size: int) -> str:
    shown = []
    for c in range(min(size, 8)):
        first, end = rule.span(c)
        shown.append(f"{rule.axis}={c}: {first}-{end - 1 if end is not None else ''}")
    return ", ".join(shown) + (f", ... ({size} coordinates)" if size > 8 else "")


def _parts_text(pattern: str, spec: Fused) -> str:
    parts = ", ".join(part_name("<name>", p) for p, _ in spec.parts)
    how = f"{spec.groups} groups interleaved" if spec.groups else "concatenated"
    return f"stored as its parts {parts} ({how} along dimension {spec.dim}), each split by {spec.spec!r}"


def describe_views(layout: Layout, viewed: ViewedLayout, select: Callable[[str], bool] | None) -> list[str]:
    """The text ``plan`` prints for a layout with views: its stage axes, name rules, replica
    policies and fused or padded rules, then how each stored array is read and by whom."""
    mesh = layout.mesh
    lines = []
    if layout.stage_axes:
        axes = ", ".join(f"{a} ({plural(mesh.axis_size(a), 'coordinate')})" for a in layout.stage_axes)
        lines.append(f"stage axes: {axes}; each rank reads the arrays of its own stage coordinates only")
    if layout.names:
        lines.append("name rules, applied in order to the names a rank holds (stored names are global):")
        for rule in layout.names:
            spans = f"  {_spans(rule, mesh.axis_size(rule.axis))}" if isinstance(rule, Renumber) else ""
            lines.append(f"  {rule!r}{spans}")
    if layout.replicas:
        policies = ", ".join(f"{p!r} -> {policy}" for p, policy in layout.replicas)
        lines.append(f"copies held by several stages (at save): {policies}")
    views = [(p, s) for p, s in layout.rules if isinstance(s, Fused | Padded)]
    if views:
        lines.append("fused and padded rules:")
        for pattern, spec in views:
            if isinstance(spec, Fused):
                what = _parts_text(pattern, spec)
            else:
                what = (
                    f"its {spec.size} logical rows along dimension {spec.dim} stored, split by {spec.spec!r} "
                    f"(planned as torch.chunk cuts them; a padded model's pieces may be a few rows longer); "
                    f"padding is not stored (read back as {spec.value!r})"
                )
            lines.append(f"  {pattern!r}: {spec!r}")
            lines.append(f"    {what}")
    shown = viewed.shown(select)
    rows = [["array", "rule", "from", "read as", "stage", "local name"]]
    for a in shown:
        if a.fused is not None:
            origin = f"part {a.part} of {a.fused}"
        elif isinstance(a.spec, Padded):
            origin = f"padded, {a.spec.size} rows"
        else:
            origin = ""
        stage = ", ".join(f"{axis}={'none' if c is None else c}" for axis, c in a.stage) or (
            "every" if layout.stage_axes else ""
        )
        rule = repr(a.rule) if a.rule is not None else "(none)"
        rows.append([a.array, rule, origin, repr(a.read), stage, a.local if a.local != a.array else ""])
    lines.append(f"{plural(len(shown), 'stored array')}, as a load with each rank's model reads them:")
    lines += ["  " + line for line in table(rows)]
    if layout.stage_axes:
        everywhere = [a.array for a in shown if not a.stage]
        if everywhere:
            lines.append(
                f"{plural(len(everywhere), 'array')} that no Renumber rule places on a stage (e.g. "
                f"{everywhere[0]!r}): counted for every stage; a load reads each on the stages whose model holds it"
            )
    lost = [a.array for a in shown if any(c is None for _, c in a.stage)]
    if lost:
        lines.append(
            f"{plural(len(lost), 'array')} numbered past the last stage coordinate (e.g. {lost[0]!r}): no rank "
            "reads them; check the Renumber rules' per=/starts= against this mesh"
        )
    return lines


def cmd_plan(args: argparse.Namespace) -> int:
    layout, described = target_layout(args)
    with open_checkpoint(args.path) as rd:
        meta = rd.meta
    if args.rank is not None and not 0 <= args.rank < layout.mesh.size:
        raise UsageError(f"--rank {args.rank} is outside {layout.mesh!r}, which has ranks 0 to {layout.mesh.size - 1}")
    select = name_regex(args.select).search if args.select else None
    ranks = range(layout.mesh.size) if args.rank is None else [args.rank]
    viewed = ViewedLayout(layout, meta) if has_views(layout) else None
    try:
        if viewed is None:
            plans = _readplan.plan_reads(meta, layout, ranks, select)
        else:
            # ViewedLayout answers what the read plan asks of a layout (its mesh and specs).
            plans = [_readplan.rank_reads(meta, viewed, r, viewed.select(r, select)) for r in ranks]  # type: ignore[arg-type]
    except LayoutError as err:
        raise UsageError(f"{err}; fix {args.spec or '--mesh'}") from None
    if args.json:
        doc = {
            "path": args.path,
            "mesh": dict(layout.mesh.axes),
            "layout": layout.to_json(),
            "ranks": [{"rank": p.rank, **totals_doc([p]), "reads": [read_doc(r) for r in p.reads]} for p in plans],
            "total": totals_doc(plans),
            "checkpoint_bytes": _readplan.bytes_per_replica(meta),
        }
        if viewed is not None:
            doc["views"] = {
                "stage_axes": list(layout.stage_axes),
                "names": [repr(rule) for rule in layout.names],
                "replicas": [list(r) for r in layout.replicas],
                "rules": [[p, repr(s)] for p, s in layout.rules],
                "arrays": [a.doc() for a in viewed.shown(select)],
            }
        print_json(doc)
        return 0
    print(f"load of {args.path} under {described}")
    if viewed is not None:
        for line in describe_views(layout, viewed, select):
            print(line)
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
