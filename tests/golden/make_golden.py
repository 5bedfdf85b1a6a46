"""Write the golden checkpoints of the current format version under ``tests/golden/v<N>/`` (run by hand).

    python tests/golden/make_golden.py            # refuses to replace existing goldens
    python tests/golden/make_golden.py --force    # only when deliberately re-cutting this version

Run once per format version, by the layoutckpt that introduced it: ``v1`` was written by
layoutckpt 0.1 (format version 1), ``v2`` when chunk keys became ``c.0.1``, ``v3`` when
the root document gained its checksum, ``v4`` when layouts gained stages, local names, fused and
padded tensors and ZeRO over tensor parallelism (``parallel`` is new in ``v4``), ``v5`` when
checkpoints could be packed into OCDBT (``packed`` is new in ``v5``), ``v6`` when the root
document gained its ``save_id`` and every shard a binding block naming it, its array and its cell.

The goldens are the compatibility promise of ``docs/format.md``: every later layoutckpt must read
them. Regenerating them with a newer library would hide a format change, so the tests never run
this script; they compute their expectations independently and compare.

* ``basic``: two gloo ranks on ``Mesh({"tp": 2})``, so sharded arrays are stored as several
  shards written by different ranks, with uneven ``torch.chunk`` splits, an empty piece, several
  inner chunks per shard, every kind of leaf (torch, NumPy array, NumPy scalar, JSON) and every
  tree node (dict with str and int keys, list, tuple, empty containers).
* ``zstd`` and ``blosc``: one process, the same two small arrays with inner compression.
* ``parallel`` (from ``v4``): four gloo ranks on ``Mesh({"pp": 2, "dp": 1, "tp": 2})`` with
  ``stages="pp"``, each stage holding its two layers under local names (``Renumber``), a grouped
  (GQA) fused ``linear_qkv``, a fused ``[gate; up]``, a padded vocabulary (embedding on the first
  stage, output layer on the last, padded past their 5 rows) and, held alike by every stage, a
  ZeRO buffer over tensor-parallel pieces (``Flat(..., specs=...)``). Every value is a formula
  (``parallel_global``), so a test recomputes the stored arrays without this file.
* ``packed`` (from ``v5``): ``parallel``'s save with ``packing="ocdbt"``: the same objects in
  four per-rank OCDBT databases merged into one at the root.
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


# ---------------------------------------------------------------------------------------------
# parallel (format version 4 on)

PARALLEL_MESH = {"pp": 2, "dp": 1, "tp": 2}
P_LAYERS, P_GROUPS, P_QPG, P_HEAD, P_HIDDEN, P_FFN, P_VOCAB = 4, 2, 2, 2, 4, 6, 5
P_PAD_TO = 4  # Megatron pads the vocabulary to a multiple of P_PAD_TO * tp: 8 rows at tp=2
P_ZERO = [("w1", (4, 6)), ("w2", (6, 4)), ("b", (5,))]
P_ZERO_SPECS = {"w1": lc.P("tp", None), "w2": lc.P(None, "tp")}


def ramp(shape: tuple[int, ...], base: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``base + (k - n // 2) / 8`` for the k-th of n elements, exact in float32."""
    n = math.prod(shape)
    return ((torch.arange(n, dtype=torch.float64) - n // 2) / 8 + base).to(dtype).reshape(shape)


def parallel_global() -> dict[str, torch.Tensor]:
    """Every stored array of ``parallel``, whole and logical, by global name."""
    q_rows, kv_rows = P_GROUPS * P_QPG * P_HEAD, P_GROUPS * P_HEAD
    out = {
        "embedding.word_embeddings.weight": ramp((P_VOCAB, P_HIDDEN), 1),
        "output_layer.weight": ramp((P_VOCAB, P_HIDDEN), -1, torch.bfloat16),
    }
    for i in range(P_LAYERS):
        layer = f"decoder.layers.{i}"
        out[f"{layer}.self_attention.linear_qkv.q.weight"] = ramp((q_rows, P_HIDDEN), 10 * i + 2)
        out[f"{layer}.self_attention.linear_qkv.k.weight"] = ramp((kv_rows, P_HIDDEN), 10 * i + 3)
        out[f"{layer}.self_attention.linear_qkv.v.weight"] = ramp((kv_rows, P_HIDDEN), 10 * i + 4)
        out[f"{layer}.mlp.linear_fc1.gate.weight"] = ramp((P_FFN, P_HIDDEN), 10 * i + 5, torch.bfloat16)
        out[f"{layer}.mlp.linear_fc1.up.weight"] = ramp((P_FFN, P_HIDDEN), 10 * i + 6, torch.bfloat16)
        out[f"{layer}.input_layernorm.weight"] = ramp((P_HIDDEN,), 10 * i + 7)
    for j, (name, shape) in enumerate(P_ZERO):
        out[f"optimizer.exp_avg.{name}"] = ramp(shape, -10 - j)
    return out


def parallel_layout(mesh: dict[str, int]) -> lc.Layout:
    """The layout the golden was saved under; ``mesh`` may be another (``{"pp": 1, "dp": 1, "tp": 1}``)."""
    return lc.Layout(
        lc.Mesh(mesh),
        [
            (
                r"linear_qkv\.weight$",
                lc.Fused(lc.P("tp", None), [("q", P_QPG * P_HEAD), ("k", P_HEAD), ("v", P_HEAD)], groups=P_GROUPS),
            ),
            (r"linear_fc1\.weight$", lc.Fused(lc.P("tp", None), [("gate", P_FFN), ("up", P_FFN)])),
            (r"^(embedding\.word_embeddings|output_layer)\.weight$", lc.Padded(lc.P("tp", None), P_VOCAB)),
            (r"^optimizer\.exp_avg$", lc.Flat(P_ZERO, "dp", specs=P_ZERO_SPECS)),
            (r".*", lc.P()),
        ],
        stages="pp",
        names=[lc.Renumber(r"^decoder\.layers\.(\d+)\.", "pp", per=P_LAYERS // mesh["pp"])],
    )


def parallel_local_state(mesh: dict[str, int], rank: int) -> dict[str, torch.Tensor]:
    """What ``rank`` of ``mesh`` holds, by local name, cut by hand (``dp`` must be 1)."""
    full = parallel_global()
    pp, tp = mesh["pp"], mesh["tp"]
    coords = lc.Mesh(mesh).coords(rank)
    s, t = coords["pp"], coords["tp"]
    per = P_LAYERS // pp
    out: dict[str, torch.Tensor] = {}
    rows = -(-P_VOCAB // (P_PAD_TO * tp)) * P_PAD_TO

    def padded(x: torch.Tensor) -> torch.Tensor:
        whole = torch.cat([x, torch.zeros(rows * tp - P_VOCAB, P_HIDDEN, dtype=x.dtype)])
        return whole[t * rows : (t + 1) * rows].clone()

    if s == 0:
        out["embedding.word_embeddings.weight"] = padded(full["embedding.word_embeddings.weight"])
    for i in range(s * per, (s + 1) * per):
        layer, local = f"decoder.layers.{i}", f"decoder.layers.{i - s * per}"
        q, k, v = (full[f"{layer}.self_attention.linear_qkv.{n}.weight"] for n in "qkv")
        qg, kg = P_QPG * P_HEAD, P_HEAD
        groups = range(t * P_GROUPS // tp, (t + 1) * P_GROUPS // tp)
        out[f"{local}.self_attention.linear_qkv.weight"] = torch.cat(
            [torch.cat([q[g * qg : (g + 1) * qg], k[g * kg : (g + 1) * kg], v[g * kg : (g + 1) * kg]]) for g in groups]
        )
        gate, up = full[f"{layer}.mlp.linear_fc1.gate.weight"], full[f"{layer}.mlp.linear_fc1.up.weight"]
        out[f"{local}.mlp.linear_fc1.weight"] = torch.cat([gate.chunk(tp)[t], up.chunk(tp)[t]])
        out[f"{local}.input_layernorm.weight"] = full[f"{layer}.input_layernorm.weight"].clone()
    if s == pp - 1:
        out["output_layer.weight"] = padded(full["output_layer.weight"])
    # The ZeRO buffer (one data-parallel range, of this rank's tensor-parallel pieces) is held
    # alike by every stage, so that the buffer's replicas span the pipeline axis too.
    pieces = []
    for name, _ in P_ZERO:
        x, spec = full[f"optimizer.exp_avg.{name}"], P_ZERO_SPECS.get(name, lc.P())
        dim = next((d for d, e in enumerate(spec) if e == "tp"), None)
        pieces.append((x if dim is None else x.chunk(tp, dim)[t]).reshape(-1))
    out["optimizer.exp_avg"] = torch.cat(pieces)
    return out


def _save_parallel_rank(rank: int, init_file: str, path: str, packing: str = "files") -> None:
    world = math.prod(PARALLEL_MESH.values())
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        lc.save(
            path,
            parallel_local_state(PARALLEL_MESH, rank),
            parallel_layout(PARALLEL_MESH),
            step=25,
            metadata={"run": f"golden-v{lc.FORMAT_VERSION}-parallel"},
            inner_chunk_bytes=INNER_CHUNK_BYTES,
            packing=packing,
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
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        world = math.prod(PARALLEL_MESH.values())
        mp.spawn(_save_parallel_rank, args=(init_file, str(out / "parallel")), nprocs=world, join=True)
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        world = math.prod(PARALLEL_MESH.values())
        mp.spawn(_save_parallel_rank, args=(init_file, str(out / "packed"), "ocdbt"), nprocs=world, join=True)
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
