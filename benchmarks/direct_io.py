"""Saving past the page cache (``IOConfig(direct_io=True)``, the default) against through it.

    .venv/bin/python benchmarks/direct_io.py [--gb 2.0] [--ranks 1,2,4] [--repeats 7] [--dir /tmp]

For each N in ``--ranks``, N local gloo ranks hold the bench's training state (``_common``:
``--gb`` GB of a Llama-like bf16 model and two fp32 AdamW moments, tensor-parallel over N) and
save it with ``IOConfig(direct_io=True)`` and ``IOConfig(direct_io=False)`` in turn,
``--repeats`` times each, so the disk's drift over the run falls on both alike. Each save starts after a barrier; the
slowest rank's time counts, and the CPU time (user and system) summed over ranks.

Nothing is deleted while the saves run: on ext4 without a journal, every file created in the
minutes after a deletion pays for the inodes it freed (``docs/performance.md``, "Deleting right
before saving"). The output two saves back is truncated instead (``_common.free_output``), and
everything is deleted at the end.

It prints, for each N: the median and spread of each mode's time, GB/s, median CPU seconds, and
direct over buffered for both.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import RULES, build_state, free_output, leave_world, model_dims

MODES = {"direct": True, "buffered": False}


def _rank(rank: int, world: int, args: argparse.Namespace, root: str, queue) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    import torch.distributed as dist

    import layoutckpt as lc

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root}/init-{world}", rank=rank, world_size=world)
    state, _, nbytes = build_state(model_dims(args.gb), world, rank)
    layout = lc.Layout(lc.Mesh({"tp": world}), [(pat, lc.P(*spec)) for pat, spec in RULES])
    times: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    written: list[str] = []
    for rep in range(args.repeats + 1):  # the first round is untimed: imports, pools, first touches
        for mode, direct in MODES.items():
            path = f"{root}/n{world}-{rep}-{mode}"
            if rank == 0 and len(written) >= 2:
                free_output(written[-2], delete=False)
            dist.barrier()
            c0, t0 = os.times(), time.perf_counter()
            lc.save(path, state, layout, io=lc.IOConfig(direct_io=direct))
            elapsed, c1 = time.perf_counter() - t0, os.times()
            written.append(path)
            if rep:
                times[mode].append((elapsed, c1.user - c0.user + c1.system - c0.system))
    queue.put((rank, times, nbytes["local"]))
    queue.close()
    queue.join_thread()  # the result sent before the rank leaves
    dist.barrier()
    leave_world()


def _report(world: int, results: list, repeats: int) -> None:
    total = sum(nbytes for _, _, nbytes in results)
    print(f"\nN = {world}: {total / 1e9:.2f} GB over {world} ranks, {repeats} saves of each, alternated")
    print(f"{'mode':<10} {'median s':>9} {'spread s':>15} {'GB/s':>6} {'CPU s':>6}")
    medians = {}
    for mode in MODES:
        walls = [max(t[mode][k][0] for _, t, _ in results) for k in range(repeats)]
        cpus = [sum(t[mode][k][1] for _, t, _ in results) for k in range(repeats)]
        medians[mode] = statistics.median(walls), statistics.median(cpus)
        m, c = medians[mode]
        print(f"{mode:<10} {m:9.3f} {min(walls):7.3f}-{max(walls):<7.3f} {total / 1e9 / m:6.2f} {c:6.2f}")
    (dw, dc), (bw, bc) = medians["direct"], medians["buffered"]
    print(f"direct / buffered: time {dw / bw:.2f}x, CPU {dc / bc:.2f}x (< 1: direct is cheaper)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gb", type=float, default=2.0)
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    import torch.multiprocessing as mp

    root = tempfile.mkdtemp(prefix="lc-direct-", dir=args.dir)
    try:
        for world in (int(n) for n in args.ranks.split(",")):
            ctx = mp.get_context("spawn")
            queue = ctx.Queue()
            procs = [ctx.Process(target=_rank, args=(r, world, args, root, queue)) for r in range(world)]
            for p in procs:
                p.start()
            results = [queue.get() for _ in procs]
            for p in procs:
                p.join()
            if any(p.exitcode for p in procs):
                raise SystemExit(f"a rank failed at N = {world}")
            _report(world, results, args.repeats)
            sys.stdout.flush()
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
