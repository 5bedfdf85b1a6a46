"""The ``layoutckpt`` command line: look into, check, read, plan for, export and prune checkpoints.

    layoutckpt ls PATH                         arrays, specs, values, metadata (or a run's steps)
    layoutckpt read PATH NAME [--slice 0:8,:]  one tensor, a slice of it, or a value
    layoutckpt verify PATH                     every checksum, every shard present; exit 1 if not
    layoutckpt plan PATH --spec F --mesh dp=2  what a load under another layout would read
    layoutckpt export PATH --to safetensors D  Hugging Face files
    layoutckpt gc ROOT --keep-last N           a CheckpointManager's retention, from outside

It needs NumPy and TensorStore only, never torch, so it runs wherever a checkpoint can be
read. Errors are one line on stderr naming the thing and the fix: exit 2 for bad usage, 1 for
what is missing or damaged; ``LAYOUTCKPT_DEBUG=1`` shows the traceback instead. Progress bars
go to stderr when it is a terminal (``--progress``/``--no-progress`` override).

This module parses and prints; the work is done by library functions: ``_verify.verify``,
``_readplan.plan_reads`` (pure), ``export_safetensors`` and ``_manager.collect_garbage``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import difflib
import json
import math
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from .._reader import Reader
from ..base._errors import (
    CheckpointNotFoundError,
    FormatError,
    IntegrityError,
    LayoutError,
    ManagerLockedError,
)
from ..base._version import __version__
from ..engine import _readplan
from ..format._dtypes import ZARR_TO_NUMPY, numpy_dtype
from ..format._format import ArrayMeta, CheckpointMeta
from ..layout._layout import Layout
from ..layout._plan import Box, box_shape
from ..layout._spec import Mesh
from ..layout._tree import decode_value
from ..storage import _store

PROG = "layoutckpt"
# Pieces of one array read at once by `read` (each at most ``_fetch.PIECE_BYTES``).
READS_IN_FLIGHT = 4
SIZE_UNITS = {
    "": 1,
    **{p: 1000 ** (i + 1) for i, p in enumerate("kmgt")},
    **{p + "i": 1024 ** (i + 1) for i, p in enumerate("kmgt")},
}


class UsageError(Exception):
    """Bad input on the command line (exit 2)."""


class NotFound(Exception):
    """A name or path the command was given does not exist (exit 1)."""


# --- output helpers ----------------------------------------------------------------------------


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


def name_regex(text: str) -> re.Pattern[str]:
    try:
        return re.compile(text)
    except re.error as err:
        raise UsageError(
            f"--select {text!r} is not a regular expression ({err}); write e.g. --select '^model\\.'"
        ) from None


def open_checkpoint(path: str) -> Reader:
    try:
        return Reader(path)
    except CheckpointNotFoundError as err:
        raise NotFound(f"{err.strerror}; check the path (`layoutckpt ls` lists a run's steps)") from None


def array_or_value(rd: Reader, name: str) -> None:
    if name in rd:
        return
    known = [*rd.keys(), *rd.aliases, *rd.value_keys()]
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6) or [k for k in known if name in k][:3]
    hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
    raise NotFound(f"no array or value {name!r} in checkpoint {rd.path!r}{hint} (`layoutckpt ls {rd.path}` lists them)")


# --- ls -----------------------------------------------------------------------------------------


def array_doc(a: ArrayMeta, default_mesh: Mesh) -> dict[str, Any]:
    return {
        "shape": list(a.shape),
        "dtype": a.dtype,
        "nbytes": math.prod(a.shape) * numpy_dtype(a.dtype).itemsize,
        "spec": a.spec.to_json(),
        "spec_repr": repr(a.spec),
        "mesh": dict((a.mesh or default_mesh).axes),
        "shard_shape": list(a.shard_shape),
        "inner_chunk_shape": list(a.inner_chunk_shape),
        "kind": a.kind,
        "compression": a.compression,
    }


def checkpoint_doc(rd: Reader) -> dict[str, Any]:
    meta = rd.meta
    arrays = {name: array_doc(a, meta.mesh) for name, a in meta.arrays.items()}
    return {
        "path": rd.path,
        "step": meta.step,
        "format_version": meta.format_version,
        "library_version": meta.library_version,
        "mesh": dict(meta.mesh.axes),
        "rules": [[pattern, spec.to_json()] for pattern, spec in meta.rules],
        "nbytes": sum(a["nbytes"] for a in arrays.values()),
        "arrays": arrays,
        "aliases": dict(rd.aliases),
        "values": {name: rd.read(name) for name in rd.value_keys()},
        "user_metadata": dict(meta.user_metadata),
        "rank_state_world": meta.rank_state_world,
        "all_chunks_stored": meta.all_chunks_stored,
    }


def tree_rows(meta: CheckpointMeta, flat: bool) -> list[list[str]]:
    """One row per node of the saved tree (or per leaf, with ``flat``): label and details."""
    rows: list[list[str]] = []

    def leaf(label: str, name: str, node: Any) -> None:
        stored = node.get("array")
        if stored is None:
            rows.append([label, "= " + json.dumps(json_safe(decode_value(node)))])
        elif stored != name:
            rows.append([label, f"-> {stored} (tied: stored once, under that name)"])
        else:
            d = array_doc(meta.arrays[stored], meta.mesh)
            spec = d["spec_repr"]
            if meta.arrays[stored].mesh is not None:
                spec += f" on Mesh({d['mesh']!r})"
            extra = [d["compression"]] if d["compression"] else []
            rows.append([label, str(tuple(d["shape"])), d["dtype"], human(d["nbytes"]), spec, *extra])

    def walk(node: Any, name: str, depth: int, key: str) -> None:
        children = node.get("dict") or [[i, c] for i, c in enumerate(node.get("list", node.get("tuple", [])))]
        is_container = any(k in node for k in ("dict", "list", "tuple"))
        label = name if flat else "  " * depth + key
        if not is_container:
            leaf(label, name, node)
            return
        if not flat and depth >= 0:
            rows.append([label + ("" if children else "  (empty)")])
        for k, child in children:
            walk(child, f"{name}.{k}" if name else str(k), depth + 1, str(k))

    walk(meta.tree, "", -1, "")
    return rows


def ls_checkpoint(rd: Reader, args: argparse.Namespace) -> int:
    if args.json:
        print_json(checkpoint_doc(rd))
        return 0
    meta = rd.meta
    doc = checkpoint_doc(rd)
    step = "no step" if meta.step is None else f"step {meta.step}"
    version = f"format v{meta.format_version}" + (
        f", layoutckpt {meta.library_version}" if meta.library_version else ""
    )
    print(f"{rd.path}: {step}, {plural(len(meta.arrays), 'array')} ({human(doc['nbytes'])}), {version}")
    print(f"saved on {meta.mesh!r}" + (" by the rules:" if meta.rules else ""))
    for line in table([[f"  {pattern!r}", "->", repr(spec)] for pattern, spec in meta.rules] or [[""]]):
        if line:
            print(line)
    print()
    rows = tree_rows(meta, args.flat)
    for line in table(rows) if rows else []:
        print(line)
    if meta.user_metadata:
        print(f"\nmetadata: {json.dumps(json_safe(dict(meta.user_metadata)))}")
    if meta.rank_state_world is not None:
        print(f"per-rank state: {plural(meta.rank_state_world, 'document')}, one per saving rank")
    return 0


def disk_bytes(path: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except FileNotFoundError:  # deleted while we walk (retention running)
                pass
    return total


def root_doc(root: str) -> dict[str, Any] | None:
    """A CheckpointManager root's steps (committed or not) and crash leftovers; None if not one.

    On an object store only committed steps exist (their markers), with no sizes listed.
    """
    from .._manager import _STEP, _committed_steps, leftovers, step_dir
    from ..storage._location import locate

    if not is_local(root):
        found = _committed_steps(locate(root))
        steps = [{"step": s, "name": step_dir(s), "committed": True, "nbytes": None} for s in found]
        return {"root": root, "latest": found[-1], "steps": steps, "leftovers": []} if found else None
    root = root.removeprefix("file://")
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return None
    steps = []
    for e in entries:
        m = _STEP.match(e.name)
        if m and e.is_dir():
            committed = _store.is_committed(e.path)
            steps.append(
                {"step": int(m.group(1)), "name": e.name, "committed": committed, "nbytes": disk_bytes(e.path)}
            )
    junk = leftovers(root)
    if not steps and not junk:
        return None
    steps.sort(key=lambda s: s["step"])
    committed = [s["step"] for s in steps if s["committed"]]
    return {
        "root": root,
        "latest": committed[-1] if committed else None,
        "steps": steps,
        "leftovers": [{"name": name, "action": action} for name, action in junk],
    }


def cmd_ls(args: argparse.Namespace) -> int:
    try:
        rd = Reader(args.path)
    except CheckpointNotFoundError as err:
        doc = root_doc(args.path)
        if doc is None:
            raise NotFound(
                f"{err.strerror}, nor a CheckpointManager root with step_* folders; check the path"
            ) from None
        return ls_root(doc, args)
    with rd:
        return ls_checkpoint(rd, args)


def ls_root(doc: dict[str, Any], args: argparse.Namespace) -> int:
    if args.json:
        print_json(doc)
        return 0
    committed = sum(s["committed"] for s in doc["steps"])
    latest = "" if doc["latest"] is None else f", latest {doc['latest']}"
    print(f"{doc['root']}: CheckpointManager root, {committed} committed steps{latest}")
    rows = [["step", "state", "size", "folder"]]
    for s in doc["steps"]:
        state = "committed" if s["committed"] else "uncommitted (unfinished or crashed save)"
        rows.append([str(s["step"]), state, "?" if s["nbytes"] is None else human(s["nbytes"]), s["name"]])
    for line in table(rows, right=(0, 2)):
        print("  " + line)
    for item in doc["leftovers"]:
        if item["name"] in {s["name"] for s in doc["steps"]}:
            continue  # listed above, as uncommitted
        action = "restored" if item["action"] == "restore" else "removed"
        print(f"  leftover {item['name']}: {action} by `layoutckpt gc` or when a manager next starts here")
    return 0


def is_local(path: str) -> bool:
    scheme, sep, _ = path.partition("://")
    return not sep or scheme == "file"


# --- read ---------------------------------------------------------------------------------------


def parse_index(text: str | None, shape: tuple[int, ...], name: str) -> tuple[Box, tuple[Any, ...]]:
    """``"0:8, :"`` (NumPy basic indexing: ints, slices with steps, ``...``) as the box to read
    and the index that takes the selection from that box. Out-of-range slices clip as in NumPy."""
    where = f"--slice {text!r} for {name!r} of shape {shape}"
    parts = [p.strip() for p in text.split(",")] if text and text.strip() else []
    if parts.count("...") > 1:
        raise UsageError(f"{where}: '...' may appear once")
    if "..." in parts:
        at = parts.index("...")
        parts[at : at + 1] = [":"] * (len(shape) - len(parts) + 1)
    if len(parts) > len(shape):
        raise UsageError(f"{where}: {len(parts)} entries for {len(shape)} dimensions; give one per dimension")
    parts += [":"] * (len(shape) - len(parts))
    box, post = [], []
    for d, (part, n) in enumerate(zip(parts, shape)):
        fields = part.split(":")
        try:
            if len(fields) == 1:
                i = int(fields[0])
                if not -n <= i < n:
                    raise UsageError(f"{where}: index {i} is out of range for dimension {d} of size {n}")
                box.append((i % n, i % n + 1))
                post.append(0)
                continue
            if len(fields) > 3:
                raise ValueError
            start, stop, step = (int(f) if f.strip() else None for f in fields + [""] * (3 - len(fields)))
        except ValueError:
            raise UsageError(
                f"{where}: {part!r} is not an integer or a start:stop:step slice; write e.g. --slice '0:8,:'"
            ) from None
        if step == 0:
            raise UsageError(f"{where}: the step of {part!r} is zero")
        picked = range(*slice(start, stop, step).indices(n))
        if not picked:
            box.append((0, 0))
            post.append(slice(None))
            continue
        lo, hi = min(picked), max(picked) + 1
        box.append((lo, hi))
        # The box covers the selection; the step (or a reversal) is taken from it in memory.
        post.append(slice(picked.start - lo, None, picked.step) if picked.step < 0 else slice(None, None, picked.step))
    return tuple(box), tuple(post)


def read_box(rd: Reader, name: str, box: Box, bar: Any) -> np.ndarray:
    """The elements of ``box`` of array ``name``, read in pieces of whole inner-chunk rows."""
    a = rd.meta.arrays[rd.aliases.get(name, name)]
    info = rd.info(name)
    out = np.empty(box_shape(box), dtype=info.dtype)
    if out.size == 0:
        return out
    pending: collections.deque[tuple[Box, Any]] = collections.deque()

    def settle() -> None:
        piece, future = pending.popleft()
        data = _store.read_result(future, name, rd.path)
        out[tuple(slice(lo - b0, hi - b0) for (lo, hi), (b0, _) in zip(piece, box))] = data
        bar.update(data.nbytes)

    for piece in _readplan.read_pieces(a, box):
        if len(pending) == READS_IN_FLIGHT:
            settle()
        pending.append((piece, rd.read_async(name, tuple(slice(lo, hi) for lo, hi in piece) if piece else None)))
    while pending:
        settle()
    return out


def npy_ready(data: np.ndarray, name: str) -> np.ndarray:
    """``data`` as ``np.save`` can store it: types without a ``.npy`` code (bfloat16, float8,
    from ml_dtypes) would be written as raw void bytes, so their bits go as unsigned ints."""
    if data.dtype.kind != "V":
        return data
    bits = np.dtype(f"<u{data.dtype.itemsize}")
    print(
        f"{PROG} read: note: {data.dtype} has no .npy type; saved the bits of {name!r} as {bits} "
        f"(np.load(f).view(ml_dtypes.{data.dtype})), or pass --astype float32",
        file=sys.stderr,
    )
    return data.view(bits)


def cmd_read(args: argparse.Namespace) -> int:
    with open_checkpoint(args.path) as rd:
        array_or_value(rd, args.name)
        if args.name in rd.value_keys():
            if args.slice or args.out:
                raise UsageError(
                    f"{args.name!r} is a JSON value ({rd.read(args.name)!r}), not an array: it has no slices or .npy form"
                )
            print(json.dumps(json_safe(rd.read(args.name))))
            return 0
        info = rd.info(args.name)
        box, post = parse_index(args.slice, info.shape, args.name)
        if args.astype and args.astype not in ZARR_TO_NUMPY:
            raise UsageError(f"--astype {args.astype!r} is not a data type; use one of {sorted(ZARR_TO_NUMPY)}")
        with progress(args, info.dtype.itemsize * math.prod(box_shape(box)), args.name) as bar:
            data = read_box(rd, args.name, box, bar)[post]
        if args.astype:
            data = data.astype(ZARR_TO_NUMPY[args.astype])
        what = f"{args.name}" + (f"[{args.slice}]" if args.slice else "")
        header = f"{what}: {data.dtype} {data.shape}" + (f" of {info.shape}" if args.slice else "")
        if args.out:
            with open(args.out, "wb") as f:
                np.save(f, npy_ready(data, args.name), allow_pickle=False)
            print(f"wrote {args.out}: {header}, {human(data.nbytes)}")
            return 0
        print(header)
        with np.printoptions(threshold=sys.maxsize if args.full else 1000):
            print(repr(data))
    return 0


# --- verify -------------------------------------------------------------------------------------


def cmd_verify(args: argparse.Namespace) -> int:
    from .._verify import verify

    bar = None

    def advance(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:  # the total is known once the shards are listed
            bar = progress(args, total, "verify")
        bar.update(done - bar.n)

    try:
        with open_checkpoint(args.path) as rd:
            v = verify(rd, progress=advance)
    finally:
        if bar is not None:
            bar.close()
    if args.json:
        print_json(v.to_dict())
        return 0 if v.ok else 1
    for w in v.warnings:
        print(f"warning: {w.array or 'checkpoint'}" + (f" shard {w.shard}" if w.shard else "") + f": {w.text}")
    for p in v.problems:
        print(f"DAMAGED {p.array or 'checkpoint'}" + (f" shard {p.shard}" if p.shard else "") + f": {p.text}")
    checked = (
        f"{plural(v.arrays, 'array')}, {plural(v.shards, 'shard')}, {plural(v.chunks, 'inner chunk')}, "
        f"{human(v.nbytes)} checked"
    )
    if rd.meta.rank_state_world is not None:
        checked += f", {plural(v.rank_states, 'per-rank document')}"
    if not v.ok:
        damaged = f"{plural(len(v.damaged_arrays), 'damaged array')}, {plural(len(v.problems), 'problem')}"
        print(f"{v.path}: {damaged} ({checked})")
        return 1
    print(f"{v.path}: OK ({checked})")
    return 0


# --- plan ---------------------------------------------------------------------------------------


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


# --- export -------------------------------------------------------------------------------------


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 5GB, 500MiB or 1000000")
    return int(float(m.group(1)) * SIZE_UNITS[(m.group(2) or "").lower()])


def cmd_export(args: argparse.Namespace) -> int:
    from .._safetensors import export_safetensors

    # A missing checkpoint: one clear line before anything is made.
    with open_checkpoint(args.path) as rd:
        regex = name_regex(args.select) if args.select else None
        total = sum(rd.info(n).nbytes for n in rd.keys() if regex is None or regex.search(n))
    with progress(args, total, "export") as bar, watch_folder(args.out, args.prefix, bar):
        try:
            written = export_safetensors(
                args.path, args.out, select=args.select, max_shard_bytes=args.max_shard_bytes, prefix=args.prefix
            )
        except KeyError as err:
            raise NotFound(str(err.args[0])) from None
    for path in written:
        print(f"{path}  {human(os.path.getsize(path))}")
    return 0


@contextlib.contextmanager
def watch_folder(folder: str, prefix: str, bar: Any, every: float = 0.2) -> Iterator[None]:
    """Move ``bar`` to the bytes of the files named ``prefix``* that appear in ``folder``.

    ``export_safetensors`` takes no progress callback; the files it writes (under temporary
    names, then renamed) grow as it goes, so their sizes say how far it is.
    """
    if bar.disable:
        yield
        return

    def files() -> dict[tuple[str, int], int]:
        try:
            entries = list(os.scandir(folder))
        except FileNotFoundError:
            return {}
        found = {}
        for e in entries:
            if e.name.lstrip(".").startswith(prefix):
                with contextlib.suppress(FileNotFoundError):
                    stat = e.stat()
                    found[(e.name, stat.st_ino)] = stat.st_size
        return found

    before = set(files())
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(every):
            done = sum(size for key, size in files().items() if key not in before)
            bar.update(max(0, min(done, bar.total) - bar.n))

    thread = threading.Thread(target=watch, name="layoutckpt-export-progress", daemon=True)
    thread.start()
    try:
        yield
        bar.update(bar.total - bar.n)
    finally:
        stop.set()
        thread.join()


# --- gc -----------------------------------------------------------------------------------------


def cmd_gc(args: argparse.Namespace) -> int:
    from .._manager import collect_garbage, leftovers, step_dir, steps_after_cleanup

    root = args.root
    junk: list[tuple[str, str]] = []
    if is_local(root):
        root = root.removeprefix("file://")
        if not os.path.isdir(root):
            raise NotFound(f"no CheckpointManager root at {root!r}: not a directory")
        junk = leftovers(root)  # object stores have none: a step's save clears its own
    doomed = collect_garbage(root, keep_last=args.keep_last, keep_every=args.keep_every, dry_run=args.dry_run)
    kept = [s for s in steps_after_cleanup(root) if s not in doomed]
    if args.json:
        print_json(
            {
                "root": root,
                "dry_run": args.dry_run,
                "deleted": doomed,
                "kept": kept,
                "leftovers": [{"name": n, "action": a} for n, a in junk],
            }
        )
        return 0
    verb = "would delete" if args.dry_run else "deleted"
    for step in doomed:
        print(f"{verb} step {step} ({step_dir(step)})")
    for name, action in junk:
        done = {"restore": "restored", "remove": "removed"}[action] if not args.dry_run else f"would {action}"
        print(f"{done} leftover {name}")
    print(f"kept steps {kept}" if kept else "no committed steps")
    return 0


# --- the parser ---------------------------------------------------------------------------------


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Look into, check, read, plan for, export and prune layoutckpt checkpoints."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    bars = argparse.ArgumentParser(add_help=False)
    bars.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="show a progress bar on stderr (default: when stderr is a terminal)",
    )
    bars.add_argument("-q", "--quiet", dest="progress", action="store_false", help="no progress bar")

    def command(name: str, run: Callable[[argparse.Namespace], int], help: str, *parents: Any) -> Any:  # noqa: A002
        p = commands.add_parser(name, help=help, description=help, parents=list(parents))
        p.set_defaults(run=run)
        return p

    p = command("ls", cmd_ls, "arrays (shape, dtype, size, saved spec), values and metadata; or a run's steps")
    p.add_argument("path", help="a checkpoint, or a CheckpointManager root (step_* folders)")
    p.add_argument("--flat", action="store_true", help="one global name per line instead of a tree")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = command("read", cmd_read, "print one array (or a slice of it), or a value; or save it as .npy", bars)
    p.add_argument("path")
    p.add_argument("name", help="the array's or value's global name, e.g. model.embed.weight")
    p.add_argument("--slice", help="NumPy indexing per dimension, e.g. '0:8,:' or '...,-1'")
    p.add_argument("--out", help="save to this .npy file instead of printing")
    p.add_argument("--astype", help="cast to this dtype first, e.g. float32")
    p.add_argument("--full", action="store_true", help="print every element, not a summary")

    p = command("verify", cmd_verify, "check every checksum and that every shard is present; exit 1 if not", bars)
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = command("plan", cmd_plan, "which chunks and bytes each rank of a target layout would read (reads no data)")
    p.add_argument("path")
    p.add_argument("--spec", help="a TOML layout (see specs/); default: every array whole on every rank")
    p.add_argument("--mesh", help="the target mesh, e.g. dp=2,tp=4 (default: the spec file's [mesh])")
    p.add_argument("--rank", type=int, help="show this rank's reads array by array")
    p.add_argument("--select", help="only the names this regex finds")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = command("export", cmd_export, "write the arrays as Hugging Face safetensors files", bars)
    p.add_argument("path")
    p.add_argument("--to", choices=["safetensors"], required=True, help="the output format")
    p.add_argument("out", help="the folder to write (best empty)")
    p.add_argument("--select", help="only the arrays this regex finds")
    p.add_argument("--max-shard-bytes", type=parse_size, default=5 * 2**30, help="per file, e.g. 5GB (default 5 GiB)")
    p.add_argument("--prefix", default="model", help="file name stem (default: model)")

    p = command("gc", cmd_gc, "apply retention to a CheckpointManager root: leftovers and old steps go")
    p.add_argument("root")
    p.add_argument("--keep-last", type=positive_int, required=True, help="keep the N newest committed steps")
    p.add_argument("--keep-every", type=positive_int, help="also keep every step divisible by K")
    p.add_argument("--dry-run", action="store_true", help="only say what would go")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


USAGE_ERRORS = (UsageError, LayoutError, argparse.ArgumentTypeError)
NOT_FOUND_OR_DAMAGED = (NotFound, CheckpointNotFoundError, FormatError, IntegrityError, ManagerLockedError, OSError)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; the exit status (0 ok, 1 missing or damaged, 2 bad usage)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, --version (0) or a usage error (2), already printed
        return exit_.code if isinstance(exit_.code, int) else 0 if exit_.code is None else 2
    try:
        return int(args.run(args))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader of our output went away (`| head`): stop quietly, as a pipe expects.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except Exception as err:
        if os.environ.get("LAYOUTCKPT_DEBUG"):
            raise
        code = 2 if isinstance(err, USAGE_ERRORS) else 1
        known = isinstance(err, USAGE_ERRORS + NOT_FOUND_OR_DAMAGED + (ValueError, TypeError))
        message = str(err) if known else f"unexpected {type(err).__name__}: {err}"
        if isinstance(err, OSError) and err.strerror and not isinstance(err, CheckpointNotFoundError):
            message = f"{err.strerror}: {err.filename!r}" if err.filename else err.strerror
        hint = "" if known else " (LAYOUTCKPT_DEBUG=1 shows the traceback)"
        print(f"{PROG} {args.command}: error: {' '.join(message.split())}{hint}", file=sys.stderr)
        return code
