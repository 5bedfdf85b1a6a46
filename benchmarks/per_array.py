"""What each array of a state costs a save and a load beyond its bytes, against PyTorch DCP.

A state of many small arrays (``--arrays`` of ``--shape`` float32, 4 KiB each by default) makes
the bytes negligible, so what is left is the work per array: flattening and checking the tree,
planning, the documents and index entries, staging, and the reads' bookkeeping. Training
states hold hundreds to thousands of arrays per rank (every layer's weights, norms and biases,
each with its optimizer moments); a job that checkpoints every step pays this every step.

One process, no process group, the checkpoint in ``--dir``'s page cache; the systems'
operations alternate round by round (every other round in reverse), each the median of
``--repeats`` rounds with its spread, in microseconds per array:

- ``save``: ``lc.save`` (packed: a local save of this many arrays packs) and ``dcp.save``;
- ``save_async blocked``: until ``lc.save_async`` / ``dcp.async_save`` return (the copy and
  the checks before it; the writes follow in the background and are waited for untimed);
- ``tier save blocked``: ``CheckpointManager.save`` to a memory fast tier (no durable persist
  in the timed rounds), what a job saving every step waits for;
- ``load in place``: ``lc.load(..., like=state, inplace=True)`` and ``dcp.load`` into the same
  tensors, made once.

    .venv/bin/python benchmarks/per_array.py [--arrays 4000] [--shape 32,32] [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arrays", type=int, default=4000)
    ap.add_argument("--shape", default="32,32", help="each array's shape (float32)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")  # DCP warns that it runs without a process group

    import torch

    torch.set_num_threads(1)
    shape = tuple(int(s) for s in args.shape.split(","))
    state = {f"model.layers.{i // 8}.w{i % 8}": torch.randn(shape) for i in range(args.arrays)}
    work = tempfile.mkdtemp(dir=args.dir, prefix="lc-per-array-")
    try:
        rows = measure(state, work, args.repeats)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{args.arrays} arrays of {shape} float32, {args.repeats} rounds: us per array, median (min-max)")
    print(f"{'operation':20s} {'layoutckpt':>22s} {'DCP':>22s} {'DCP / layoutckpt':>17s}")
    for op, by_system in rows.items():
        cells = {s: [t / args.arrays * 1e6 for t in v] for s, v in by_system.items()}
        lc_us, dcp_us = (statistics.median(cells[s]) if s in cells else None for s in ("lc", "dcp"))
        ratio = f"{dcp_us / lc_us:17.2f}" if lc_us and dcp_us else f"{'-':>17s}"
        print(f"{op:20s} {_cell(cells.get('lc')):>22s} {_cell(cells.get('dcp')):>22s} {ratio}")


def _cell(values: list[float] | None) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})"


def measure(state: dict[str, Any], work: str, repeats: int) -> dict[str, dict[str, list[float]]]:
    """Every operation's seconds per round, by system; the rounds alternate the systems."""
    import torch
    import torch.distributed.checkpoint as dcp

    import layoutckpt as lc

    layout = lc.Layout(lc.Mesh({"dp": 1}), [(r".*", lc.P())])
    like = {k: torch.zeros_like(v) for k, v in state.items()}
    manager = lc.CheckpointManager(os.path.join(work, "durable"), local="memory://per-array", persist_every=10**9)
    paths = {s: os.path.join(work, s) for s in ("lc", "dcp")}
    steps = iter(range(1, 10**9))

    def fresh(path: str) -> str:
        shutil.rmtree(path, ignore_errors=True)
        return path

    def async_lc() -> Callable[[], Any]:
        fut = lc.save_async(fresh(paths["lc"]), state, layout)
        return fut.result

    def async_dcp() -> Callable[[], Any]:
        fut = dcp.async_save(state, checkpoint_id=fresh(paths["dcp"]))
        return fut.result

    def tier() -> Callable[[], Any]:
        return manager.save(next(steps), state, layout).result

    ops: dict[str, dict[str, Callable[[], Any]]] = {
        "save": {
            "lc": lambda: lc.save(fresh(paths["lc"]), state, layout),
            "dcp": lambda: dcp.save(state, checkpoint_id=fresh(paths["dcp"])),
        },
        "save_async blocked": {"lc": async_lc, "dcp": async_dcp},
        "tier save blocked": {"lc": tier},
        "load in place": {
            "lc": lambda: lc.load(paths["lc"], layout, like=like, inplace=True),
            "dcp": lambda: dcp.load(like, checkpoint_id=paths["dcp"]),
        },
    }
    rows: dict[str, dict[str, list[float]]] = {op: {} for op in ops}
    try:
        for rnd in range(repeats + 1):  # the first round warms up and is not counted
            for op, systems in ops.items():
                for system in systems if rnd % 2 == 0 else reversed(systems):
                    start = time.perf_counter()
                    done = systems[system]()
                    seconds = time.perf_counter() - start
                    if callable(done):
                        done()  # a background save ends before the next operation
                    if rnd:
                        rows[op].setdefault(system, []).append(seconds)
    finally:
        manager.close()
    return rows


if __name__ == "__main__":
    main()
