"""What each pass a warm load makes over its bytes costs on this machine, against a memcpy.

A load from the page cache copies each byte out of the kernel, takes its crc32c and places it
in the destination, in tiles where the inner chunks cut the last dimension (which keeps
resharded and partial reads exact). This script times each pass alone over ``--gib`` GiB on one
thread, and together as a load makes them, piece by piece in a reused 2 MiB buffer:

- ``memcpy``: one copy between two buffers made once (the target's yardstick);
- ``kernel copy``: the file read from the page cache into the reused buffer;
- ``crc32c``: of each piece, in the cache;
- ``tiles``: each piece placed as (64, 128) float32 tiles, side by side, into a destination;
- ``checked read``: read, crc32c and a contiguous copy of each piece (``bench.py``'s row);
- ``checked read, tiles``: read, crc32c and the tiles: what a load that checks every byte and
  keeps its reads exact makes per byte, before any per-shard work.

The passes alternate round by round; each row gives the median of ``--repeats`` rounds with its
spread, in ms per GiB, and memcpy's time over the row's (the fraction of memcpy's speed).

    .venv/bin/python benchmarks/byte_passes.py [--gib 1] [--repeats 7] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import crc32c
import numpy as np

PIECE = 2 << 20  # the slab a load reads, checks and places at once
TILE = (64, 128)  # float32: 32 KiB, an inner chunk of the benchmark state's size


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args(argv)
    nbytes = max(PIECE, int(args.gib * (1 << 30)) // PIECE * PIECE)
    rows = measure(nbytes, args.dir, args.repeats)
    base = statistics.median(rows["memcpy"])
    print(f"{args.gib:g} GiB on one thread, {args.repeats} rounds: ms per GiB, median (min-max)")
    print(f"{'pass':22s} {'ms per GiB':>20s} {'memcpy / pass':>14s}")
    scale = 1e3 * (1 << 30) / nbytes
    for name, seconds in rows.items():
        ms = [s * scale for s in seconds]
        cell = f"{statistics.median(ms):.0f} ({min(ms):.0f}-{max(ms):.0f})"
        print(f"{name:22s} {cell:>20s} {base / statistics.median(seconds):14.2f}")


def measure(nbytes: int, folder: str, repeats: int) -> dict[str, list[float]]:
    """Each pass's seconds per round over ``nbytes`` (whole pieces), read from a file in ``folder``."""
    fd, path = tempfile.mkstemp(dir=folder, prefix="lc-byte-passes-")
    try:
        rng = np.random.default_rng(0)
        for _ in range(nbytes // PIECE):
            os.write(fd, rng.integers(0, 256, PIECE, dtype=np.uint8).tobytes())
        return _rounds(_passes(fd, nbytes), repeats)
    finally:
        os.close(fd)
        os.unlink(path)


def _passes(fd: int, nbytes: int) -> dict[str, Callable[[], None]]:
    buf = np.empty(PIECE, np.uint8)
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)  # touched once: a load in place fills existing memory
    rows, cols = TILE
    per = PIECE // (4 * rows * cols)  # tiles side by side in one piece
    grid = dst.view(np.float32).reshape(-1, per * cols)  # each piece's tiles fill one band of rows
    tiles = buf.view(np.float32).reshape(per, rows, cols).transpose(1, 0, 2)

    def read(off: int) -> None:
        os.preadv(fd, [buf], off)

    def place(off: int) -> None:
        band = off // PIECE * rows
        grid[band : band + rows].reshape(rows, per, cols)[...] = tiles

    def check(off: int) -> None:
        crc32c.crc32c(buf)

    def copy(off: int) -> None:
        dst[off : off + PIECE] = buf

    def each(*steps: Callable[[int], None]) -> Callable[[], None]:
        def run() -> None:
            for off in range(0, nbytes, PIECE):
                for step in steps:
                    step(off)

        return run

    return {
        "memcpy": lambda: np.copyto(dst, src),
        "kernel copy": each(read),
        "crc32c": each(check),
        "tiles": each(place),
        "checked read": each(read, check, copy),
        "checked read, tiles": each(read, check, place),
    }


def _rounds(passes: dict[str, Callable[[], None]], repeats: int) -> dict[str, list[float]]:
    """Every pass once per round, every other round in reverse; the first round warms up."""
    rows: dict[str, list[float]] = {name: [] for name in passes}
    for rnd in range(repeats + 1):
        for name in passes if rnd % 2 == 0 else reversed(passes):
            start = time.perf_counter()
            passes[name]()
            if rnd:
                rows[name].append(time.perf_counter() - start)
    return rows


if __name__ == "__main__":
    main()
