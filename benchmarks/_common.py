"""What the benchmarks share: the Llama-like training state, its tensor-parallel rules, and the
small measuring helpers (``/proc`` counters, page-cache eviction, medians).

The benchmarks run as scripts (``python benchmarks/x.py``), so this folder is on ``sys.path`` and
they import this module as ``_common``; spawned ranks inherit that path.
"""

from __future__ import annotations

import ctypes
import math
import os
import re
import shutil
import statistics
import subprocess
import time
from typing import Any

GB = 1e9
MB = 1e6


def leave_world() -> None:
    """End a spawned rank whose results are out: destroy its process groups; the rank then ends
    through the interpreter's shutdown (``tests/support/multirank.leave_world`` says when that
    is safe)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# The state: local shards of a Llama-like model and its optimizer moments.


def model_dims(gb: float) -> dict[str, int]:
    """Llama-like dimensions whose bf16 weights + two fp32 moments come to about ``gb`` GB."""
    params = gb * GB / 10  # 2 bytes (bf16 weight) + 2 x 4 bytes (fp32 exp_avg, exp_avg_sq)
    for hidden in (1024, 512, 256, 128, 64):
        dims = dict(hidden=hidden, inter=round(2.75 * hidden / 64) * 64, kv=hidden // 4, head_dim=64)
        dims["vocab"] = min(32000, 32 * hidden)
        per_layer = layer_params(dims)
        fixed = 2 * dims["vocab"] * hidden + hidden
        if fixed + 4 * per_layer <= params or hidden == 64:
            dims["layers"] = max(1, round((params - fixed) / per_layer))
            return dims
    raise AssertionError("unreachable")


def layer_params(d: dict[str, int]) -> int:
    h = d["hidden"]
    return 2 * h * h + 2 * h * d["kv"] + 3 * h * d["inter"] + 2 * h + 2 * d["head_dim"]


def param_shapes(d: dict[str, int]) -> dict[str, tuple[int, ...]]:
    """Global parameter shapes, Hugging Face names (``nn.Linear`` weights are [out, in])."""
    h, i, kv, hd = d["hidden"], d["inter"], d["kv"], d["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (d["vocab"], h)}
    for layer in range(d["layers"]):
        p = f"model.layers.{layer}"
        shapes.update(
            {
                f"{p}.input_layernorm.weight": (h,),
                f"{p}.self_attn.q_proj.weight": (h, h),
                f"{p}.self_attn.k_proj.weight": (kv, h),
                f"{p}.self_attn.v_proj.weight": (kv, h),
                f"{p}.self_attn.o_proj.weight": (h, h),
                f"{p}.self_attn.q_norm.weight": (hd,),
                f"{p}.self_attn.k_norm.weight": (hd,),
                f"{p}.post_attention_layernorm.weight": (h,),
                f"{p}.mlp.gate_proj.weight": (i, h),
                f"{p}.mlp.up_proj.weight": (i, h),
                f"{p}.mlp.down_proj.weight": (h, i),
            }
        )
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (d["vocab"], h)
    return shapes


# Megatron-style tensor parallelism (the rules of specs/llama_tp.toml, inlined so the benchmarks
# do not change when that file does). Patterns are searched anywhere in the name, so the
# optimizer moments, kept as trees parallel to the model, get the spec of their parameter.
RULES = [
    (r"\.self_attn\.(q|k|v)_proj\.weight$", ("tp", None)),
    (r"\.mlp\.(gate|up)_proj\.weight$", ("tp", None)),
    (r"\.self_attn\.o_proj\.weight$", (None, "tp")),
    (r"\.mlp\.down_proj\.weight$", (None, "tp")),
    (r"(^|\.)(embed_tokens|lm_head)\.weight$", ("tp", None)),
    (r".*", ()),
]

# The same model under the opposite split: column- and row-parallel swapped, the embedding and
# head split by columns. Loading a RULES checkpoint under these rules moves every sharded byte.
SWAPPED_RULES = [
    (r"\.self_attn\.(q|k|v)_proj\.weight$", (None, "tp")),
    (r"\.mlp\.(gate|up)_proj\.weight$", (None, "tp")),
    (r"\.self_attn\.o_proj\.weight$", ("tp", None)),
    (r"\.mlp\.down_proj\.weight$", ("tp", None)),
    (r"(^|\.)(embed_tokens|lm_head)\.weight$", (None, "tp")),
    (r".*", ()),
]


def spec_of(name: str, rules: list[tuple[str, tuple[Any, ...]]] = RULES) -> tuple[Any, ...]:
    return next(spec for pattern, spec in rules if re.search(pattern, name))


def chunk_range(n: int, k: int, i: int) -> tuple[int, int]:
    """The ``i``-th of ``k`` pieces of ``range(n)`` as ``torch.chunk`` cuts it."""
    piece = -(-n // k)
    start = min(i * piece, n)
    return start, min(start + piece, n)


def local_shape(shape: tuple[int, ...], spec: tuple[Any, ...], tp: int, rank: int) -> tuple[int, ...]:
    out = []
    for d, n in enumerate(shape):
        split = d < len(spec) and spec[d] == "tp"
        a, b = chunk_range(n, tp, rank) if split else (0, n)
        out.append(b - a)
    return tuple(out)


def leaves(dims: dict[str, int]) -> dict[str, tuple[tuple[int, ...], Any]]:
    """Every leaf of the training state: flat name -> (global shape, torch dtype)."""
    import torch

    out: dict[str, tuple[tuple[int, ...], Any]] = {}
    for prefix, dtype in (
        ("model", torch.bfloat16),
        ("optim.exp_avg", torch.float32),
        ("optim.exp_avg_sq", torch.float32),
    ):
        for name, shape in param_shapes(dims).items():
            out[name if prefix == "model" else f"{prefix}.{name}"] = (shape, dtype)
    out["optim.step"] = ((1,), torch.int64)
    return out


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": {"c": x}}}`` -> ``{"a.b.c": x}`` (``nest`` undoes it)."""
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"a.b.c": x}`` -> ``{"a": {"b": {"c": x}}}``."""
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        node = nested
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return nested


def build_state(
    dims: dict[str, int], tp: int, rank: int, device: Any = "cpu"
) -> tuple[dict[str, Any], dict[str, Any], dict[str, int]]:
    """This rank's nested state for layoutckpt, a flat ``{name: tensor}`` of the same tensors,
    and the rank's bytes: all local, and those of sharded leaves only."""
    import torch

    own = torch.Generator().manual_seed(1234 + rank)  # shards differ from rank to rank
    shared = torch.Generator().manual_seed(1234)  # replicas are equal on every rank
    flat: dict[str, Any] = {}
    sharded = 0
    for key, (shape, dtype) in leaves(dims).items():
        spec = spec_of(key)
        if key == "optim.step":
            t = torch.tensor([1000], dtype=dtype)
        else:
            t = torch.empty(local_shape(shape, spec, tp, rank), dtype=dtype)
            t.uniform_(-0.02, 0.02, generator=own if spec else shared)  # touches every page
        flat[key] = t.to(device)
        if spec:
            sharded += t.numel() * t.element_size()
    local = sum(t.numel() * t.element_size() for t in flat.values())
    return nest(flat), flat, {"local": local, "sharded": sharded}


# ---------------------------------------------------------------------------------------------
# Measuring: /proc counters, the page cache, summaries.


def proc_io() -> dict[str, int]:
    """This process's I/O counters (all threads): ``rchar`` counts bytes returned by read
    syscalls, page-cache hits included; ``read_bytes`` counts bytes fetched from storage."""
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            key, value = line.split(":", 1)
            out[key] = int(value)
    return out


def reset_peak_rss() -> int:
    """Reset ``VmHWM`` to the current RSS (``clear_refs`` 5, no root needed); the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_bytes("VmRSS")


def status_bytes(key: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmHWM``, ``VmRSS``) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def release_memory(full: bool = False) -> None:
    """Collect garbage and hand freed heap back to the OS, so the next RSS baseline is honest.
    A full collection walks torch's whole object graph (~0.1 s); the young generations are
    where a just-dropped result's cycles are, if any."""
    import gc

    gc.collect(2 if full else 1)
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class GcClock:
    """The garbage collector's runs while the block is open (any thread of this process): their
    count, how many were full (generation 2) and their seconds. Every system of the harness runs
    in the same processes, so one system's objects lengthen the collections in another's row."""

    def __enter__(self) -> GcClock:
        import gc

        self.runs = self.full = 0
        self.seconds = 0.0
        self._start = 0.0
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        import gc

        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        self.runs += 1
        self.full += info["generation"] == 2
        self.seconds += time.perf_counter() - self._start

    def totals(self) -> dict[str, float]:
        return {"gc_runs": self.runs, "gc_full": self.full, "gc_seconds": self.seconds}


def files_under(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    out = []
    for dirpath, _, names in os.walk(path):
        out.extend(os.path.join(dirpath, n) for n in names)
    return out


def evict(path: str) -> int:
    """Drop every file under ``path`` from the page cache (fsync first: only clean pages go);
    works without root. Returns the number of files."""
    files = files_under(path)
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return len(files)


def resident_fraction(path: str) -> float | None:
    """The fraction of ``path``'s pages in the page cache (``mincore``), or None if unavailable."""
    import mmap

    size = os.path.getsize(path)
    if size == 0:
        return None
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        page = mmap.PAGESIZE
        pages = (size + page - 1) // page
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)  # private: mincore still sees the file pages
        try:
            buf = (ctypes.c_char * size).from_buffer(mm)
            vec = (ctypes.c_ubyte * pages)()
            rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(buf)), ctypes.c_size_t(size), vec)
            del buf
        finally:
            mm.close()
        if rc != 0:
            return None
        return sum(v & 1 for v in vec) / pages
    except (OSError, AttributeError, ValueError, BufferError):
        return None


def check_eviction(directory: str, nbytes: int = 32 << 20) -> dict[str, Any]:
    """Write, fsync, evict and re-read a file: does ``POSIX_FADV_DONTNEED`` empty the cache here?"""
    path = os.path.join(directory, "evict-check.bin")
    with open(path, "wb") as f:
        f.write(os.urandom(nbytes))
        f.flush()
        os.fsync(f.fileno())
    try:
        before = resident_fraction(path)
        evict(path)
        after = resident_fraction(path)
        io0 = proc_io()
        t0 = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while f.read(8 << 20):
                pass
        cold_s = time.perf_counter() - t0
        storage = proc_io()["read_bytes"] - io0["read_bytes"]
        t0 = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while f.read(8 << 20):
                pass
        warm_s = time.perf_counter() - t0
    finally:
        os.remove(path)
    works = storage >= 0.9 * nbytes or (after is not None and after < 0.1)
    return {
        "bytes": nbytes,
        "resident_before": before,
        "resident_after_evict": after,
        "read_bytes_after_evict": storage,
        "cold_read_s": cold_s,
        "warm_read_s": warm_s,
        "works": works,
    }


def meminfo() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                if key in ("MemTotal", "MemAvailable", "Cached", "Dirty", "Writeback"):
                    out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def filesystem_of(path: str) -> dict[str, str]:
    """The ``/proc/mounts`` entry (device, mount point, type, options) that holds ``path``."""
    path = os.path.realpath(path)
    best: dict[str, str] = {}
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype, options, *_ = line.split()
                inside = path == mnt or path.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best.get("mount", "")):
                    best = {"device": dev, "mount": mnt, "type": fstype, "options": options}
    except OSError:
        pass
    return best


def ext4_journal(fs: dict[str, str]) -> bool | None:
    """Whether the ext4 file system ``fs`` (a ``filesystem_of`` entry) keeps a journal: jbd2
    lists each journal it runs under ``/proc/fs/jbd2`` as ``<device>-8``. None for other types
    or where that cannot be read."""
    if fs.get("type") != "ext4":
        return None
    try:
        journals = os.listdir("/proc/fs/jbd2")
    except OSError:
        return None
    device = os.path.basename(os.path.realpath(fs.get("device", "")))
    return any(j.rsplit("-", 1)[0] == device for j in journals)


def free_output(path: str, *, delete: bool) -> None:
    """Free the space of a benchmark output: delete it, or (``delete`` False) truncate its files
    and leave them for the end of the run; then flush that, so no timed write pays for it.

    Truncating frees the data as a deletion would, but no inode: on ext4 without a journal (``ext4_journal``
    False) a new inode is not taken from those freed in the last minute, or the last six while their
    inode table block is dirty, which every new file in the same block group makes it (fs/ext4/ialloc.c,
    ``recently_deleted``), and finding that out costs a buffer-cache lookup for each freed inode the
    allocator passes. Writes that follow the deletion of thousands of files would pay for them, the
    writer of most files most (docs/performance.md, "Deleting right before saving").
    """
    if delete:
        shutil.rmtree(path, ignore_errors=True)
    else:
        for dirpath, _, names in os.walk(path):
            for name in names:
                os.truncate(os.path.join(dirpath, name), 0)
    os.sync()


def dd(path: str, nbytes: int) -> dict[str, Any]:
    bs = 16 << 20
    count = max(1, math.ceil(nbytes / bs))
    cmd = ["dd", "if=/dev/zero", f"of={path}", f"bs={bs}", f"count={count}", "conv=fsync"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - t0
    os.remove(path)
    return {
        "cmd": " ".join(cmd),
        "bytes": bs * count,
        "total": seconds,
        "report": proc.stderr.strip().splitlines()[-1:],
    }


def stats(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}
