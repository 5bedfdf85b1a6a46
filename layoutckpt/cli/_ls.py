"""``layoutckpt ls``: a checkpoint's arrays, specs, values and metadata as a tree or flat list,
or, given a CheckpointManager root, its steps (listed by ``_root``)."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from .._reader import Reader
from ..base._errors import CheckpointNotFoundError
from ..format._dtypes import numpy_dtype
from ..format._format import ArrayMeta, CheckpointMeta
from ..layout._spec import Mesh
from ..layout._tree import decode_value, leaf_nodes
from ._common import NotFound
from ._root import ls_root, root_doc
from ._text import human, json_safe, plural, print_json, table


def cmd_ls(args: argparse.Namespace) -> int:
    try:
        rd = Reader(args.path)
    except CheckpointNotFoundError as err:
        doc = root_doc(args.path)
        if doc is None:
            raise NotFound(f"{err}; nor is it a CheckpointManager root (no step_* folders)") from None
        return ls_root(doc, args)
    with rd:
        return ls_checkpoint(rd, args)


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


def tree_rows(meta: CheckpointMeta) -> list[list[str]]:
    """One row per node of the saved tree: label (indented by depth) and details."""
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
        label = "  " * depth + key
        if not is_container:
            leaf(label, name, node)
            return
        if depth >= 0:
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
    if args.flat:
        # Names alone, one a line, for grep, wc and shell loops.
        for name, _ in leaf_nodes(meta.tree):
            print(name)
        return 0
    doc = checkpoint_doc(rd)
    step = "no step" if meta.step is None else f"step {meta.step}"
    version = f"format v{meta.format_version}" + (f", packed ({meta.packing})" if meta.packed else "")
    version += f", layoutckpt {meta.library_version}" if meta.library_version else ""
    print(f"{rd.path}: {step}, {plural(len(meta.arrays), 'array')} ({human(doc['nbytes'])}), {version}")
    print(f"saved on {meta.mesh!r}" + (" by the rules:" if meta.rules else ""))
    # A rule's pattern as it was written (a repr would double every backslash).
    for line in table([[f"  {pattern}", "->", repr(spec)] for pattern, spec in meta.rules] or [[""]]):
        if line:
            print(line)
    print()
    rows = tree_rows(meta)
    for line in table(rows) if rows else []:
        print(line)
    if meta.user_metadata:
        print(f"\nmetadata: {json.dumps(json_safe(dict(meta.user_metadata)))}")
    if meta.rank_state_world is not None:
        print(f"per-rank state: {plural(meta.rank_state_world, 'document')}, one per saving rank")
    return 0
