"""Packed (``packing="ocdbt"``) against plain (``packing="files"``) checkpoints: files, saves, loads.

    .venv/bin/python benchmarks/packing.py [--ranks 4] [--mb 256] [--repeats 5] [--json OUT]
    .venv/bin/python benchmarks/packing.py --quick          # smoke run: 2 repeats, smaller states

Two states, each saved and loaded with both packings in turn, every repeat (the order flips from
one repeat to the next), so the disk's drift falls on both alike:

- ``many``: ``--arrays`` (400) float32 matrices of ``--mb`` MiB in all, FSDP-style: each split by
  rows over ``Mesh({"dp": R})`` with ``P("dp")`` on ``--ranks`` R local gloo ranks, so a plain
  checkpoint holds a shard file per array per rank. Timed: the save; warm loads under the same
  layout, in place into existing tensors (``like=..., inplace=True``) and into fresh ones; a
  warm resharded load on R/2 of the ranks under ``Mesh({"tp": R/2})`` with ``P(None, "tp")``
  (column blocks: every shard file of every array is read in part); and a cold in-place load.
  A rank times its part after a barrier; a repeat counts the slowest rank.
- ``tiny``: ``--tiny`` (10,000) tensors of ``--tiny-numel`` (16) float32 each, in groups of 10,
  saved and loaded by one process without ``torch.distributed``: the save, warm loads (in place,
  fresh) and a cold in-place load.

Cold loads run after the page cache is dropped (``/proc/sys/vm/drop_caches`` where it can be
written, else every file of the checkpoint is fsynced and evicted with
``posix_fadvise(DONTNEED)``, ``--evict``); the bytes the load read from storage (``/proc/self/io``
``read_bytes``, summed over ranks) are recorded to show it was cold. Warm loads follow the save,
whose buffered writes leave the files in the page cache.

Nothing is deleted while the run goes on (on ext4 without a journal, files created after a
deletion pay for the freed inodes: ``docs/performance.md``): each output is truncated once
measured (``_common.free_output``) and everything is deleted at the end.

The table shows, per state and packing, the files on disk, the objects stored (the keys of the
OCDBT database plus the plain objects beside it), and the median time of each column with its
min-max spread; then ocdbt over files for each column. ``--json`` writes every number, with each
rank's phases (plan/write/commit, plan/read/place) for every repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue as queue_mod
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import files_under, flatten, free_output, leave_world, nest, proc_io

PACKINGS = ("files", "ocdbt")
COLS = 256  # columns of every "many" matrix: divisible by any tp up to 256
MANY_COLUMNS = ("save", "load_inplace", "load_fresh", "load_reshard", "load_cold")
TINY_COLUMNS = ("save", "load_inplace", "load_fresh", "load_cold")
HEADERS = {
    "save": "save s",
    "load_inplace": "warm load in place s",
    "load_fresh": "warm load fresh s",
    "load_reshard": "warm reshard load s",
    "load_cold": "cold load in place s",
}


# ---------------------------------------------------------------------------------------------
# Helpers shared by both states.


def _order(rep: int) -> tuple[str, ...]:
    return PACKINGS if rep % 2 == 0 else PACKINGS[::-1]


def evict_mode(asked: str) -> str:
    """``drop`` (the whole page cache) where ``/proc/sys/vm/drop_caches`` can be written, else
    ``fadvise`` (every file of the checkpoint)."""
    if asked != "auto":
        return asked
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
        return "drop"
    except OSError:
        return "fadvise"


def make_cold(path: str, mode: str) -> None:
    os.sync()
    if mode == "drop":
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
    else:
        for p in files_under(path):
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def count_stored(path: str) -> dict[str, int]:
    """Files and bytes on disk, and the objects stored: every file of a plain checkpoint; the
    keys of a packed one's database plus the plain objects beside it."""
    files = files_under(path)
    out = {"files": len(files), "disk_bytes": sum(os.path.getsize(p) for p in files)}
    if not os.path.exists(os.path.join(path, "manifest.ocdbt")):
        out["objects"] = len(files)
        return out
    import tensorstore as ts

    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{os.path.abspath(path)}/"}).result()
    keys = len(kv.list().result())
    plain = 0
    for p in files:
        rel = os.path.relpath(p, path)
        if rel == "manifest.ocdbt" or rel.startswith(("d/", "packs/")):
            continue  # the database's own files
        plain += 1
    out["objects"] = keys + plain
    out["db_keys"] = keys
    return out


def _phases(metrics: Any) -> dict[str, float]:
    return dict(metrics.phases) if metrics is not None else {}


def _call(lc: Any, op: str, *a: Any, **kw: Any) -> tuple[Any, dict[str, float]]:
    """``lc.save`` or ``lc.load`` (through ``load_async``, for its metrics); the result and this
    rank's phases."""
    if op == "save":
        res = lc.save(*a, **kw)
        return res, _phases(res.metrics)
    fut = lc.load_async(*a, **kw)
    got = fut.result()
    return got, _phases(fut.metrics)


def timer(lc: Any, dist: Any = None) -> Any:
    """``timed(row, column, op, *args, here=True, **kw)``: runs ``_call`` (after a barrier, where
    ``here``) and records in ``row`` the slowest rank's seconds, the CPU seconds (user and
    system, every thread) summed over ranks, and this rank's phases; returns the result."""

    def timed(row: dict[str, Any], col: str, op: str, *a: Any, here: bool = True, **kw: Any) -> Any:
        if dist is not None:
            dist.barrier()
        c0, t0 = os.times(), time.perf_counter()
        got, phases = _call(lc, op, *a, **kw) if here else (None, {})
        wall, c1 = time.perf_counter() - t0, os.times()
        cpu = c1.user - c0.user + c1.system - c0.system
        if dist is not None:
            import torch

            t, c = torch.tensor([wall if here else 0.0], dtype=torch.float64), torch.tensor([cpu], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            dist.all_reduce(c)
            wall, cpu = float(t.item()), float(c.item())
        row[col], row[f"{col}_cpu"], row[f"{col}_phases"] = wall, cpu, phases
        return got

    return timed


# ---------------------------------------------------------------------------------------------
# "many": R gloo ranks, FSDP-style.


def many_shape(args: argparse.Namespace) -> tuple[int, int]:
    """Rows and columns of every "many" matrix: ``--mb`` MiB over ``--arrays`` float32 arrays,
    rows a multiple of the ranks."""
    per_array = args.mb * 2**20 / args.arrays / 4
    rows = max(args.ranks, round(per_array / COLS / args.ranks) * args.ranks)
    return rows, COLS


def _global(i: int, rows: int, cols: int) -> Any:
    import torch

    return torch.empty(rows, cols).uniform_(-1, 1, generator=torch.Generator().manual_seed(i))


def _many_rank(rank: int, world: int, args: argparse.Namespace, root: str, evict: str, out: Any) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    import torch.distributed as dist

    import layoutckpt as lc

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root}/init", rank=rank, world_size=world)
    half = world // 2
    sub = dist.new_group(ranks=list(range(half))) if half else None
    rows, cols = many_shape(args)
    block = rows // world
    names = [f"layers.{i // 4:03d}.w{i % 4}" for i in range(args.arrays)]
    flat = {n: _global(i, rows, cols)[rank * block : (rank + 1) * block].clone() for i, n in enumerate(names)}
    state = nest(flat)
    dest = nest({n: torch.zeros_like(t) for n, t in flat.items()})
    layout = lc.Layout(lc.Mesh({"dp": world}), [(r".*", lc.P("dp"))])
    tp = lc.Layout(lc.Mesh({"tp": max(1, half)}), [(r".*", lc.P(None, "tp"))])

    timed = timer(lc, dist)

    # Untimed warm-up: imports, TensorStore's context, the threads, for both packings.
    small = nest({n: flat[n] for n in names[:8]})
    for packing in PACKINGS:
        p = f"{root}/many-warmup-{packing}"
        lc.save(p, small, layout, packing=packing)
        lc.load(p, layout)

    results: dict[str, list[dict[str, Any]]] = {p: [] for p in PACKINGS}
    for rep in range(args.repeats):
        for packing in _order(rep):
            path = f"{root}/many-{rep}-{packing}"
            row: dict[str, Any] = {"rep": rep}
            if rank == 0:
                os.sync()  # the last output's writeback is not this save's
            timed(row, "save", "save", path, state, layout, packing=packing)
            if rank == 0:
                row["stored"] = count_stored(path)
            got = timed(row, "load_inplace", "load", path, layout, like=dest, inplace=True)
            fresh = timed(row, "load_fresh", "load", path, layout)
            if rep == 0:  # untimed: the loads return what was saved
                got_flat, fresh_flat = flatten(got), flatten(fresh)
                for n, t in flat.items():
                    assert torch.equal(got_flat[n], t) and torch.equal(fresh_flat[n], t), (packing, n)
            del got, fresh
            if half:
                resh = timed(row, "load_reshard", "load", path, tp, group=sub, here=rank < half)
                if rep == 0 and rank < half:
                    c = cols // half
                    resh_flat = flatten(resh)
                    for i, n in enumerate(names):
                        want = _global(i, rows, cols)[:, rank * c : (rank + 1) * c]
                        assert torch.equal(resh_flat[n], want), (packing, n, "reshard")
                del resh
            if rank == 0:
                make_cold(path, evict)
            io0 = proc_io()["read_bytes"]
            timed(row, "load_cold", "load", path, layout, like=dest, inplace=True)
            read = torch.tensor([proc_io()["read_bytes"] - io0], dtype=torch.float64)
            dist.all_reduce(read)
            row["cold_read_bytes"] = int(read.item())
            dist.barrier()
            if rank == 0:
                free_output(path, delete=False)  # truncated, not deleted (the inodes stay)
            dist.barrier()
            results[packing].append(row)
    out.put((rank, results))
    out.close()
    out.join_thread()
    dist.barrier()
    leave_world()


# ---------------------------------------------------------------------------------------------
# "tiny": one process, no torch.distributed.


def _tiny_process(args: argparse.Namespace, root: str, evict: str, out: Any) -> None:
    import torch

    import layoutckpt as lc

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    flat = {f"g{i // 10:04d}.t{i % 10}": torch.randn(args.tiny_numel, generator=gen) for i in range(args.tiny)}
    state = nest(flat)
    dest = nest({n: torch.zeros_like(t) for n, t in flat.items()})
    for packing in PACKINGS:  # untimed warm-up
        p = f"{root}/tiny-warmup-{packing}"
        lc.save(p, nest(dict(list(flat.items())[:20])), packing=packing)
        lc.load(p)

    timed = timer(lc)

    results: dict[str, list[dict[str, Any]]] = {p: [] for p in PACKINGS}
    for rep in range(args.repeats):
        for packing in _order(rep):
            path = f"{root}/tiny-{rep}-{packing}"
            row: dict[str, Any] = {"rep": rep}
            os.sync()
            timed(row, "save", "save", path, state, packing=packing)
            row["stored"] = count_stored(path)
            got = timed(row, "load_inplace", "load", path, None, like=dest, inplace=True)
            fresh = timed(row, "load_fresh", "load", path, None)
            if rep == 0:
                got_flat, fresh_flat = flatten(got), flatten(fresh)
                for n, t in flat.items():
                    assert torch.equal(got_flat[n], t) and torch.equal(fresh_flat[n], t), (packing, n)
            del got, fresh
            make_cold(path, evict)
            io0 = proc_io()["read_bytes"]
            timed(row, "load_cold", "load", path, None, like=dest, inplace=True)
            row["cold_read_bytes"] = proc_io()["read_bytes"] - io0
            free_output(path, delete=False)
            results[packing].append(row)
    out.put((0, results))
    out.close()
    out.join_thread()


# ---------------------------------------------------------------------------------------------
# Running and reporting.


def _run(target: Any, per_process: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    """Spawn one process per argument tuple (each gets the result queue last); their results,
    by the rank each sends."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*a, out)) for a in per_process]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    while len(got) < len(procs):
        try:
            rank, result = out.get(timeout=5)
            got[rank] = result
        except queue_mod.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                raise SystemExit("a process failed; see its traceback above") from None
    for p in procs:
        p.join()
    return [got[r] for r in range(len(procs))]


def summarize(rows: dict[str, list[dict[str, Any]]], columns: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for packing, reps in rows.items():
        s: dict[str, Any] = {"stored": reps[0]["stored"]}
        for c in (*columns, *(f"{c}_cpu" for c in columns)):
            vals = [r[c] for r in reps if c in r]
            if vals:
                s[c] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "values": vals}
        cold = [r["cold_read_bytes"] for r in reps]
        s["cold_read_mb"] = statistics.median(cold) / 2**20
        out[packing] = s
    return out


def _cell(s: dict[str, Any]) -> str:
    return f"{s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f})"


def table(name: str, summary: dict[str, Any], columns: tuple[str, ...]) -> str:
    cols = [c for c in columns if c in summary[PACKINGS[0]]]
    head = ["state", "packing", "files", "objects", *(HEADERS[c] for c in cols), "cold MiB read"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for packing in PACKINGS:
        s = summary[packing]
        cells = [name, packing, f"{s['stored']['files']:,}", f"{s['stored']['objects']:,}"]
        cells += [_cell(s[c]) for c in cols] + [f"{s['cold_read_mb']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    f, o = summary["files"], summary["ocdbt"]
    ratio = [name, "ocdbt / files", f"{o['stored']['files'] / f['stored']['files']:.4f}"]
    ratio += [f"{o['stored']['objects'] / f['stored']['objects']:.2f}"]
    ratio += [f"{o[c]['median'] / f[c]['median']:.2f}x" for c in cols] + [""]
    lines.append("| " + " | ".join(ratio) + " |")
    # CPU seconds (user + system, all threads) summed over ranks: on a machine with fewer cores
    # than ranks' threads, wall time follows them.
    lines += ["", "| CPU s, all ranks | " + " | ".join(HEADERS[c] for c in cols) + " |", "|" + "---|" * (len(cols) + 1)]
    for packing in PACKINGS:
        lines.append(
            f"| {packing} | " + " | ".join(f"{summary[packing][f'{c}_cpu']['median']:.3f}" for c in cols) + " |"
        )
    ratios = (f"{o[f'{c}_cpu']['median'] / f[f'{c}_cpu']['median']:.2f}x" for c in cols)
    lines.append("| ocdbt / files | " + " | ".join(ratios) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4, help="gloo ranks of the 'many' state (default 4)")
    ap.add_argument("--mb", type=float, default=256, help="MiB of the 'many' state in all (default 256)")
    ap.add_argument("--arrays", type=int, default=400, help="arrays of the 'many' state (default 400)")
    ap.add_argument("--tiny", type=int, default=10_000, help="tensors of the 'tiny' state (default 10,000)")
    ap.add_argument("--tiny-numel", type=int, default=16, help="float32 elements per tiny tensor (default 16)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--only", default="many,tiny", help="states to run: many, tiny or both (default)")
    ap.add_argument("--evict", choices=("auto", "drop", "fadvise"), default="auto")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--json", help="write every number to this file")
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 repeats, 32 MiB, 100 arrays, 2,000 tiny")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.mb, args.arrays, args.tiny = 2, 32, 100, 2000
    states = args.only.split(",")
    evict = evict_mode(args.evict)
    root = tempfile.mkdtemp(prefix="lc-packing-", dir=args.dir)
    t_start = time.perf_counter()
    report: dict[str, Any] = {"args": vars(args), "evict": evict, "host": platform.node(), "cpus": os.cpu_count()}
    report["loadavg_before"] = os.getloadavg()
    out_tables = []
    try:
        if "many" in states:
            rows, cols = many_shape(args)
            per_rank = _run(_many_rank, [(r, args.ranks, args, root, evict) for r in range(args.ranks)])
            merged = {p: [dict(r) for r in per_rank[0][p]] for p in PACKINGS}
            for p in PACKINGS:  # the times are already maxima over ranks; keep each rank's phases
                for k, row in enumerate(merged[p]):
                    row["phases_by_rank"] = {
                        rank: {key: v for key, v in pr[p][k].items() if key.endswith("_phases")}
                        for rank, pr in enumerate(per_rank)
                    }
            summary = summarize(merged, MANY_COLUMNS)
            report["many"] = {
                "shape": [rows, cols],
                "bytes": args.arrays * rows * cols * 4,
                "summary": summary,
                "rows": merged,
            }
            title = (
                f"many: {args.arrays} float32 [{rows}, {cols}] arrays, {args.arrays * rows * cols * 4 / 2**20:.0f} MiB,"
                f" P('dp') over {args.ranks} gloo ranks; reshard: P(None, 'tp') on {args.ranks // 2} ranks"
            )
            out_tables.append((title, table("many", summary, MANY_COLUMNS)))
        if "tiny" in states:
            (tiny_rows,) = _run(_tiny_process, [(args, root, evict)])
            summary = summarize(tiny_rows, TINY_COLUMNS)
            report["tiny"] = {"summary": summary, "rows": tiny_rows}
            title = f"tiny: {args.tiny:,} float32 [{args.tiny_numel}] tensors in groups of 10, one process"
            out_tables.append((title, table("tiny", summary, TINY_COLUMNS)))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report["seconds"] = time.perf_counter() - t_start
    report["loadavg_after"] = os.getloadavg()
    print(
        f"\n{args.repeats} repeats, packings alternated; median (min-max) of the slowest rank's seconds; "
        f"cold = page cache dropped ({evict}); {os.cpu_count()} CPUs, load average {report['loadavg_before'][0]:.1f} "
        f"before, {report['loadavg_after'][0]:.1f} after; run took {report['seconds']:.0f} s"
    )
    for title, text in out_tables:
        print(f"\n{title}\n\n{text}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
