"""Data-parallel replicas loading one checkpoint from an object store: alone, or sharing reads.

N local gloo ranks (spawned processes) each load the whole Llama-like state of ``_common``
(every array replicated, as pure data parallelism holds it, ``P()`` over ``Mesh({"dp": N})``)
from the loopback S3 server the tests use (moto, in a subprocess). Alone, storage serves the
state once per rank; with ``load(..., share_reads=True)`` each rank reads a part of every
array and sends it to the others over gloo, so storage serves it once in all (up to 8
sharers). The two ways alternate round by round (every other round in reverse); each rank
checks its result against the state. Per way: the load's time (the slowest rank's, median
and spread over ``--repeats``) and the bytes the ranks fetched from S3 together, over the
state's size.

    .venv/bin/python benchmarks/shared_reads.py [--gb 0.25] [--ranks 4] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from typing import Any

from _common import GB, build_state, leave_world, model_dims

BUCKET = "lc-bench"
S3_BYTES = "/tensorstore/kvstore/s3/bytes_read"


def _s3_bytes() -> int:
    import tensorstore as ts

    found = ts.experimental_collect_matching_metrics("/tensorstore/kvstore/s3/")
    return int(sum(v.get("value", 0) for m in found if m["name"] == S3_BYTES for v in m["values"]))


def _rank_main(rank: int, world: int, opts: dict[str, Any], results: Any) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    import layoutckpt as lc
    from layoutckpt.layout._tree import flatten

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{opts['init_file']}", rank=rank, world_size=world)
    layout = lc.Layout(lc.Mesh({"dp": world}), [(r".*", lc.P())])
    state, flat, _ = build_state(model_dims(opts["gb"]), 1, 0)  # every rank holds it all
    path = f"s3://{BUCKET}/{opts['id']}/ck"
    if rank == 0:
        lc.save(path, state, lc.Layout(lc.Mesh({"dp": 1}), [(r".*", lc.P())]), group=dist.new_group([0]))
    else:
        dist.new_group([0])  # every rank takes part in making a group
    dist.barrier()
    times: dict[str, list[float]] = {"alone": [], "shared": []}
    fetched: dict[str, list[int]] = {"alone": [], "shared": []}
    for rnd in range(opts["repeats"] + 1):  # the first round warms up
        for way in ("alone", "shared") if rnd % 2 == 0 else ("shared", "alone"):
            dist.barrier()
            before, start = _s3_bytes(), time.perf_counter()
            out = lc.load(path, layout, share_reads=way == "shared")
            seconds, got = time.perf_counter() - start, _s3_bytes() - before
            flat_out = flatten(out)[1]
            assert all(torch.equal(flat_out[k], v) for k, v in flat.items()), way
            if rnd:
                times[way].append(seconds)
                fetched[way].append(got)
    results.put((rank, times, fetched, sum(t.numel() * t.element_size() for t in flat.values())))
    leave_world()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=0.25, help="the state's size, GB (every rank holds it all)")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torch.multiprocessing as mp

    from tests.support.s3server import running

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp, running(BUCKET):  # the ranks inherit its variables
        opts = {**vars(args), "init_file": os.path.join(tmp, "init"), "id": uuid.uuid4().hex[:8]}
        procs = [ctx.Process(target=_rank_main, args=(r, args.ranks, opts, results)) for r in range(args.ranks)]
        for p in procs:
            p.start()
        per_rank = [results.get(timeout=3600) for _ in procs]
        for p in procs:
            p.join()
    nbytes = per_rank[0][3]
    print(f"{args.ranks} ranks each loading {nbytes / GB:.2f} GB from S3 (moto), {args.repeats} rounds")
    print(f"{'way':8s} {'load s, slowest rank':>26s} {'fetched from S3 / state':>25s}")
    for way in ("alone", "shared"):
        slowest = [max(r[1][way][i] for r in per_rank) for i in range(args.repeats)]
        fetched = [sum(r[2][way][i] for r in per_rank) / nbytes for i in range(args.repeats)]
        spread = f"{statistics.median(slowest):.2f} ({min(slowest):.2f}-{max(slowest):.2f})"
        print(f"{way:8s} {spread:>26s} {statistics.median(fetched):>25.2f}")


if __name__ == "__main__":
    main()
