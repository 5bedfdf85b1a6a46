"""Multi-tier checkpoints in a training loop: what a checkpoint every step costs the step.

    .venv/bin/python benchmarks/tiers.py [--ranks 2] [--dim 512] [--layers 4] [--steps 20]
        [--warmup 3] [--repeats 3] [--local memory] [--durable dir] [--packing auto] [--dir /tmp]
        [--device cpu] [--modes none,tiers,lazy,dcp] [--json out.json]

N local gloo ranks train a small Llama-like model data-parallel (gradients all-reduced, AdamW),
and time every step in four modes, alternated repeat by repeat in one run so that the
machine's drift falls on all of them:

- ``none``: no checkpoint;
- ``tiers``: ``CheckpointManager(durable, local=..., persist_every=10)`` saves model and
  optimizer every step to the fast tier (``--local memory``: host memory, each piece held as
  the host arrays the save copied into; ``shm``: a directory per rank under /dev/shm; ``disk``:
  under ``--dir``), and persists every 10th step to the durable tier in the background (``--durable
  dir``: a directory under ``--dir``; ``s3``: the loopback S3 server the tests use, moto, whose
  Python process shares the cores with the ranks, so read its step times with that in mind;
  ``--packing files`` or ``ocdbt`` is the manager's ``packing``: by default persists are packed);
- ``lazy``: as ``tiers``, but each save returns before its copy (``save(..., lazy=True)``), which
  runs on a thread while the next step computes; the step waits for it (``wait_staged()``) only
  before its optimizer update changes what is copied. On a GPU the copy would run on a side
  stream beside forward and backward; here it shares the CPU cores with them;
- ``dcp``: PyTorch DCP ``async_save`` every step (each waits for the previous, as DCP requires).

It reports the median step time of each mode (the maximum over ranks of each rank's median over
its steps, then the median over repeats) and the mean step time likewise, each with its ratio to
``none``, and for ``tiers`` the copy into host memory (the part of the save the loop waits for)
next to the step time (for ``lazy``, the copy that ran beside the next step), and the full
passes of Python's garbage collector in the timed steps. A persist slows the one or two steps
that run beside it, which the median hides and the mean (what a run's length follows) counts;
``--json`` also holds every step's time (the slowest rank's), for a look at those steps. The
first persist that outlives its step's place on a memory tier grows the pool by one set of
buffers, once: ``--warmup 13 --steps 33`` leaves it out and times two whole persist cycles.
Then it restores the newest step from the fast tier and a persisted step from the durable tier, each twice: into fresh
arrays (``mgr.load(layout)``: the new memory's page faults are paid whichever tier serves it) and
into the live model and optimizer (``like=state, inplace=True``, as a job restoring into the model
it built), and reports the times and their ratios. A directory durable tier is read twice: as it
is (the page cache still holds the persisted files) and after they are dropped from the page
cache (``cold``), as a restart that finds them only on disk.

With ``--device cuda`` (one GPU per rank; gradients all-reduced by NCCL) the model trains on the
GPU, each step ends when the caller's stream has run its kernels, and the copy goes to pinned
host buffers on a side stream: in ``lazy`` it overlaps the next step's forward and backward.
Size the model so that the copy fits in a step (e.g. ``--dim 1024 --layers 8 --vocab 32000
--batch 8 --seq 1024``). Without it the copy runs on the CPU's cores, beside the step.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import queue
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from typing import Any

from _common import evict

MODES = ("none", "tiers", "lazy", "dcp")
RESTORES = ("fresh", "inplace")
BUCKET = "lc-bench"


def _model(dim: int, layers: int, vocab: int) -> Any:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
            self.qkv, self.o = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
            self.up, self.down = nn.Linear(dim, 4 * dim, bias=False), nn.Linear(4 * dim, dim, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
            x = x + self.o(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
            return x + self.down(torch.nn.functional.silu(self.up(self.norm2(x))))

    class Llama(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.head = nn.Linear(dim, vocab, bias=False)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            x = self.embed(tokens)
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    torch.manual_seed(0)
    return Llama()


def _rank(rank: int, world: int, opts: dict[str, Any], out: Any) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import layoutckpt as lc

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    cuda = opts["device"] == "cuda"
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    dist.init_process_group(backend, init_method=f"file://{opts['work']}/init", rank=rank, world_size=world)
    # DCP's async_save runs its collectives on a thread: on the training loop's group they would
    # interleave with the gradient all-reduces, so it gets a group of its own.
    dcp_group = dist.new_group(backend="gloo")
    model = _model(opts["dim"], opts["layers"], opts["vocab"]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    layout = lc.Layout.replicated(lc.Mesh({"dp": world}))  # data-parallel: every rank holds it all
    tokens = torch.randint(
        0, opts["vocab"], (opts["batch"], opts["seq"]), generator=torch.Generator().manual_seed(rank)
    ).to(device)
    # A step ends when its kernels have run: the caller's stream only, not a lazy copy's.
    done = torch.cuda.current_stream(device).synchronize if cuda else (lambda: None)

    def train_step(before_update: Any = None) -> None:
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        if before_update is not None:
            before_update()  # a lazy save's copy must be done before the update changes what it copies
        opt.step()
        opt.zero_grad()

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    train_step()  # the optimizer's moments exist from here on
    results: dict[str, list[dict[str, float]]] = {m: [] for m in opts["modes"]}
    local = {"memory": "memory://bench-{run}/{{rank}}", "shm": "/dev/shm/lc-bench-{run}/{{rank}}"}.get(
        opts["local"], os.path.join(opts["work"], "local-{run}", "{{rank}}")
    )
    restore: list[dict[str, float]] = []
    for rep in range(opts["repeats"]):
        for mode in opts["modes"]:
            run = f"{rep}-{mode}"
            durable = os.path.join(opts["work"], f"durable-{run}")
            if opts["durable"] == "s3" and mode in ("tiers", "lazy"):
                durable = f"s3://{BUCKET}/{opts['id']}/durable-{run}"
            times, copies, calls = [], [], []
            full_gc = _FullCollections()
            mgr = None
            if mode in ("tiers", "lazy"):
                packing = {} if opts["packing"] == "auto" else {"packing": opts["packing"]}
                mgr = lc.CheckpointManager(
                    durable, local=local.format(run=run), persist_every=10, keep_last=2, **packing
                )
            pending = staged = None
            for step in range(1, opts["steps"] + 1):
                dist.barrier()
                full_gc.counting = step > opts["warmup"]
                t0 = time.perf_counter()
                train_step(staged.wait_staged if staged is not None else None)
                done()
                if mgr is not None:
                    fut = mgr.save(step, state(), layout, lazy=mode == "lazy")
                    staged = fut if mode == "lazy" else None
                    copies.append(mgr.tier_metrics().copy_seconds)
                    calls.append(mgr.tier_metrics().blocked_seconds)
                elif mode == "dcp":
                    if pending is not None:
                        pending.result()
                    pending = dcp.async_save(
                        state(), checkpoint_id=os.path.join(durable, f"step_{step}"), process_group=dcp_group
                    )
                times.append(time.perf_counter() - t0)
            full_gc.stop()
            if pending is not None:
                pending.result()
            # The first steps allocate buffers and make plans; a pool finds its size only once
            # persists have held buffers (pinned ones cost a CUDA allocation each).
            skip = min(opts["warmup"], len(times) - 2)
            results[mode].append(
                {
                    "step": statistics.median(times[skip:]),
                    "mean": statistics.mean(times[skip:]),
                    "copy": statistics.median(copies[skip:]) if copies else 0.0,
                    "call": statistics.median(calls[skip:]) if calls else 0.0,
                    "slowest": max(times[skip:]),
                    "gc": full_gc.count,
                    "times": times,
                }
            )
            if mgr is not None:
                mgr.wait()
                mgr.close()
                # A step only the durable tier holds (the fast tier keeps the last two).
                with lc.CheckpointManager(durable) as plain:
                    persisted = min(plain.steps())
                # One mode's restores: the lazy mode's checkpoints are the same as the tiers mode's.
                if mode == next(m for m in opts["modes"] if m in ("tiers", "lazy")):
                    restore.append(_restore(lc, durable, local.format(run=run), layout, persisted, dist, state, done))
                mine = local.format(run=run).replace("{rank}", str(rank))
                if opts["local"] == "memory":  # the held pieces stay for the process otherwise
                    from layoutckpt.storage._location import locate

                    locate(mine).discard()
                else:
                    shutil.rmtree(mine, ignore_errors=True)
            dist.barrier()
            if rank == 0 and "://" not in durable:  # S3's objects go with its server
                shutil.rmtree(durable, ignore_errors=True)
                if mgr is not None and opts["local"] != "memory":  # the folder of the ranks' folders
                    shutil.rmtree(os.path.dirname(local.format(run=run)), ignore_errors=True)
    out.put((rank, {"modes": results, "restore": restore, "state_bytes": _nbytes(state())}))
    dist.destroy_process_group()


class _FullCollections:
    """Full passes of Python's cyclic garbage collector while ``counting``: each walks every
    object of the process (a tenth of a second or more beside torch), and objects a checkpoint
    keeps alive across steps are what brings them on (docs/design/multi-tier.md)."""

    def __init__(self) -> None:
        self.count = 0
        self.counting = False
        gc.callbacks.append(self._seen)

    def _seen(self, phase: str, info: dict[str, Any]) -> None:
        if self.counting and phase == "stop" and info["generation"] == 2:
            self.count += 1

    def stop(self) -> None:
        gc.callbacks.remove(self._seen)


def _restore(
    lc: Any, durable: str, local: str, layout: Any, persisted: int, dist: Any, state: Any, done: Any
) -> dict[str, float]:
    """Seconds of each restore: ``fast`` (the newest step, from the fast tier) and ``durable``
    (a step only the durable tier holds), each into fresh arrays and in place."""
    times = {}
    tiers = [("fast", None, "local"), ("durable", persisted, "durable")]
    if "://" not in durable:  # a directory: also read it after its files leave the page cache
        tiers.append(("cold", persisted, "durable"))
    with lc.CheckpointManager(durable, local=local) as mgr:
        for restore in RESTORES:
            into = {"like": state(), "inplace": True} if restore == "inplace" else {}
            for tier, step, source in tiers:
                if tier == "cold":
                    evict(str(mgr.path(persisted)))
                dist.barrier()
                t0 = time.perf_counter()
                out = mgr.load(layout, step=step, **into)
                done()
                times[f"{tier}_{restore}"] = time.perf_counter() - t0
                assert mgr.tier_metrics().restored_from == source
                del out  # freed before the next restore allocates
    return times


def _nbytes(state: Any) -> int:
    import torch

    if isinstance(state, dict):
        return sum(_nbytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(_nbytes(v) for v in state)
    return state.numel() * state.element_size() if isinstance(state, torch.Tensor) else 0


def _summary(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    repeats = len(per_rank[0]["modes"]["none"])
    rows = {}
    modes = list(per_rank[0]["modes"])
    for mode in modes:
        step, mean, copy, call, slowest, full = (
            [max(r["modes"][mode][i][k] for r in per_rank) for i in range(repeats)]
            for k in ("step", "mean", "copy", "call", "slowest", "gc")
        )
        rows[mode] = {
            "step_s": statistics.median(step),
            "mean_s": statistics.median(mean),
            "copy_s": statistics.median(copy),
            "call_s": statistics.median(call),
            "slowest_s": statistics.median(slowest),
            "full_collections": statistics.median(full),
            "spread": [min(step), max(step)],
        }
    for mode in modes:
        rows[mode]["vs_none"] = rows[mode]["step_s"] / rows["none"]["step_s"]
        rows[mode]["mean_vs_none"] = rows[mode]["mean_s"] / rows["none"]["mean_s"]
    restore = {}
    for kind in RESTORES:
        fast = [max(r["restore"][i][f"fast_{kind}"] for r in per_rank) for i in range(repeats)]
        slow = [max(r["restore"][i][f"durable_{kind}"] for r in per_rank) for i in range(repeats)]
        ratios = [s / f for s, f in zip(slow, fast)]
        restore[kind] = {
            "fast_s": statistics.median(fast),
            "durable_s": statistics.median(slow),
            "durable_over_fast": statistics.median(ratios),
            "ratio_spread": [min(ratios), max(ratios)],
        }
        if f"cold_{kind}" in per_rank[0]["restore"][0]:
            cold = [max(r["restore"][i][f"cold_{kind}"] for r in per_rank) for i in range(repeats)]
            colds = [c / f for c, f in zip(cold, fast)]
            restore[kind].update(cold_s=statistics.median(cold), cold_over_fast=statistics.median(colds))
    times = {
        mode: [[max(ts) for ts in zip(*(r["modes"][mode][i]["times"] for r in per_rank))] for i in range(repeats)]
        for mode in modes
    }
    return {"rows": rows, "restore": restore, "times": times}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the times")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--local", choices=("memory", "shm", "disk"), default="memory")
    ap.add_argument("--durable", choices=("dir", "s3"), default="dir")
    ap.add_argument("--packing", choices=("auto", "files", "ocdbt"), default="auto")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument(
        "--modes",
        type=lambda v: v.split(","),
        default=list(MODES),
        help="none,tiers,lazy,dcp; none, the ratios' baseline, always runs",
    )
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    args.modes = ["none"] + [m for m in args.modes if m != "none"]
    with contextlib.ExitStack() as stack:
        if args.durable == "s3":
            sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            from tests.support.s3server import running

            stack.enter_context(running(BUCKET))  # its variables reach the ranks through os.environ
        summary = _run(args)
    _print(args, summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **summary}, f, indent=2)
    return summary


def _run(args: argparse.Namespace) -> dict[str, Any]:
    import torch.multiprocessing as mp

    work = tempfile.mkdtemp(prefix="lc-tiers-", dir=args.dir)
    opts = {**vars(args), "work": work, "id": uuid.uuid4().hex[:6]}
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, opts, out)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    per_rank = {}
    while len(per_rank) < len(procs):
        try:
            rank, result = out.get(timeout=5)
            per_rank[rank] = result
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                raise SystemExit("a rank failed; see its traceback above") from None
    for p in procs:
        p.join()
    shutil.rmtree(work, ignore_errors=True)
    summary = _summary([per_rank[r] for r in range(args.ranks)])
    summary["state_mb_per_rank"] = per_rank[0]["state_bytes"] / 2**20
    return summary


def _print(args: argparse.Namespace, summary: dict[str, Any]) -> None:
    print(
        f"{args.ranks} ranks, {summary['state_mb_per_rank']:.1f} MiB of model+optimizer per rank, "
        f"local tier {args.local}, durable tier {args.durable} (packing {args.packing}), device {args.device}"
    )
    print(
        f"{'mode':8} {'step (s)':>10} {'vs none':>8} {'mean (s)':>10} {'vs none':>8} {'copy (s)':>10} "
        f"{'call (s)':>10} {'slowest':>10} {'full gc':>8}  "
        f"median's spread over {args.repeats} repeats"
    )
    for mode, row in summary["rows"].items():
        print(
            f"{mode:8} {row['step_s']:10.4f} {row['vs_none']:8.3f} {row['mean_s']:10.4f} {row['mean_vs_none']:8.3f} "
            f"{row['copy_s']:10.4f} {row['call_s']:10.4f} {row['slowest_s']:10.4f} {row['full_collections']:8g}  "
            f"{row['spread'][0]:.4f}-{row['spread'][1]:.4f}"
        )
    for kind, r in summary["restore"].items():
        print(
            f"restore {kind:8}: fast tier {r['fast_s']:.4f} s, durable tier {r['durable_s']:.4f} s, "
            f"durable/fast {r['durable_over_fast']:.2f}x ({r['ratio_spread'][0]:.2f}-{r['ratio_spread'][1]:.2f})"
        )
        if "cold_s" in r:
            print(
                f"restore {kind:8}: durable tier out of the page cache {r['cold_s']:.4f} s, "
                f"durable/fast {r['cold_over_fast']:.2f}x"
            )


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
