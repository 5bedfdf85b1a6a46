"""Async-save benchmark: how long layoutckpt's ``save_async`` holds the training loop, and how long
it takes to commit, against a bare memcpy, PyTorch DCP and a raw ``write`` + ``fsync``.

    .venv/bin/python benchmarks/async_save.py [--gb 1.5] [--ranks 2] [--repeats 3] [--dir /tmp] [--json out.json]

N local gloo ranks (spawned processes, ``GLOO_SOCKET_IFNAME=lo``) hold a training-like state of
about ``--gb`` GB in total: a Llama-like model (vocab-parallel embedding and head, q/k/v/gate/up
split by rows ``P("tp", None)``, o/down split by columns ``P(None, "tp")`` over ``tp = N``, and
many small replicated norms) in bfloat16, plus two float32 optimizer moments shaped like it. Every
measurement runs on all ranks at once, started by a barrier; a rank's time is its own, the
reported time per repeat is the maximum over ranks, and each row shows the median over
``--repeats`` and the min-max spread. Outputs are deleted between repeats. See
``benchmarks/README.md`` for what each row means.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

from _common import GB, RULES, build_state, leave_world, meminfo, model_dims, spec_of, stats
from _common import dd as run_dd

TARGETS = {  # ratio name -> (numerator row, denominator row, metric, bound)
    "save_async blocked / memcpy": ("lc_warm", "memcpy_warm", "blocked", 1.5),
    "save_async blocked / DCP async_save blocked": ("lc_warm", "dcp_async", "blocked", 0.5),
    "save_async total commit / raw write+fsync": ("lc_warm", "raw_write", "total", 1.2),
}


# ---------------------------------------------------------------------------------------------
# One rank.


def _rank_main(rank: int, world: int, opts: dict[str, Any]) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import layoutckpt as lc
    from layoutckpt.torch import _staging

    torch.set_num_threads(opts["threads"])
    dist.init_process_group("gloo", init_method=f"file://{opts['init_file']}", rank=rank, world_size=world)
    # DCP runs its collectives on a background thread; give it a group of its own.
    dcp_group = dist.new_group(backend="gloo")
    work = opts["workdir"]
    repeats = opts["repeats"]

    mesh = lc.Mesh({"tp": world})
    layout = lc.Layout(mesh, [(pat, lc.P(*spec)) for pat, spec in RULES])
    t0 = time.perf_counter()
    state, flat, nbytes = build_state(opts["dims"], world, rank)
    build_s = time.perf_counter() - t0
    tensors = list(flat.values())
    # DCP state dict: each rank's local tensors as plain tensors. Sharded leaves get a
    # rank-specific key (DCP would otherwise keep one rank's shard and drop the others, as it
    # dedupes equal keys); replicated leaves keep their shared key, so DCP writes them once, as
    # layoutckpt does.
    dcp_state = {(f"{k}.tp{rank}" if spec_of(k) else k): t for k, t in flat.items()}

    def barrier() -> None:
        dist.barrier()

    def clean(path: str) -> None:
        barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
            if os.path.isfile(path):
                os.remove(path)
            # Flush the deletion (and the discards of a `discard`-mounted fs) now, outside any
            # timed region, so it does not land on the next measurement.
            os.sync()
        barrier()

    # --- the measurements; each returns this rank's numbers ---------------------------------
    dsts = [torch.empty_like(t) for t in tensors]
    for d, t in zip(dsts, tensors):
        d.copy_(t)  # touch the destination once: the timed copies reuse warm pages

    def memcpy_warm(rep: int) -> dict[str, float]:
        barrier()
        t0 = time.perf_counter()
        for d, t in zip(dsts, tensors):
            d.copy_(t)
        return {"blocked": time.perf_counter() - t0}

    def memcpy_cold(rep: int) -> dict[str, float]:
        barrier()
        t0 = time.perf_counter()
        out = [torch.empty_like(t).copy_(t) for t in tensors]
        dt = time.perf_counter() - t0
        del out
        return {"blocked": dt}

    def lc_save(rep: int, *, lazy: bool = False, cold: bool = False) -> dict[str, float]:
        path = os.path.join(work, f"lc_{'lazy' if lazy else 'cold' if cold else 'warm'}_{rep}")
        if cold:
            pool = _staging._POOLS.get(False)
            if pool is not None:
                pool.clear()  # an empty staging pool: the buffers are allocated and faulted in anew
        barrier()
        t0 = time.perf_counter()
        fut = lc.save_async(path, state, layout, step=rep, lazy=lazy)
        call = time.perf_counter() - t0
        fut.wait_staged()
        staged = time.perf_counter() - t0
        res = fut.result()
        total = time.perf_counter() - t0
        out = {
            "blocked": res.blocked_seconds,
            "call": call,
            "staged": staged,
            "total": total,
            "seconds": res.seconds,
            "bytes_written": res.bytes_written,
            "staged_bytes": res.staged_bytes,
        }
        clean(path)
        return out

    def dcp_async(rep: int) -> dict[str, float]:
        path = os.path.join(work, f"dcp_async_{rep}")
        barrier()
        t0 = time.perf_counter()
        fut = dcp.async_save(dcp_state, checkpoint_id=path, process_group=dcp_group)
        call = time.perf_counter() - t0
        fut.result()
        total = time.perf_counter() - t0
        clean(path)
        return {"blocked": call, "total": total}

    def dcp_sync(rep: int) -> dict[str, float]:
        path = os.path.join(work, f"dcp_sync_{rep}")
        barrier()
        t0 = time.perf_counter()
        dcp.save(dcp_state, checkpoint_id=path, process_group=dcp_group)
        total = time.perf_counter() - t0
        clean(path)
        return {"total": total}

    def raw_write(rep: int) -> dict[str, float]:
        d = os.path.join(work, f"raw_{rep}")
        if rank == 0:
            os.makedirs(d)
        barrier()
        t0 = time.perf_counter()
        with open(os.path.join(d, f"rank{rank}.bin"), "wb", buffering=0) as f:
            for t in tensors:
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
            os.fsync(f.fileno())
        total = time.perf_counter() - t0
        clean(d)
        return {"total": total}

    ops = {
        "memcpy_warm": memcpy_warm,
        "memcpy_cold": memcpy_cold,
        "lc_cold": lambda rep: lc_save(rep, cold=True),
        "lc_warm": lc_save,
        "lc_lazy": lambda rep: lc_save(rep, lazy=True),
        "dcp_async": dcp_async,
        "dcp_sync": dcp_sync,
        "raw_write": raw_write,
    }
    # Repeats are interleaved (every operation once, then again) so that drift in the disk or
    # the page cache hits every row alike. The first lc_cold is also the process's first save;
    # every lc_cold starts from an empty staging pool, and lc_warm follows a save of the same
    # state, so its buffers come from the pool.
    per_rank: dict[str, list[dict[str, float]]] = {k: [] for k in ops}
    meminfo_before = meminfo()
    load_before = os.getloadavg()
    for rep in range(repeats):
        for name, fn in ops.items():
            per_rank[name].append(fn(rep))
    barrier()

    dd = None
    if rank == 0 and shutil.which("dd"):
        total_bytes = nbytes["local"] * world  # about the bytes of all ranks' raw writes
        dd = run_dd(os.path.join(work, "dd.bin"), total_bytes)
    barrier()

    profile = None
    if opts["profile"]:
        profile = _profile_one_save(rank, work, state, layout, opts["profile"])
        barrier()

    gathered: list[Any] = [None] * world
    dist.all_gather_object(
        gathered,
        {"results": per_rank, "bytes": nbytes, "build_s": build_s, "np_version": np.__version__},
    )
    if rank == 0:
        out = {
            "per_rank": [g["results"] for g in gathered],
            "bytes": [g["bytes"] for g in gathered],
            "build_s": max(g["build_s"] for g in gathered),
            "dd": dd,
            "meminfo_before": meminfo_before,
            "meminfo_after": meminfo(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
            "profile": profile,
        }
        with open(os.path.join(work, "results.json"), "w") as f:
            json.dump(out, f)
    barrier()
    leave_world()


def _profile_one_save(rank: int, work: str, state: Any, layout: Any, prefix: str) -> dict[str, str] | None:
    """One more steady-state save with cProfile on rank 0: the caller's thread (blocked part)
    and the background writer thread (writes and commit), as two pstats files."""
    import cProfile

    import layoutckpt as lc
    from layoutckpt import _save

    path = os.path.join(work, "lc_profile")
    if rank != 0:
        lc.save_async(path, state, layout).result()
        return None
    inner = _save._write_and_commit
    writer_prof = cProfile.Profile()

    def profiled(*args: Any) -> None:
        writer_prof.enable()
        try:
            inner(*args)
        finally:
            writer_prof.disable()

    _save._write_and_commit = profiled
    try:
        caller_prof = cProfile.Profile()
        caller_prof.enable()
        fut = lc.save_async(path, state, layout)
        caller_prof.disable()
        fut.result()
    finally:
        _save._write_and_commit = inner
    os.makedirs(os.path.dirname(os.path.abspath(prefix)) or ".", exist_ok=True)
    files = {"blocked": f"{prefix}.blocked.pstats", "commit": f"{prefix}.commit.pstats"}
    caller_prof.dump_stats(files["blocked"])
    writer_prof.dump_stats(files["commit"])
    shutil.rmtree(path, ignore_errors=True)
    return files


# ---------------------------------------------------------------------------------------------
# Reduction and the table.


def _series(per_rank: list[dict[str, list[dict[str, float]]]], op: str, metric: str) -> list[float]:
    """Per repeat, the maximum over ranks."""
    repeats = len(per_rank[0][op])
    return [max(r[op][i][metric] for r in per_rank) for i in range(repeats)]


ROWS = [  # key, op, metric, bytes kind, label
    ("memcpy_warm", "memcpy_warm", "blocked", "local", "memcpy: dst.copy_(src) into preallocated tensors"),
    ("memcpy_cold", "memcpy_cold", "blocked", "local", "memcpy cold: torch.empty + copy_"),
    ("lc_warm.blocked", "lc_warm", "blocked", "staged", "lc save_async blocked, steady (blocked_seconds)"),
    ("lc_warm.call", "lc_warm", "call", "staged", "lc save_async call wall time, steady"),
    ("lc_cold.blocked", "lc_cold", "blocked", "staged", "lc save_async blocked, cold pool (blocked_seconds)"),
    ("lc_cold.call", "lc_cold", "call", "staged", "lc save_async call wall time, cold pool"),
    ("lc_lazy.blocked", "lc_lazy", "blocked", "staged", "lc save_async(lazy=True) blocked"),
    ("lc_lazy.staged", "lc_lazy", "staged", "staged", "lc save_async(lazy=True) call -> staged"),
    ("dcp_async.blocked", "dcp_async", "blocked", "local", "DCP async_save blocked (call returns)"),
    ("lc_warm.total", "lc_warm", "total", "written", "lc save_async total to commit, steady"),
    ("lc_cold.total", "lc_cold", "total", "written", "lc save_async total to commit, cold pool"),
    ("lc_lazy.total", "lc_lazy", "total", "written", "lc save_async(lazy=True) total to commit"),
    ("dcp_async.total", "dcp_async", "total", "local", "DCP async_save total (future result)"),
    ("dcp_sync.total", "dcp_sync", "total", "local", "DCP save (sync) total"),
    ("raw_write.total", "raw_write", "total", "local", "raw write: f.write + os.fsync, 1 file/rank"),
]


def _summarize(raw: dict[str, Any]) -> dict[str, Any]:
    per_rank = raw["per_rank"]
    byte_kinds = {
        "local": sum(b["local"] for b in raw["bytes"]),
        "staged": sum(r["lc_warm"][0]["staged_bytes"] for r in per_rank),
        "written": sum(r["lc_warm"][0]["bytes_written"] for r in per_rank),
    }
    rows = {}
    for key, op, metric, kind, label in ROWS:
        s = stats(_series(per_rank, op, metric))
        s.update(label=label, bytes=byte_kinds[kind], gbps=byte_kinds[kind] / s["median"] / GB)
        rows[key] = s
    if raw.get("dd"):
        dd = raw["dd"]
        rows["dd"] = {
            "median": dd["total"],
            "min": dd["total"],
            "max": dd["total"],
            "values": [dd["total"]],
            "label": "dd if=/dev/zero bs=16M conv=fsync (once, 1 process)",
            "bytes": dd["bytes"],
            "gbps": dd["bytes"] / dd["total"] / GB,
        }
    ratios = {}
    for name, (num, den, metric, bound) in TARGETS.items():
        a = rows[f"{num}.{metric}" if f"{num}.{metric}" in rows else num]["median"]
        b = rows[f"{den}.{metric}" if f"{den}.{metric}" in rows else den]["median"]
        ratios[name] = {"ratio": a / b, "target": bound, "pass": a / b <= bound}
    return {"rows": rows, "ratios": ratios, "bytes": byte_kinds}


def _print_report(summary: dict[str, Any], raw: dict[str, Any], opts: dict[str, Any]) -> None:
    dims = opts["dims"]
    b = summary["bytes"]
    print(
        f"\nlayoutckpt async-save benchmark: {opts['ranks']} gloo ranks on {os.cpu_count()} CPU cores "
        f"({opts['threads']} torch thread(s) per rank), {opts['repeats']} repeats, dir {opts['workdir']}"
    )
    print(
        f"state: Llama-like, hidden={dims['hidden']} inter={dims['inter']} kv={dims['kv']} vocab={dims['vocab']} "
        f"layers={dims['layers']}, bf16 weights + fp32 exp_avg/exp_avg_sq, tp={opts['ranks']}"
    )
    print(
        f"bytes: {b['local'] / GB:.3f} GB held over all ranks (memcpy/raw/DCP stage these), "
        f"{b['written'] / GB:.3f} GB written by layoutckpt (replicated leaves once), "
        f"{b['staged'] / GB:.3f} GB staged by it"
    )
    print(
        "DCP state dict: each rank's local tensors as plain tensors; sharded leaves keyed "
        "'<name>.tp<rank>' (DCP would keep one shard of equal keys), replicated leaves under their "
        "shared name (DCP writes them once, like layoutckpt); default FileSystemWriter, thread async."
    )
    print("time per repeat = max over ranks; median [min - max] over repeats; GB/s = bytes / median\n")
    w = max(len(r["label"]) for r in summary["rows"].values())
    print(f"{'operation':<{w}}  {'median s':>9}  {'spread s':>17}  {'GB':>6}  {'GB/s':>6}")
    print("-" * (w + 46))
    for row in summary["rows"].values():
        spread = f"{row['min']:.3f} - {row['max']:.3f}"
        print(f"{row['label']:<{w}}  {row['median']:9.3f}  {spread:>17}  {row['bytes'] / GB:6.3f}  {row['gbps']:6.2f}")
    print()
    for name, r in summary["ratios"].items():
        verdict = "PASS" if r["pass"] else "MISS"
        print(f"{name:<46} {r['ratio']:6.2f}   target <= {r['target']:<4}  {verdict}")
    before, after = raw["meminfo_before"], raw["meminfo_after"]
    if before:
        print(
            f"\npage cache: warm (never dropped; outputs deleted between repeats, source tensors in RAM). "
            f"Cached {before.get('Cached', 0) / GB:.1f} GB -> {after.get('Cached', 0) / GB:.1f} GB, "
            f"Dirty {before.get('Dirty', 0) / 1e6:.0f} MB -> {after.get('Dirty', 0) / 1e6:.0f} MB, "
            f"MemAvailable {after.get('MemAvailable', 0) / GB:.1f} GB. Every write row ends in fsync, "
            "so it waits for the device, but the device here is a virtual disk whose host may cache."
        )
    cores = os.cpu_count() or 1
    loads = (raw["loadavg_before"][0], raw["loadavg_after"][0])
    busy = " -- the machine was busy with other work, expect noise" if max(loads) > cores else ""
    print(f"load average (1 min) {loads[0]:.1f} at start, {loads[1]:.1f} at end, on {cores} cores{busy}")
    if raw.get("dd"):
        print(f"dd: {raw['dd']['cmd']} -> {' '.join(raw['dd']['report'])}")
    if raw.get("profile"):
        print(f"profiles (cProfile, rank 0, one extra steady save): {raw['profile']}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--gb", type=float, default=1.5, help="total state size over all ranks, GB (default 1.5)")
    parser.add_argument("--ranks", type=int, default=2, help="local gloo ranks = tp size (default 2)")
    parser.add_argument("--repeats", type=int, default=3, help="repeats of every measurement (default 3)")
    parser.add_argument(
        "--dir", default=tempfile.gettempdir(), help="a fresh directory is made under it (default: the temp dir)"
    )
    parser.add_argument("--json", help="write every number (per rank, per repeat) here")
    parser.add_argument("--threads", type=int, help="torch threads per rank (default: cores // ranks, at least 1)")
    parser.add_argument("--profile", help="path prefix: cProfile one extra steady save on rank 0 into PREFIX.*.pstats")
    parser.add_argument("--keep", action="store_true", help="keep the working directory")
    args = parser.parse_args(argv)

    import torch.multiprocessing as mp

    workdir = tempfile.mkdtemp(prefix="lc-async-bench-", dir=args.dir)
    opts = {
        "ranks": args.ranks,
        "repeats": args.repeats,
        "dims": model_dims(args.gb),
        "threads": args.threads or max(1, (os.cpu_count() or 1) // args.ranks),
        "workdir": workdir,
        "init_file": os.path.join(workdir, "init"),
        "profile": os.path.abspath(args.profile) if args.profile else None,
    }
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        mp.spawn(_rank_main, args=(args.ranks, opts), nprocs=args.ranks, join=True)
        with open(os.path.join(workdir, "results.json")) as f:
            raw = json.load(f)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    summary = _summarize(raw)
    _print_report(summary, raw, opts)
    out = {"command": sys.argv, "options": {**vars(args), **opts}, "summary": summary, "raw": raw}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
