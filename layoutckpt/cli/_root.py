"""A CheckpointManager root seen from outside: ``ls ROOT`` (its steps and crash leftovers) and
``gc`` (its retention). The manager's own functions do the work; this is the one module of the
command line that imports ``_manager``."""

from __future__ import annotations

import argparse
import os
from typing import Any

from ..storage._store import is_committed
from ._common import NotFound, UsageError
from ._text import human, plural, print_json, table


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
    from .._manager import committed_steps, leftovers, step_dir, step_folders

    if not is_local(root):
        found = committed_steps(root)
        steps = [{"step": s, "name": step_dir(s), "committed": True, "nbytes": None} for s in found]
        return {"root": root, "latest": found[-1], "steps": steps, "leftovers": []} if found else None
    root = root.removeprefix("file://")
    if not os.path.isdir(root):
        return None
    steps = [
        {"step": step, "name": name, "committed": committed, "nbytes": disk_bytes(os.path.join(root, name))}
        for step, name, committed in step_folders(root)
    ]
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


def ls_root(doc: dict[str, Any], args: argparse.Namespace) -> int:
    if args.json:
        print_json(doc)
        return 0
    committed = sum(s["committed"] for s in doc["steps"])
    latest = "" if doc["latest"] is None else f", latest {doc['latest']}"
    print(f"{doc['root']}: CheckpointManager root, {plural(committed, 'committed step')}{latest}")
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


def cmd_gc(args: argparse.Namespace) -> int:
    from .._retention import LOCK_FILE, collect_garbage, steps_after_cleanup
    from .._steps import leftovers, step_dir, step_folders

    root = args.root
    if is_committed(root):
        # Retention deletes step_* folders beside each other; inside one checkpoint it has none.
        parent = root.rstrip("/").rpartition("/")[0] or "."
        raise UsageError(
            f"{root!r} is a checkpoint, not a CheckpointManager root; gc takes the folder that holds "
            f"the step_* folders (perhaps {parent!r})"
        )
    junk: list[tuple[str, str]] = []
    if is_local(root):
        root = root.removeprefix("file://")
        if not os.path.isdir(root):
            raise NotFound(f"no CheckpointManager root at {root!r}: not a directory")
        if not step_folders(root) and not os.path.exists(os.path.join(root, LOCK_FILE)):
            # Not a folder a manager ever ran in: gc neither deletes nor locks anything there.
            raise NotFound(f"no CheckpointManager root at {root!r}: it holds no step_* folder and no {LOCK_FILE}")
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


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value
