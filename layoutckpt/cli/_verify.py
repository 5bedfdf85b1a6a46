"""``layoutckpt verify``: every checksum and every shard, by ``layoutckpt._verify.verify``; exit 1
if anything is damaged or missing."""

from __future__ import annotations

import argparse

from ._common import open_checkpoint
from ._text import human, plural, print_json, progress


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
