"""Write the golden checkpoints of the current format version under ``tests/golden/v<N>/`` (run by hand).

    python tests/golden/make_golden.py            # refuses to replace existing goldens
    python tests/golden/make_golden.py --force    # only when deliberately re-cutting this version

Run once per format version, by the layoutckpt that introduced it: ``v1`` was written by
layoutckpt 0.1 (format version 1), ``v2`` when chunk keys became ``c.0.1``, ``v3`` when
the root document gained its checksum.

The goldens are the compatibility promise of ``docs/format.md``: every later layoutckpt must read
them. Regenerating them with a newer library would hide a format change, so the tests never run
this script; they compute their expectations independently and compare.

* ``basic``: two gloo ranks on ``Mesh({"tp": 2})``, so sharded arrays are stored as several
  shards written by different ranks, with uneven ``torch.chunk`` splits, an empty piece, several
  inner chunks per shard, every kind of leaf (torch, NumPy array, NumPy scalar, JSON) and every
  tree node (dict with str and int keys, list, tuple, empty containers).
* ``zstd`` and ``blosc``: one process, the same two small arrays with inner compression.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import layoutckpt as lc

HERE = Path(__file__).resolve().parent
WORLD = 2
# Tiny inner chunks, so that shards hold several of them (and the edge shard a missing one).
INNER_CHUNK_BYTES = 16

BASIC_RULES = [
    (r"^model\.embed\.weight$", lc.P("tp", None)),
    (r"\.proj\.weight$", lc.P(None, "tp")),
    (r"\.fp8$", lc.P("tp", None)),
    (r"^(counts|tiny)$", lc.P("tp")),
    (r"^mask$", lc.P("tp", None)),
    (r".*", lc.P()),
]


def basic_full_state() -> dict:
    """The global state: every array whole, before it is split over ranks."""
    return {
        "model": {
            "embed": {"weight": torch.arange(20, dtype=torch.float32).reshape(5, 4)},
            "layers": [
                {
                    "proj": {"weight": ((torch.arange(18) - 9) * 0.25 + i).to(torch.bfloat16).reshape(3, 6)},
                    "norm": {"scale": 1 + torch.arange(4, dtype=torch.float32) / 8 + i},
                }
                for i in range(2)
            ],
            "head": {"fp8": (torch.arange(8, dtype=torch.float32) / 2).to(torch.float8_e4m3fn).reshape(4, 2)},
        },
        "counts": (torch.arange(7, dtype=torch.int64) - 3) * 10**12,
        "mask": (torch.arange(6) % 3 == 0).reshape(3, 2),
        "tiny": torch.tensor([42], dtype=torch.int64),
        "temperature": torch.tensor(0.5, dtype=torch.float32),
        "optim": {"step": torch.tensor(3, dtype=torch.int64), "state": {0: {"exp_avg": torch.arange(4) * 0.5}}},
        "table": np.arange(6, dtype=np.float64).reshape(2, 3) / 3,
        "np_scalar": np.int32(-7),
        "extra": {
            "epoch": 3,
            "name": "golden",
            "nothing": None,
            "flag": True,
            "lr": 0.001,
            "big": 2**62,
            "nan": math.nan,
            "inf": math.inf,
            "ninf": -math.inf,
        },
        "pair": ("tuple", [1, 2.5]),
        "empty": {"d": {}, "l": []},
    }


def local_piece(full: torch.Tensor, spec: lc.P, mesh: lc.Mesh, rank: int) -> torch.Tensor:
    """This rank's shard, cut with ``torch.chunk`` (one mesh axis per dim is all the golden uses)."""
    coords = mesh.coords(rank)
    out = full
    for dim, axis in enumerate(spec):
        if axis is None:
            continue
        pieces = out.chunk(mesh.axis_size(axis), dim=dim)
        index = coords[axis]
        out = pieces[index] if index < len(pieces) else out.narrow(dim, 0, 0)
    return out.clone()


def basic_local_state(rank: int, layout: lc.Layout) -> dict:
    def cut(x: object, name: str) -> object:
        if isinstance(x, dict):
            return {k: cut(v, f"{name}.{k}" if name else str(k)) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return type(x)(cut(v, f"{name}.{i}") for i, v in enumerate(x))
        if isinstance(x, torch.Tensor):
            return local_piece(x, layout.spec_for(name), layout.mesh, rank)
        return x  # NumPy leaves here are replicated, JSON leaves are the same everywhere

    return cut(basic_full_state(), "")


def _save_basic_rank(rank: int, init_file: str, path: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        layout = lc.Layout(lc.Mesh({"tp": WORLD}), BASIC_RULES)
        lc.save(
            path,
            basic_local_state(rank, layout),
            layout,
            step=12,
            metadata={"run": f"golden-v{lc.FORMAT_VERSION}", "config": {"layers": 2, "tags": ["a", "b"]}},
            inner_chunk_bytes=INNER_CHUNK_BYTES,
        )
    finally:
        dist.destroy_process_group()


def compressed_state() -> dict:
    return {
        "w": torch.arange(24, dtype=torch.float32).reshape(4, 6),
        "h": (torch.arange(8) - 4).to(torch.bfloat16),
    }


def make(out: Path) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.spawn(_save_basic_rank, args=(init_file, str(out / "basic")), nprocs=WORLD, join=True)
    layout = lc.Layout(lc.Mesh({"dp": 1}), [(r".*", lc.P())])
    for compression in ("zstd", "blosc"):
        lc.save(out / compression, compressed_state(), layout, step=1, inner_chunk_bytes=48, compression=compression)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / f"v{lc.FORMAT_VERSION}")
    parser.add_argument("--force", action="store_true", help="replace existing goldens")
    args = parser.parse_args()
    if args.out.exists():
        if not args.force:
            sys.exit(f"{args.out} exists; goldens are a compatibility promise, pass --force to re-cut them")
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    make(args.out)
    total = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"wrote {args.out} ({total} bytes)")


if __name__ == "__main__":
    main()
