"""Flat (ZeRO-style) shards: what saving from flat buffers costs against a per-parameter save.

    .venv/bin/python benchmarks/flat_shards.py [--gb 0.4] [--ranks 4] [--repeats 3] [--dir /tmp]

N local gloo ranks hold one float32 flat buffer each (an AdamW moment under ZeRO-1: equal ranges
of the concatenation of a Llama-like parameter list, the last padded). Every rank measures, after
a barrier, each repeat, and the slowest rank's time counts:

- ``flat save``: ``lc.save`` of the flat buffers (row blocks, boundary fragments sent point to
  point to the block's writer);
- ``per-param save``: ``lc.save`` of the same parameters split by rows, ``P("dp")`` (no exchange);
- ``raw write``: each rank writes its buffer's bytes to one file and fsyncs it;
- ``flat load``: the flat save loaded back as flat buffers on the same ranks;
- ``flat reshard load``: loaded as flat buffers whose ranges are shifted by half a range.

It prints the median and spread of each, GB/s, and the ratio to the per-parameter save (or raw
write). The page cache is warm for loads (the files were just written).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

from _common import leave_world

GB = 1e9


def param_list(gb: float) -> list[tuple[str, tuple[int, ...]]]:
    """A Llama-like parameter list of about ``gb`` GB of float32, with many small norms."""
    hidden = 1024
    inter = 2816
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    vocab = 8000
    layers = max(1, round((gb * GB / 4 - 2 * vocab * hidden) / per_layer))
    params = [("embed.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"layers.{i}."
        params += [(p + "attn_norm.weight", (hidden,))]
        params += [(p + f"attn.{x}.weight", (hidden, hidden)) for x in "qkvo"]
        params += [(p + "mlp_norm.weight", (hidden,))]
        params += [(p + "mlp.gate.weight", (inter, hidden)), (p + "mlp.up.weight", (inter, hidden))]
        params += [(p + "mlp.down.weight", (hidden, inter))]
    params += [("norm.weight", (hidden,)), ("head.weight", (vocab, hidden))]
    return params


def _timed(fn, dist) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - t0
    import torch

    t = torch.tensor([elapsed])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _rank(rank: int, world: int, args: argparse.Namespace, out: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    import torch.distributed as dist

    import layoutckpt as lc

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/init", rank=rank, world_size=world)
    params = param_list(args.gb)
    mesh = lc.Mesh({"dp": world})
    flat = lc.Flat(params, "dp")
    layout = lc.Layout(mesh, [(r"^exp_avg$", flat), (r".*", lc.P("dp"))])
    start, stop = flat.piece_range(mesh, rank)
    gen = torch.Generator().manual_seed(rank)
    buf = torch.randn(stop - start, generator=gen)
    total = flat.total
    buf[max(0, total - start) :] = 0  # the padding past the last parameter
    # The same bytes as per-parameter state: each parameter split by rows.
    per_param = {n: torch.randn(s, generator=gen).chunk(world)[rank].clone() for n, s in params}
    bytes_local = buf.numel() * 4
    half = (stop - start) // 2
    bounds = [0, *[min(total, flat.piece_range(mesh, r)[0] + half) for r in range(1, world)], total]
    shifted = lc.Layout(mesh, [(r"^exp_avg$", lc.Flat(params, "dp", bounds=bounds)), (r".*", lc.P())])
    names = ("flat save", "per-param save", "raw write", "flat load", "flat reshard load")
    rows: dict[str, list[float]] = {k: [] for k in names}
    for rep in range(args.repeats):
        base = f"{args.dir}/lc-flat-bench/{rep}"
        rows["flat save"].append(_timed(lambda base=base: lc.save(f"{base}/flat", {"exp_avg": buf}, layout), dist))
        rows["per-param save"].append(
            _timed(lambda base=base: lc.save(f"{base}/pp", {"exp_avg": per_param}, layout), dist)
        )

        def raw(base: str = base) -> None:
            os.makedirs(f"{base}/raw", exist_ok=True)
            with open(f"{base}/raw/{rank}", "wb") as f:
                f.write(buf.numpy().tobytes())
                f.flush()
                os.fsync(f.fileno())

        rows["raw write"].append(_timed(raw, dist))
        rows["flat reshard load"].append(_timed(lambda base=base: lc.load(f"{base}/flat", shifted), dist))
        rows["flat load"].append(_timed(lambda base=base: lc.load(f"{base}/flat", layout), dist))
        dist.barrier()
        if rank == 0:
            shutil.rmtree(base)
    if rank == 0:
        size = bytes_local * world
        print(
            f"{world} ranks, {len(params)} parameters, {size / GB:.2f} GB of float32 flat buffers "
            f"({bytes_local / 1e6:.0f} MB per rank), median of {args.repeats} (min-max)"
        )
        ref = statistics.median(rows["per-param save"])
        raw_ref = statistics.median(rows["raw write"])
        print(f"{'operation':<20} {'seconds':>8} {'spread':>15} {'GB/s':>7} {'/ per-param':>12} {'/ raw':>7}")
        for name, times in rows.items():
            m = statistics.median(times)
            spread = f"{min(times):.3f}-{max(times):.3f}"
            print(f"{name:<20} {m:8.3f} {spread:>15} {size / GB / m:7.2f} {m / ref:12.2f} {m / raw_ref:7.2f}")
    leave_world()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gb", type=float, default=0.4)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    import torch.multiprocessing as mp

    out = tempfile.mkdtemp(prefix="lc-flat-")
    try:
        mp.spawn(_rank, args=(args.ranks, args, out), nprocs=args.ranks)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
