"""Peak memory and time of one ``lc.load`` in one process, against the bytes it returns.

    .venv/bin/python benchmarks/load_memory.py [--repeats 3] [--dir /tmp]

Saves a 0.46 GB float32 state (a 131 MB embedding and twelve layers of 1024-wide weights), then
for each repeat evicts it from the page cache, resets the process's RSS high-water mark
(``/proc/self/clear_refs``) and loads it. Prints the load time (cold) and the peak RSS growth
over the bytes loaded: what the load itself holds at its worst.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import tempfile
import time

import torch

import layoutckpt as lc


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _evict(path: str) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="lc-loadmem-", dir=args.dir)
    try:
        state = {"embed": torch.randn(32000, 1024)}
        for i in range(12):
            state[f"l{i}"] = {
                "wq": torch.randn(1024, 1024),
                "w1": torch.randn(2816, 1024),
                "w2": torch.randn(1024, 2816),
                "norm": torch.randn(1024),
            }
        nbytes = sum(
            t.numel() * t.element_size() for v in state.values() for t in ([v] if torch.is_tensor(v) else v.values())
        )
        lc.save(f"{work}/ck", state)
        del state
        times, growth = [], []
        for _ in range(args.repeats):
            gc.collect()
            _evict(f"{work}/ck")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            before = _status("VmRSS")
            t0 = time.perf_counter()
            out = lc.load(f"{work}/ck")
            times.append(time.perf_counter() - t0)
            growth.append(_status("VmHWM") - before)
            del out
        print(
            f"{nbytes / 1e9:.2f} GB loaded: cold load {statistics.median(times):.3f} s (median of {args.repeats}), "
            f"peak RSS growth {max(growth) / 1e9:.2f} GB = {max(growth) / nbytes:.2f}x the bytes loaded (worst)"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
