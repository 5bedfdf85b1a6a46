"""layoutckpt end to end: save from 4 ranks, read a slice in one plain process, resume on 3 ranks.

1. Four gloo ranks on this CPU hold a small Llama-like model sharded Megatron-style under the mesh
   dp=2, tp=2 (column-parallel q/k/v/gate/up, row-parallel o/down, vocab-parallel embedding and
   lm_head, replicated norms) and save it in one call.
2. One plain process, with no torch.distributed, opens the checkpoint and reads rows 0:8 of one
   weight, touching only the inner chunks that hold them.
3. Three ranks resume it under the mesh tp=3 with the opposite split (row-parallel where it was
   column-parallel, and the reverse): no conversion step, each rank reads just its own boxes.

Every shard is checked against torch.chunk slices of the full tensors, which any rank can rebuild
from the seed. Exits non-zero on any mismatch. Bytes written and loaded are the library's own
figures (``SaveResult.bytes_written``, ``LoadFuture.metrics.bytes``), the size on disk is the
files'; bytes read from storage are the operating system's count for the process (``rchar`` in
Linux's /proc/self/io).

    python examples/demo.py [OUTPUT_DIR]    # keeps OUTPUT_DIR/ckpt and OUTPUT_DIR/figures.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import layoutckpt as lc

SEED = 1234
VOCAB, HIDDEN, INTERMEDIATE, LAYERS = 1000, 256, 688, 2
STEP = 100
METADATA = {"model": "llama-tiny", "tokens_seen": 409600}
# Megatron-style tensor parallelism; mesh axes the rules do not name (here dp) hold replicas.
SPEC_FILE = Path(__file__).resolve().parent.parent / "specs" / "llama_tp.toml"
SLICE_NAME = "model.embed_tokens.weight"
# The default inner chunk (about 2 MiB) is sized for real models; this model's shards are smaller
# than that, so the demo asks for 32 KiB inner chunks to show a partial read touching two of them.
INNER_CHUNK_BYTES = 32 << 10

SAVE_MESH = {"dp": 2, "tp": 2}
RESUME_MESH = {"tp": 3}
# The layout the job resumes under: row-parallel where the save was column-parallel and the
# reverse, the embedding split along hidden instead of vocab, lm_head still vocab-parallel.
RESUME_RULES = [
    (r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.weight$", lc.P(None, "tp")),
    (r"\.(o_proj|down_proj)\.weight$", lc.P("tp", None)),
    (r"embed_tokens\.weight$", lc.P(None, "tp")),
    (r"^lm_head\.weight$", lc.P("tp", None)),
    (r".*", lc.P()),
]


# --- the model: full tensors from the seed, and each rank's torch.chunk pieces of them ----------


def parameters() -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Global name -> (full shape, dtype): float32 attention and norms, bfloat16 MLP and lm_head."""
    params: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
        "model.embed_tokens.weight": ((VOCAB, HIDDEN), torch.float32)
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            params[p + f"self_attn.{proj}.weight"] = ((HIDDEN, HIDDEN), torch.float32)
        params[p + "mlp.gate_proj.weight"] = ((INTERMEDIATE, HIDDEN), torch.bfloat16)
        params[p + "mlp.up_proj.weight"] = ((INTERMEDIATE, HIDDEN), torch.bfloat16)
        params[p + "mlp.down_proj.weight"] = ((HIDDEN, INTERMEDIATE), torch.bfloat16)
        params[p + "input_layernorm.weight"] = ((HIDDEN,), torch.float32)
        params[p + "post_attention_layernorm.weight"] = ((HIDDEN,), torch.float32)
    params["model.norm.weight"] = ((HIDDEN,), torch.float32)
    params["lm_head.weight"] = ((VOCAB, HIDDEN), torch.bfloat16)
    return params


def full_tensor(name: str) -> torch.Tensor:
    """The full tensor ``name``: the same on every process, from the seed and the name alone."""
    shape, dtype = parameters()[name]
    g = torch.Generator().manual_seed(SEED + zlib.crc32(name.encode()))
    return (torch.randn(shape, generator=g) * 0.02).to(dtype)


def piece(spec: lc.P, mesh: lc.Mesh, rank: int, t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``t`` under ``spec``, cut as torch.chunk cuts (empty past the last piece)."""
    coords = mesh.coords(rank)
    for dim, entry in enumerate(spec.padded(t.dim())):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
        parts, index = 1, 0
        for axis in axes:  # several axes split one dimension major to minor
            parts, index = parts * mesh.axis_size(axis), index * mesh.axis_size(axis) + coords[axis]
        pieces = torch.chunk(t, parts, dim)
        t = pieces[index] if index < len(pieces) else t.narrow(dim, t.shape[dim], 0)
    return t.contiguous()


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"model.layers.0.w": x}`` -> ``{"model": {"layers": [{"w": x}]}}``, as a model's state dict nests."""
    root: dict[str, Any] = {}
    for name, value in flat.items():
        node = root
        *parents, last = name.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value

    def lists(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        if node and all(k.isdigit() for k in node) and sorted(map(int, node)) == list(range(len(node))):
            return [lists(node[str(i)]) for i in range(len(node))]
        return {k: lists(v) for k, v in node.items()}

    return lists(root)


def leaf(tree: Any, name: str) -> Any:
    for part in name.split("."):
        tree = tree[int(part)] if isinstance(tree, list) else tree[part]
    return tree


# --- bytes read and written, as the operating system counts them ------------------------------

_counter_reads = 0  # bytes that reading /proc/self/io has itself added to rchar


def os_io() -> dict[str, int] | None:
    """This process's I/O counters from Linux's ``/proc/self/io`` (None where there is none).

    ``rchar`` is the bytes passed to read calls, page-cache hits included: what the process asked
    of its files, whether or not the disk was touched. Whatever else the process reads in between
    (a metadata document, the counter file itself) counts too; the counter file's own reads are
    taken off here.
    """
    global _counter_reads
    try:
        raw = Path("/proc/self/io").read_bytes()
    except OSError:
        return None
    fields = {k.decode(): int(v) for k, v in (line.split(b":") for line in raw.splitlines())}
    fields["rchar"] -= _counter_reads
    _counter_reads += len(raw)  # counted by the kernel once this read returns
    return fields


def io_since(before: dict[str, int] | None, field: str) -> int | None:
    after = os_io()
    return None if before is None or after is None else after[field] - before[field]


def mib(n: float | None) -> str:
    if n is None:
        return "n/a"
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


# --- the three phases ---------------------------------------------------------------------------


def _init(rank: int, world: int, init_file: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)


def save_worker(rank: int, world: int, init_file: str, ckpt: str, reports: str, overwrite: bool) -> None:
    _init(rank, world, init_file)
    try:
        mesh = lc.Mesh(SAVE_MESH)
        layout = lc.Layout.from_file(SPEC_FILE, mesh)
        local = {n: piece(layout.spec_for(n), mesh, rank, full_tensor(n)) for n in parameters()}
        state = nest(local)
        result = lc.save(
            ckpt,
            state,
            layout,
            step=STEP,
            metadata=METADATA,
            overwrite=overwrite,
            inner_chunk_bytes=INNER_CHUNK_BYTES,
        )
        report = {
            "held": sum(t.nbytes for t in local.values()),
            "written": result.bytes_written,  # the array bytes of the boxes this rank wrote
            "arrays": result.arrays_written,
            "seconds": result.seconds,
        }
        Path(reports, f"save-{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


def resume_worker(rank: int, world: int, init_file: str, ckpt: str, reports: str) -> None:
    _init(rank, world, init_file)
    try:
        mesh = lc.Mesh(RESUME_MESH)
        layout = lc.Layout(mesh, RESUME_RULES)
        before = os_io()
        future = lc.load_async(ckpt, layout)
        state = future.result()
        read = io_since(before, "rchar")  # root metadata, shard indexes and inner chunks
        mismatches = []
        for name in parameters():
            got, want = leaf(state, name), piece(layout.spec_for(name), mesh, rank, full_tensor(name))
            if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
                mismatches.append(f"{name}: got {got.dtype} {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}")
        shapes = {n: list(leaf(state, n).shape) for n in ("model.embed_tokens.weight", "lm_head.weight")}
        report = {
            "loaded": future.metrics.bytes,  # the array bytes of this rank's boxes
            "read": read,
            "seconds": future.metrics.seconds,
            "mismatches": mismatches,
            "shapes": shapes,
        }
        Path(reports, f"resume-{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


def files_under(root: str) -> tuple[int, int]:
    """(files, bytes) of everything under ``root``: the checkpoint as it sits on disk."""
    sizes = [(Path(d) / f).stat().st_size for d, _, files in os.walk(root) for f in files]
    return len(sizes), sum(sizes)


def spawn(fn: Any, world: int, work: Path, tag: str, *args: Any) -> list[dict[str, Any]]:
    init_file = str(work / f"init-{tag}")
    mp.spawn(fn, args=(world, init_file, *args), nprocs=world, join=True)
    return [json.loads((work / "reports" / f"{tag}-{r}.json").read_text()) for r in range(world)]


def show_save(work: Path, ckpt: str, overwrite: bool, total: int, failures: list[str]) -> dict[str, Any]:
    """[1] Save from 4 ranks; print what each wrote and what the checkpoint takes on disk."""
    save_mesh = lc.Mesh(SAVE_MESH)
    print(f"\n[1] save from {save_mesh.size} ranks, {save_mesh!r}, layout specs/{SPEC_FILE.name} (dp = replicas)")
    t0 = time.perf_counter()
    saves = spawn(save_worker, save_mesh.size, work, "save", ckpt, str(work / "reports"), overwrite)
    seconds = time.perf_counter() - t0
    print("    rank  holds       wrote       arrays  save s")
    for r, s in enumerate(saves):
        print(f"    {r:<4}  {mib(s['held']):<10}  {mib(s['written']):<10}  {s['arrays']:<6}  {s['seconds']:.2f}")
    written = sum(s["written"] for s in saves)
    files, on_disk = files_under(ckpt)
    print(
        f"    total written {mib(written)}: every box once, replicas not repeated "
        f"({'same as' if written == total else 'DIFFERENT FROM'} the model's {mib(total)})"
    )
    print(f"    on disk: {mib(on_disk)} in {files} files (the arrays, plus shard indexes, checksums and metadata)")
    if written != total:
        failures.append(f"bytes written {written} != model size {total}")
    return {"ranks": saves, "written": written, "on_disk": on_disk, "files": files, "seconds": seconds}


def show_slice(ckpt: str, failures: list[str]) -> dict[str, Any]:
    """[2] One plain process: open, inspect, read rows 0:8 of one weight; print the bytes read."""
    assert not dist.is_initialized()
    print("\n[2] read in one plain process (no torch.distributed)")
    t0 = time.perf_counter()
    rd = lc.open(ckpt)
    info = rd.info(SLICE_NAME)
    before = os_io()
    t1 = time.perf_counter()
    rows = rd.read(SLICE_NAME, np.s_[0:8, :])
    t_slice = time.perf_counter() - t1
    read = io_since(before, "rchar")
    seconds = time.perf_counter() - t0
    print(f"    step {rd.step}, metadata {rd.metadata}, {len(rd.keys())} arrays")
    print(
        f"    {SLICE_NAME}: {info.shape} {info.dtype}, saved as {info.spec!r} on {info.saved_mesh!r}, "
        f"inner chunk {info.inner_chunk_shape}"
    )
    want = full_tensor(SLICE_NAME)[0:8].numpy()
    same = rows.shape == want.shape and np.array_equal(rows, want)
    print(
        f"    rows 0:8 -> {rows.shape}: asked {mib(rows.nbytes)}, read {mib(read)} from storage "
        f"(array {mib(info.nbytes)}), {t_slice:.3f} s: " + ("matches the full tensor" if same else "MISMATCH")
    )
    if not same:
        failures.append(f"slice rows 0:8 of {SLICE_NAME} differs from the full tensor")
    if rd.step != STEP or rd.metadata != METADATA:
        failures.append(f"step/metadata read back as {rd.step}/{rd.metadata}")
    return {"name": SLICE_NAME, "asked": rows.nbytes, "read": read, "array": info.nbytes, "seconds": seconds}


def show_resume(work: Path, ckpt: str, arrays: int, failures: list[str]) -> dict[str, Any]:
    """[3] Resume on 3 ranks under another mesh and layout; print what each rank read."""
    resume_mesh = lc.Mesh(RESUME_MESH)
    print(f"\n[3] resume on {resume_mesh.size} ranks, {resume_mesh!r}: row-parallel <-> column-parallel swapped")
    t0 = time.perf_counter()
    resumes = spawn(resume_worker, resume_mesh.size, work, "resume", ckpt, str(work / "reports"))
    seconds = time.perf_counter() - t0
    print("    rank  loaded      read from storage  load s  embed_tokens  lm_head")
    for r, s in enumerate(resumes):
        print(
            f"    {r:<4}  {mib(s['loaded']):<10}  {mib(s['read']):<17}  {s['seconds']:.2f}    "
            f"{s['shapes']['model.embed_tokens.weight']!s:<12}  {s['shapes']['lm_head.weight']}"
        )
        failures += [f"resume rank {r}: {m}" for m in s["mismatches"]]
    if not any(s["mismatches"] for s in resumes):
        print(f"    all {arrays} arrays on every rank equal torch.chunk slices of the full tensors")
    print(
        "    (storage reads are whole inner chunks: tp=3 cuts 256 at 86 and 172, which are not on\n"
        "    the chunk edges, so a rank reads every chunk its range crosses; aligned cuts read no extra)"
    )
    return {"ranks": resumes, "seconds": seconds}


def main(argv: list[str]) -> int:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    parser = argparse.ArgumentParser(
        prog="demo.py",
        description=__doc__.strip().splitlines()[0],
        epilog="Bytes read from storage are Linux's count for the process (rchar in /proc/self/io); n/a elsewhere.",
    )
    parser.add_argument(
        "output_dir",
        nargs="?",
        metavar="OUTPUT_DIR",
        type=Path,
        help="keep the checkpoint in OUTPUT_DIR/ckpt (overwritten if there) and the figures in "
        "OUTPUT_DIR/figures.json; default: a temporary directory, removed at the end",
    )
    args = parser.parse_args(argv)
    t_start = time.perf_counter()
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="layoutckpt-demo-") as scratch:
        work = Path(scratch)
        (work / "reports").mkdir()
        out = args.output_dir.absolute() if args.output_dir else work
        out.mkdir(parents=True, exist_ok=True)
        ckpt = str(out / "ckpt")

        params = parameters()
        total = sum(math.prod(s) * d.itemsize for s, d in params.values())
        print(
            f"layoutckpt demo: Llama-like model, {LAYERS} layers, {len(params)} arrays, {mib(total)} "
            "(float32 attention/embedding/norms, bfloat16 MLP/lm_head)"
        )
        print(f"checkpoint: {ckpt}")
        figures = {
            "model_bytes": total,
            "save": show_save(work, ckpt, args.output_dir is not None, total, failures),
            "slice": show_slice(ckpt, failures),
            "resume": show_resume(work, ckpt, len(params), failures),
        }
        if args.output_dir:
            (out / "figures.json").write_text(json.dumps(figures, indent=1))

    print(
        f"\nseconds: save phase {figures['save']['seconds']:.1f} (4 processes started, incl. imports), plain read "
        f"{figures['slice']['seconds']:.3f}, resume phase {figures['resume']['seconds']:.1f} "
        f"(3 processes started), total {time.perf_counter() - t_start:.1f}"
    )
    if failures:
        print("demo: FAILED")
        for f in failures:
            print(f"  - {f}")
        return 1
    print("demo: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
