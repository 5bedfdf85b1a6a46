"""layoutckpt against its peers and the physical limits, side by side, in one run.

    .venv/bin/python benchmarks/bench.py [--gb 2.0] [--ranks 1,2,4] [--repeats 3] [--warmup 1] [--dir DIR]
                                         [--json out.json] [--plot out.png] [--quick] [--only ...]

For each world size N in ``--ranks``, N local gloo ranks (spawned processes) hold a training-like
state of about ``--gb`` GB in total -- a Llama-like model in bfloat16 plus two float32 AdamW
moments, sharded tensor-parallel over ``tp = N`` -- and every system saves and loads that same
state: layoutckpt (``save``, ``save_async``, ``load`` under the same and a swapped layout, and
single-process partial reads), ``torch.save``/``torch.load`` (one file per rank), PyTorch DCP
(``save``, ``async_save``, same-layout and resharded ``load`` of DTensors), and safetensors (one
process, rank 0's tensors), and ByteCheckpoint where it imports. Loads run into fresh tensors and,
apart, in place into tensors made once (layoutckpt ``inplace=True``, DCP, ByteCheckpoint). Beside
them run the physical limits on the same bytes: a raw write + fsync, a raw read, and a memory copy
of the local state. Under each table: bytes written per rank (max/mean) and data files, for the
state and for one replicated 128 MiB tensor.

Every operation runs on all ranks at once after a barrier (rank-0-only rows on rank 0 alone); the
time of a repeat is the slowest rank's, and each row shows the median over ``--repeats`` and the
min-max spread; ``--warmup`` untimed rounds of the writes come first. Reads run cold (the files evicted from the page cache first) and then warm.
``docs/performance.md`` says what every row and column means.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from _common import (
    GB,
    RULES,
    SWAPPED_RULES,
    GcClock,
    build_state,
    check_eviction,
    evict,
    ext4_journal,
    files_under,
    filesystem_of,
    flatten,
    free_output,
    leave_world,
    leaves,
    local_shape,
    meminfo,
    model_dims,
    nest,
    proc_io,
    release_memory,
    reset_peak_rss,
    spec_of,
    stats,
    status_bytes,
)

PARTIAL_TENSOR = "model.embed_tokens.weight"  # the largest model weight; vocab-parallel, P("tp", None)
PARTIAL_ROWS = 8  # rows 0:8 of it, which live in rank 0's shard
PARTIAL_READS = ("lc_read_tensor", "torch_load_whole", "torch_mmap_tensor", "lc_read_rows", "torch_mmap_rows")
QUICK_DIMS = dict(hidden=128, inter=384, kv=32, head_dim=64, vocab=4096, layers=2)
RSS_SLACK = 300e6  # the fixed part of the load-RSS target
# Files written at once, over all ranks, by the parallel raw write: this disk's write rate rises
# from one stream to two (1.6 to 1.9 GB/s, 1 GB fsync'd) and barely beyond (2.0-2.1 at eight).
MACHINE_STREAMS = 8
# One replicated tensor saved from every rank (issue 26): who writes its bytes.
REPLICATED_BYTES = 128 << 20

# A measurement: what it belongs to (for --only), which system's files it needs, and whether it
# runs on rank 0 alone (no collectives).
MEASUREMENTS: dict[str, dict[str, Any]] = {
    # written once per repeat, the state in memory
    "memcpy": dict(group="async", system="limit"),
    "raw_write": dict(group="save", system="limit"),
    "raw_write_streams": dict(group="save", system="limit"),
    "lc_save": dict(group="save", system="lc"),
    "lc_async": dict(group="async", system="lc"),
    "torch_save": dict(group="save", system="torch"),
    "dcp_save": dict(group="save", system="dcp"),
    "dcp_async": dict(group="async", system="dcp"),
    "st_save": dict(group="save", system="safetensors", rank0=True),
    "orbax_save": dict(group="save", system="orbax", rank0=True),
    "bcp_save": dict(group="save", system="bcp"),
    # read cold, then warm, with the state dropped
    "raw_read": dict(group="load", system="limit", needs="raw_write", files="raw"),
    "lc_load": dict(group="load", system="lc", needs="lc_save", files="lc"),
    "torch_load": dict(group="load", system="torch", needs="torch_save", files="torch"),
    "dcp_load": dict(group="load", system="dcp", needs="dcp_save", files="dcp"),
    "st_load": dict(group="load", system="safetensors", needs="st_save", files="st", rank0=True),
    "orbax_load": dict(group="load", system="orbax", needs="orbax_save", files="orbax", rank0=True),
    "lc_reshard": dict(group="reshard", system="lc", needs="lc_save", files="lc"),
    "dcp_reshard": dict(group="reshard", system="dcp", needs="dcp_save", files="dcp"),
    # in place: into tensors made (and touched) once, before the reads, as a training job
    # resumes into its model and optimizer; ``memcpy_load`` copies the same bytes between such
    # tensors, ``raw_read_into`` reads the raw files into such a buffer (no files to evict),
    # ``checked_read_into`` also checks each piece's crc32c and copies it into the tensors
    "memcpy_load": dict(group="load", system="limit", needs="raw_write", files=None),
    "raw_read_into": dict(group="load", system="limit", needs="raw_write", files="raw"),
    "checked_read_into": dict(group="load", system="limit", needs="raw_write", files="raw"),
    "lc_load_inplace": dict(group="load", system="lc", needs="lc_save", files="lc"),
    "dcp_load_inplace": dict(group="load", system="dcp", needs="dcp_save", files="dcp"),
    "bcp_load": dict(group="load", system="bcp", needs="bcp_save", files="bcp"),
    "lc_reshard_inplace": dict(group="reshard", system="lc", needs="lc_save", files="lc"),
    "dcp_reshard_inplace": dict(group="reshard", system="dcp", needs="dcp_save", files="dcp"),
    "bcp_reshard": dict(group="reshard", system="bcp", needs="bcp_save", files="bcp"),
    "raw_read_tensor": dict(group="partial", system="limit", needs="raw_write", files="raw", rank0=True),
    "lc_read_tensor": dict(group="partial", system="lc", needs="lc_save", files="lc", rank0=True),
    "torch_load_whole": dict(group="partial", system="torch", needs="torch_save", files="torch", rank0=True),
    "torch_mmap_tensor": dict(group="partial", system="torch", needs="torch_save", files="torch", rank0=True),
    "raw_read_rows": dict(group="partial", system="limit", needs="raw_write", files="raw", rank0=True),
    "lc_read_rows": dict(group="partial", system="lc", needs="lc_save", files="lc", rank0=True),
    "torch_mmap_rows": dict(group="partial", system="torch", needs="torch_save", files="torch", rank0=True),
}
WRITES = [k for k, m in MEASUREMENTS.items() if "files" not in m]
CHECKED_READ = "checked read into the tensors"
# The pieces of the checked read: the largest read layoutckpt's shard reader makes from a warm
# file (``_shardread.CACHED_RUN_BYTES``), small enough to stay in the cache between the read,
# the checksum and the copy.
CHECKED_PIECE = 2 << 20
READS = [k for k, m in MEASUREMENTS.items() if "files" in m]
GROUPS = sorted({m["group"] for m in MEASUREMENTS.values()})
SYSTEMS = sorted({m["system"] for m in MEASUREMENTS.values()} - {"limit"})

# The table: (operation, system, measurement, metric, bytes, role). Read rows appear once per
# cache state. ``bytes`` names the logical bytes of the operation (the same for every system of
# an operation, so GB/s compare); ``role`` is limit, lc or peer.
WRITE_ROWS = [
    ("save", "raw write+fsync", "raw_write", "seconds", "local", "limit"),
    ("save", f"raw write+fsync, {MACHINE_STREAMS} streams", "raw_write_streams", "seconds", "local", "limit"),
    ("save", "layoutckpt save", "lc_save", "seconds", "local", "lc"),
    ("save", "torch.save+fsync", "torch_save", "seconds", "local", "peer"),
    ("save", "DCP save", "dcp_save", "seconds", "local", "peer"),
    ("save", "safetensors save_file+fsync (rank 0)", "st_save", "seconds", "local0", "peer"),
    ("save", "Orbax save (rank 0)", "orbax_save", "seconds", "local0", "peer"),
    ("save", "ByteCheckpoint save", "bcp_save", "seconds", "local", "peer"),
    ("save_async blocked", "memcpy (staging bound)", "memcpy", "seconds", "local", "limit"),
    ("save_async blocked", "layoutckpt save_async", "lc_async", "blocked", "local", "lc"),
    ("save_async blocked", "DCP async_save", "dcp_async", "blocked", "local", "peer"),
    ("save_async commit", "raw write+fsync", "raw_write", "seconds", "local", "limit"),
    ("save_async commit", "layoutckpt save_async", "lc_async", "seconds", "local", "lc"),
    ("save_async commit", "DCP async_save", "dcp_async", "seconds", "local", "peer"),
]
READ_ROWS = [
    ("load", "raw read", "raw_read", "local", "limit"),
    ("load", "layoutckpt load", "lc_load", "local", "lc"),
    ("load", "torch.load", "torch_load", "local", "peer"),
    ("load", "DCP load", "dcp_load", "local", "peer"),
    ("load", "safetensors load_file (rank 0)", "st_load", "local0", "peer"),
    ("load", "Orbax restore (rank 0)", "orbax_load", "local0", "peer"),
    ("load resharded", "raw read", "raw_read", "local", "limit"),
    ("load resharded", "layoutckpt load", "lc_reshard", "reshard", "lc"),
    ("load resharded", "DCP load", "dcp_reshard", "reshard", "peer"),
    ("load in place", "memcpy", "memcpy_load", "local", "limit"),
    ("load in place", "raw read into a buffer", "raw_read_into", "local", "limit"),
    ("load in place", CHECKED_READ, "checked_read_into", "local", "limit"),
    ("load in place", "layoutckpt load(inplace=True)", "lc_load_inplace", "local", "lc"),
    ("load in place", "DCP load", "dcp_load_inplace", "local", "peer"),
    ("load in place", "ByteCheckpoint load", "bcp_load", "local", "peer"),
    ("load resharded in place", "memcpy", "memcpy_load", "local", "limit"),
    ("load resharded in place", "raw read into a buffer", "raw_read_into", "local", "limit"),
    ("load resharded in place", CHECKED_READ, "checked_read_into", "local", "limit"),
    ("load resharded in place", "layoutckpt load(inplace=True)", "lc_reshard_inplace", "reshard", "lc"),
    ("load resharded in place", "DCP load", "dcp_reshard_inplace", "reshard", "peer"),
    ("load resharded in place", "ByteCheckpoint load", "bcp_reshard", "reshard", "peer"),
    ("read 1 tensor (rank 0)", "raw read", "raw_read_tensor", "tensor", "limit"),
    ("read 1 tensor (rank 0)", "layoutckpt open().read", "lc_read_tensor", "tensor", "lc"),
    ("read 1 tensor (rank 0)", "torch.load whole ckpt", "torch_load_whole", "tensor", "peer"),
    ("read 1 tensor (rank 0)", "torch.load(mmap=True)", "torch_mmap_tensor", "tensor", "peer"),
    (f"read {PARTIAL_ROWS} rows (rank 0)", "raw read", "raw_read_rows", "rows", "limit"),
    (f"read {PARTIAL_ROWS} rows (rank 0)", "layoutckpt open().read", "lc_read_rows", "rows", "lc"),
    (f"read {PARTIAL_ROWS} rows (rank 0)", "torch.load whole ckpt", "torch_load_whole", "rows", "peer"),
    (f"read {PARTIAL_ROWS} rows (rank 0)", "torch.load(mmap=True)", "torch_mmap_rows", "rows", "peer"),
]


def table_rows() -> list[dict[str, Any]]:
    """Every row of one world size's table, in print order."""
    rows = [
        dict(op=op, system=s, cache=None, meas=m, metric=metric, bytes=b, role=role)
        for op, s, m, metric, b, role in WRITE_ROWS
    ]
    for op, s, m, b, role in READ_ROWS:
        for cache in ("cold", "warm"):
            rows.append(dict(op=op, system=s, cache=cache, meas=f"{m}.{cache}", metric="seconds", bytes=b, role=role))
    return rows


def select(only: str | None) -> list[str]:
    """The measurements ``--only`` asks for (operation groups and/or systems), with the writes
    the chosen reads need. Physical limits run with their groups."""
    if not only:
        return list(MEASUREMENTS)
    words = {w.strip() for w in only.split(",") if w.strip()}
    unknown = words - set(GROUPS) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"--only: unknown {sorted(unknown)}; groups {GROUPS}, systems {SYSTEMS}")
    groups = words & set(GROUPS) or set(GROUPS)
    systems = (words & set(SYSTEMS) or set(SYSTEMS)) | {"limit"}
    # The load group's limits (raw read, memcpy, checked read) bound the resharded rows too.
    limited = groups | ({"load"} if "reshard" in groups else set())
    chosen = {k for k, m in MEASUREMENTS.items() if m["group"] in groups and m["system"] in systems}
    chosen |= {k for k, m in MEASUREMENTS.items() if m["system"] == "limit" and m["group"] in limited}
    chosen |= {MEASUREMENTS[k]["needs"] for k in chosen if "needs" in MEASUREMENTS[k]}
    return [k for k in MEASUREMENTS if k in chosen]


# ---------------------------------------------------------------------------------------------
# One rank.


def _as_torch(value: Any) -> Any:
    """A read's result as a CPU tensor (a NumPy array, bfloat16 too, or a tensor)."""
    import numpy as np

    from layoutckpt.torch._tensors import from_numpy

    return from_numpy(value, str(value.dtype)) if isinstance(value, np.ndarray) else value


def digest(flat: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], int]]:
    """Per tensor, its shape and the crc32 of its bytes: equal digests, equal tensors."""
    import zlib

    import torch

    out = {}
    for k, t in flat.items():
        t = torch.as_tensor(getattr(t, "_local_tensor", t)).cpu().contiguous()  # a DTensor's shard
        out[k] = (tuple(t.shape), zlib.crc32(memoryview(t.reshape(-1).view(torch.uint8).numpy())))
    return out


class _Rank:
    def __init__(self, rank: int, world: int, opts: dict[str, Any]) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        import layoutckpt as lc

        self.rank, self.world, self.opts = rank, world, opts
        self.torch, self.dist, self.lc = torch, dist, lc
        self.work = opts["workdir"]
        self.retired = os.path.join(self.work, "retired")
        self.n_retired = 0
        self.dims = opts["dims"]
        cuda = torch.cuda.is_available()
        self.device = torch.device(f"cuda:{rank % torch.cuda.device_count()}") if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(self.device)
        # DCP runs collectives on a background thread during async_save: a group of its own.
        self.dcp_group = dist.new_group(backend="gloo")
        self.mesh = lc.Mesh({"tp": world})
        self.layout = lc.Layout(self.mesh, [(pat, lc.P(*spec)) for pat, spec in RULES])
        self.swapped = lc.Layout(self.mesh, [(pat, lc.P(*spec)) for pat, spec in SWAPPED_RULES])
        # DCP reshards DTensors only: its state is the same local tensors as DTensors on a mesh
        # with the matching Shard placements (the loads use a CPU mesh: every system loads to host).
        self.dmesh = init_device_mesh(self.device.type, (world,), mesh_dim_names=("tp",))
        self.cpu_mesh = self.dmesh if not cuda else init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        self.leaves = leaves(self.dims)
        self.state, self.flat, self.nbytes = build_state(self.dims, world, rank, self.device)
        self.dcp_state = {k: self.dtensor(t, k, RULES, self.dmesh) for k, t in self.flat.items()}
        self.memcpy_dsts: list[Any] | None = None  # the memcpy's destinations, kept like a staging pool
        self.paths = {
            name: os.path.join(self.work, name)
            for name in ("raw", "raw_streams", "lc", "lc_async", "torch", "dcp", "dcp_async", "st", "orbax", "bcp")
        }
        self.need = {
            "local": self.nbytes["local"],
            "local0": self.nbytes["local"] if rank == 0 else 0,
            "reshard": self.local_bytes(SWAPPED_RULES),
        }
        self.digests: dict[str, dict[str, Any]] = {"state": digest(self.flat)}
        local = self.flat[PARTIAL_TENSOR]
        self.digests["rows"] = digest({PARTIAL_TENSOR: getattr(local, "_local_tensor", local)[:PARTIAL_ROWS]})
        self.written: dict[str, int] = {}  # bytes this rank wrote in the last save, per system
        self.inplace: dict[str, dict[str, Any]] = {}  # the in-place loads' destinations, per layout

    # --- helpers ----------------------------------------------------------------------------

    def placements(self, spec: tuple[Any, ...]) -> list[Any]:
        from torch.distributed.tensor import Replicate, Shard

        return [Shard(spec.index("tp"))] if "tp" in spec else [Replicate()]

    def dtensor(self, local: Any, name: str, rules: Any, mesh: Any) -> Any:
        from torch.distributed.tensor import DTensor

        shape, _ = self.leaves[name]
        stride = [1] * len(shape)
        for d in range(len(shape) - 2, -1, -1):
            stride[d] = stride[d + 1] * shape[d + 1]
        placements = self.placements(spec_of(name, rules))
        return DTensor.from_local(
            local, mesh, placements, run_check=False, shape=self.torch.Size(shape), stride=tuple(stride)
        )

    def local_bytes(self, rules: Any) -> int:
        total = 0
        for name, (shape, dtype) in self.leaves.items():
            n = 1
            for s in local_shape(shape, spec_of(name, rules), self.world, self.rank):
                n *= s
            total += n * dtype.itemsize
        return total

    def barrier(self) -> None:
        self.dist.barrier()

    def clean(self, path: str) -> None:
        """Clear ``path`` for the next write (rank 0), outside any timed region.

        By default the old output is moved aside and evicted from the page cache, not deleted:
        ext4 passes over the inodes freed in the last minute or more each time it allocates
        one, so a write right after deleting thousands of files pays for them, the more files
        it makes the more (a 4-rank layoutckpt save of 2 GB: 25 % slower, docs/performance.md).
        A training loop saves minutes apart. The eviction hands the output's pages back as a
        deletion would, so the next write finds memory in the same state either way (on this
        virtual machine, writing into pages just freed is several times faster than into
        pages the page cache has to grow into). Where ``--dir`` has no room to keep every
        output (``truncate_aside``), the files moved aside are truncated at once: their space
        is freed, their inodes are not. ``--delete-between`` deletes each output here instead,
        right before the next write: saves seconds apart with a retention policy.
        """
        self.barrier()
        if self.rank == 0 and os.path.exists(path):
            if self.opts["delete_between"]:
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.makedirs(self.retired, exist_ok=True)
                aside = os.path.join(self.retired, str(self.n_retired))
                self.n_retired += 1
                os.rename(path, aside)
                if self.opts["truncate_aside"]:
                    free_output(aside, delete=False)  # drops its pages too
                else:
                    evict(aside)
            os.sync()  # flush the deletion now, not in the next write
        self.barrier()

    def purge(self) -> None:
        """Free every output moved aside (rank 0), after the writes and before the reads.

        Their files are truncated, not deleted (``free_output``): the next world size's writes
        would otherwise follow the deletion of tens of thousands of files, which on ext4 without a
        journal makes every file created in the next minutes pay for them. ``main`` deletes it all
        at the end of the run. With ``--delete-between`` every output is deleted, as that mode
        measures.
        """
        self.barrier()
        if self.rank == 0:
            free_output(self.retired, delete=self.opts["delete_between"])
        self.barrier()

    def evict(self, name: str) -> None:
        self.barrier()
        if self.rank == 0:
            evict(self.paths[name])
        self.barrier()

    def measure(self, fn: Callable[[], Any], *, rank0: bool = False) -> dict[str, Any] | None:
        """Time ``fn`` after a barrier, with this rank's I/O counters and peak RSS over it."""
        release_memory()
        self.barrier()
        if rank0 and self.rank != 0:
            return None
        rss0 = reset_peak_rss()
        io0 = proc_io()
        with GcClock() as gc_clock:
            t0 = time.perf_counter()
            out = fn()
            seconds = time.perf_counter() - t0
        io1 = proc_io()
        rec = {
            "seconds": seconds,
            "rchar": io1["rchar"] - io0["rchar"],
            "read_bytes": io1["read_bytes"] - io0["read_bytes"],
            "hwm": status_bytes("VmHWM"),
            "rss0": rss0,
            **gc_clock.totals(),
        }
        if isinstance(out, dict) and "_timings" in out:
            rec.update(out["_timings"])
        return rec

    # --- writes (the state in memory) -------------------------------------------------------

    def memcpy(self) -> Any:
        torch = self.torch
        pinned = self.device.type == "cuda"
        if self.memcpy_dsts is None:
            # Made and touched once (in the warm-up round), then reused by every repeat, as
            # save_async's staging buffers are. Made afresh and touched right before each copy,
            # they made the bound faster than any reuse can be on a virtual machine whose host
            # reclaims guest memory left idle: 2 GB copied into buffers idle for 40 s took
            # 0.16-0.18 s, into buffers just touched 0.12-0.13 s (docs/performance.md).
            self.memcpy_dsts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned) for t in self.flat.values()]
            for d in self.memcpy_dsts:
                d.zero_()
        dsts = self.memcpy_dsts

        def run() -> None:
            for d, t in zip(dsts, self.flat.values()):
                d.copy_(t)
            if pinned:
                torch.cuda.synchronize()

        return run

    def state_bytes(self) -> Iterator[memoryview]:
        """Every local tensor's bytes, in order, as the raw writes write them (a GPU tensor's
        copied to the host as it comes)."""
        for t in self.flat.values():
            yield memoryview(t.cpu().reshape(-1).view(self.torch.uint8).numpy())

    def raw_write(self) -> None:
        with open(self.raw_file, "wb", buffering=0) as f:
            for view in self.state_bytes():
                _write_all(f, view)
            os.fsync(f.fileno())

    def raw_write_streams(self) -> None:
        """The same bytes as ``raw_write``, cut into ``MACHINE_STREAMS / N`` files of about
        equal size, each written and fsync'd by its own thread: the disk's parallel peak."""
        views = list(self.state_bytes())
        streams = max(1, MACHINE_STREAMS // self.world)
        share = -(-sum(len(v) for v in views) // streams)
        parts: list[list[memoryview]] = [[]]
        room = share
        for v in views:
            while len(v):
                if room == 0:
                    parts.append([])
                    room = share
                piece, v = v[:room], v[room:]
                parts[-1].append(piece)
                room -= len(piece)

        def write(i: int, pieces: list[memoryview]) -> None:
            with open(os.path.join(self.paths["raw_streams"], f"rank{self.rank}.{i}.bin"), "wb", buffering=0) as f:
                for piece in pieces:
                    _write_all(f, piece)
                os.fsync(f.fileno())

        with ThreadPoolExecutor(streams) as threads:
            for done in [threads.submit(write, i, pieces) for i, pieces in enumerate(parts)]:
                done.result()

    def lc_save(self) -> dict[str, Any]:
        res = self.lc.save(self.paths["lc"], self.state, self.layout, packing=self.opts["packing"])
        return {"_timings": {**_phases(res), "bytes_written": res.metrics.bytes}}

    def bcp_save(self) -> None:
        """ByteCheckpoint's save of the DTensor state (``FSDP2Checkpointer``'s model path, called
        below its public ``save``, which refuses torch > 2.5 by version number alone)."""
        from bytecheckpoint.checkpointer.fsdp2_checkpointer import FSDP2Checkpointer
        from bytecheckpoint.planner.fsdp.fsdp_planner import FSDPSavePlanner
        from bytecheckpoint.storage import CKPTCounter

        path = self.paths["bcp"]
        FSDP2Checkpointer._save_model(
            model_path=path,
            model_state=self.dcp_state,
            framework_name="fsdp2",
            role=None,
            save_planner=FSDPSavePlanner(),
            ckpt_path=path,
            save_ckpt_start_time=time.time(),
            ckpt_counter=CKPTCounter(1, False),
            global_steps=None,
            fast_saving=False,
            callback=None,
        )

    def bcp_into(self, layout: str) -> None:
        """ByteCheckpoint's load into the DTensors of ``self.inplace[layout]`` (it always loads in place)."""
        from bytecheckpoint.checkpointer.fsdp2_checkpointer import FSDP2Checkpointer
        from bytecheckpoint.planner.fsdp.fsdp_planner import FSDPLoadPlanner

        FSDP2Checkpointer._load_model(
            model_path=self.paths["bcp"],
            model_state=self.inplace[layout]["dtensors"],
            framework_name="fsdp2",
            role=None,
            load_planner=FSDPLoadPlanner(strict=True),
            fast_loading=True,
        )
        return self.inplace[layout]["dtensors"]

    def lc_async(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        fut = self.lc.save_async(self.paths["lc_async"], self.state, self.layout, packing=self.opts["packing"])
        blocked = time.perf_counter() - t0
        res = fut.result()
        return {"_timings": {"blocked": blocked, "blocked_seconds": res.blocked_seconds, **_phases(res)}}

    def torch_save(self) -> None:
        with open(os.path.join(self.paths["torch"], f"rank{self.rank}.pt"), "wb") as f:
            self.torch.save(self.flat, f)
            f.flush()
            os.fsync(f.fileno())

    def dcp_save(self) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self.dcp_state, checkpoint_id=self.paths["dcp"], process_group=self.dcp_group)

    def dcp_async(self) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        fut = dcp.async_save(self.dcp_state, checkpoint_id=self.paths["dcp_async"], process_group=self.dcp_group)
        blocked = time.perf_counter() - t0
        fut.result()
        return {"_timings": {"blocked": blocked}}

    def st_save(self) -> None:
        from safetensors.torch import save_file

        path = os.path.join(self.paths["st"], "rank0.safetensors")
        save_file(self.flat, path)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def orbax_save(self) -> Callable[[], None]:
        """The state as jax.Arrays, what an Orbax user holds (untimed, rank 0 only); returns the
        timed save: ``StandardCheckpointer.save`` until its background commit is done."""
        if self.rank != 0:
            return lambda: None
        import jax
        import orbax.checkpoint as ocp

        from layoutckpt.torch._tensors import to_numpy

        jax.config.update("jax_enable_x64", True)  # int64 steps stay int64, as in the other systems
        state = {k: jax.device_put(to_numpy(v)) for k, v in self.flat.items()}
        jax.block_until_ready(state)
        checkpointer = ocp.StandardCheckpointer()
        path = os.path.abspath(self.paths["orbax"])

        def save() -> None:
            checkpointer.save(path, state)
            checkpointer.wait_until_finished()

        return save

    # --- reads (the state dropped) ----------------------------------------------------------

    @property
    def raw_file(self) -> str:
        """This rank's file of the raw write, which the raw and checked reads read back."""
        return os.path.join(self.paths["raw"], f"rank{self.rank}.bin")

    def raw_read(self, nbytes: int | None = None) -> Any:
        path = self.raw_file
        nbytes = min(os.path.getsize(path), nbytes if nbytes is not None else self.nbytes["local"])
        buf = self.torch.empty(nbytes, dtype=self.torch.uint8)
        view = memoryview(buf.numpy())
        piece = 64 << 20
        with open(path, "rb", buffering=0) as f:
            for a in range(0, nbytes, piece):
                f.readinto(view[a : a + piece])
        return buf

    def lc_load(self) -> Any:
        return self.lc.load(self.paths["lc"], self.layout)

    def make_inplace(self) -> None:
        """The in-place loads' destinations, made and touched once, before the reads: for each
        layout one set of local tensors, seen by layoutckpt as its nested state and by DCP and
        ByteCheckpoint as DTensors over the same memory; and the memcpy's source and target."""
        torch = self.torch
        for key, rules in (("same", RULES), ("swapped", SWAPPED_RULES)):
            flat = {
                name: torch.zeros(local_shape(shape, spec_of(name, rules), self.world, self.rank), dtype=dtype)
                for name, (shape, dtype) in self.leaves.items()
            }
            dtensors = {name: self.dtensor(t, name, rules, self.cpu_mesh) for name, t in flat.items()}
            self.inplace[key] = {"flat": flat, "nested": nest(flat), "dtensors": dtensors}
        self.memcpy_pair = (
            [torch.ones(t.shape, dtype=t.dtype) for t in self.inplace["same"]["flat"].values()],
            [torch.zeros(t.shape, dtype=t.dtype) for t in self.inplace["same"]["flat"].values()],
        )
        self.raw_buffer = torch.zeros(self.nbytes["local"], dtype=torch.uint8)

    def memcpy_load(self) -> None:
        for d, t in zip(*reversed(self.memcpy_pair)):
            d.copy_(t)

    def raw_read_into(self) -> Any:
        """The raw file read into a buffer made once: the page cache's own copy, the least any
        reader through ``read`` calls pays."""
        view = memoryview(self.raw_buffer.numpy())
        piece = 64 << 20
        with open(self.raw_file, "rb", buffering=0) as f:
            for a in range(0, len(view), piece):
                f.readinto(view[a : a + piece])
        return self.raw_buffer

    def checked_read_into(self) -> Any:
        """The raw file read in pieces into one reused buffer, each piece's crc32c computed and
        the piece copied into the in-place tensors: the least a load pays that checks every
        byte it reads and places it in existing memory, with no per-chunk work at all. The
        memcpy's destinations take the bytes: the loads' own are checked after their loads."""
        import crc32c

        piece = memoryview(self.raw_buffer.numpy()[:CHECKED_PIECE])
        targets = [t.view(self.torch.uint8).reshape(-1).numpy() for t in self.memcpy_pair[1]]
        with open(self.raw_file, "rb", buffering=0) as f:
            for target in targets:
                for a in range(0, len(target), CHECKED_PIECE):
                    n = f.readinto(piece[: min(CHECKED_PIECE, len(target) - a)])
                    crc32c.crc32c(piece[:n])
                    target[a : a + n] = piece[:n]
        return targets

    def lc_into(self, key: str) -> Any:
        layout = self.layout if key == "same" else self.swapped
        return self.lc.load(self.paths["lc"], layout, like=self.inplace[key]["nested"], inplace=True)

    def dcp_into(self, key: str) -> Any:
        import torch.distributed.checkpoint as dcp

        dcp.load(self.inplace[key]["dtensors"], checkpoint_id=self.paths["dcp"], process_group=self.dcp_group)
        return self.inplace[key]["dtensors"]

    def lc_reshard(self) -> Any:
        return self.lc.load(self.paths["lc"], self.swapped)

    def torch_load(self) -> Any:
        path = os.path.join(self.paths["torch"], f"rank{self.rank}.pt")
        return self.torch.load(path, weights_only=True, map_location="cpu")

    def dcp_templates(self, rules: Any) -> dict[str, Any]:
        torch = self.torch
        return {
            name: self.dtensor(
                torch.empty(local_shape(shape, spec_of(name, rules), self.world, self.rank), dtype=dtype),
                name,
                rules,
                self.cpu_mesh,
            )
            for name, (shape, dtype) in self.leaves.items()
        }

    def dcp_load(self, rules: Any = RULES) -> Any:
        import torch.distributed.checkpoint as dcp

        templates = self.dcp_templates(rules)  # allocating the destination is part of a load
        dcp.load(templates, checkpoint_id=self.paths["dcp"], process_group=self.dcp_group)
        return templates

    def st_load(self) -> Any:
        from safetensors.torch import load_file

        out = load_file(os.path.join(self.paths["st"], "rank0.safetensors"), device="cpu")
        # load_file hands out tensors over a memory map of the file, read on first touch; touch
        # every page, so that the row times getting the bytes into memory, as the others do.
        page = 4096
        for t in out.values():
            flat = t.reshape(-1).view(self.torch.uint8)
            if flat.numel():
                int(flat[::page].sum())
        return out

    def orbax_load(self) -> Any:
        import jax
        import orbax.checkpoint as ocp

        jax.config.update("jax_enable_x64", True)
        out = ocp.StandardCheckpointer().restore(os.path.abspath(self.paths["orbax"]))
        jax.block_until_ready(out)
        return out

    def lc_read(self, index: Any = ...) -> Any:
        with self.lc.open(self.paths["lc"]) as rd:
            return rd.read(PARTIAL_TENSOR, index)

    def torch_whole(self, mmap: bool, rows: int | None = None) -> Any:
        """The partial-read target from ``torch.save`` files: load the rank files holding it
        (all of them for the whole tensor, rank 0's for the first rows) and cut it out."""
        torch = self.torch
        shards = []
        for r in range(1 if rows else self.world):
            sd = torch.load(
                os.path.join(self.paths["torch"], f"rank{r}.pt"), weights_only=True, map_location="cpu", mmap=mmap
            )
            t = sd[PARTIAL_TENSOR]
            shards.append(t[:rows].clone() if rows else t)
            del sd
        return torch.cat(shards, dim=0)  # copies: with mmap=True this is where the bytes are read

    # --- the run ----------------------------------------------------------------------------

    def write_ops(self) -> dict[str, tuple[Callable[[], Any], str]]:
        """measurement -> (callable, the folder it writes)."""
        return {
            "memcpy": (self.memcpy, ""),
            "raw_write": (self.raw_write, "raw"),
            "raw_write_streams": (self.raw_write_streams, "raw_streams"),
            "lc_save": (self.lc_save, "lc"),
            "lc_async": (self.lc_async, "lc_async"),
            "torch_save": (self.torch_save, "torch"),
            "dcp_save": (self.dcp_save, "dcp"),
            "dcp_async": (self.dcp_async, "dcp_async"),
            "st_save": (self.st_save, "st"),
            "orbax_save": (self.orbax_save, "orbax"),
            "bcp_save": (self.bcp_save, "bcp"),
        }

    def read_ops(self) -> dict[str, Callable[[], Any]]:
        tensor_bytes = self.opts["partial_bytes"]["tensor"]
        row_bytes = self.opts["partial_bytes"]["rows"]
        import numpy as np

        return {
            "raw_read": self.raw_read,
            "lc_load": self.lc_load,
            "torch_load": self.torch_load,
            "dcp_load": self.dcp_load,
            "st_load": self.st_load,
            "orbax_load": self.orbax_load,
            "lc_reshard": self.lc_reshard,
            "dcp_reshard": lambda: self.dcp_load(SWAPPED_RULES),
            "memcpy_load": self.memcpy_load,
            "raw_read_into": self.raw_read_into,
            "checked_read_into": self.checked_read_into,
            "lc_load_inplace": lambda: self.lc_into("same"),
            "dcp_load_inplace": lambda: self.dcp_into("same"),
            "bcp_load": lambda: self.bcp_into("same"),
            "lc_reshard_inplace": lambda: self.lc_into("swapped"),
            "dcp_reshard_inplace": lambda: self.dcp_into("swapped"),
            "bcp_reshard": lambda: self.bcp_into("swapped"),
            "raw_read_tensor": lambda: self.raw_read(tensor_bytes),
            "lc_read_tensor": self.lc_read,
            "torch_load_whole": lambda: self.torch_whole(mmap=False),
            "torch_mmap_tensor": lambda: self.torch_whole(mmap=True),
            "raw_read_rows": lambda: self.raw_read(row_bytes),
            "lc_read_rows": lambda: self.lc_read(np.s_[0:PARTIAL_ROWS, :]),
            "torch_mmap_rows": lambda: self.torch_whole(mmap=True, rows=PARTIAL_ROWS),
        }

    def run(self) -> dict[str, Any]:
        chosen = self.opts["measurements"]
        repeats = self.opts["repeats"]
        per: dict[str, list[Any]] = {}
        writes = self.write_ops()
        load0 = os.getloadavg()
        # Repeats are interleaved (every operation once, then again) so that drift in the disk
        # or the page cache hits every row alike, and every other one runs in reverse order: on
        # a virtual machine that hands freed memory back to its host, a write grows the page
        # cache into memory that costs more or less depending on what ran just before it. The
        # warm-up rounds come first and are not kept: a process's first save pays once for
        # imports, thread pools and memory touched for the first time, as a training job does.
        # The last repeat's files are kept for the reads.
        order = [k for k in WRITES if k in chosen]
        warmup = self.opts["warmup"]
        for rep in range(warmup + repeats):
            for key in order if rep % 2 == 0 else order[::-1]:
                fn, folder = writes[key]
                rank0 = MEASUREMENTS[key].get("rank0", False)
                if folder:
                    self.clean(self.paths[folder])
                    if self.rank == 0 and folder in ("raw", "raw_streams", "torch", "st"):  # the others make their own
                        os.makedirs(self.paths[folder])
                    self.barrier()
                if key in ("memcpy", "orbax_save"):
                    fn = fn()  # allocate and fill the source or destination, untimed
                rec = self.measure(fn, rank0=rank0)
                if rep >= warmup:
                    per.setdefault(key, []).append(rec)
                # Other folders are removed by the clean() before their next write; the async
                # ones go at once, as the reads do not use them.
                if folder in ("lc_async", "dcp_async"):
                    self.clean(self.paths[folder])
                del fn
        self.purge()
        files_written = {
            name: len(files_under(self.paths[name]))
            for name in ("lc", "torch", "dcp", "st", "orbax", "raw", "raw_streams", "bcp")
            if self.rank == 0
        }
        lc_packing = self.lc.open(self.paths["lc"]).meta.packing if self.rank == 0 and "lc_save" in chosen else None
        balance = self.write_balance(per)

        # The reads: the state, the staging pool and every other big buffer are dropped first,
        # so that peak RSS counts what the load itself holds.
        self.dcp_state = self.flat = self.state = self.memcpy_dsts = None
        try:
            from layoutckpt.torch import _staging

            for pool in list(getattr(_staging, "_POOLS", {}).values()):
                pool.clear()
        except ImportError:
            pass
        release_memory(full=True)
        if any(
            k in chosen
            for k in READS
            if "inplace" in k or k.startswith(("bcp_", "memcpy_", "raw_read_into", "checked_read_into"))
        ):
            self.make_inplace()
        reads = self.read_ops()
        for rep in range(repeats):
            for key in (k for k in READS if k in chosen):
                rank0 = MEASUREMENTS[key].get("rank0", False)
                for cache in ("cold", "warm"):
                    if rep == 0 and cache == "cold":
                        self.zero_destinations(key)  # untimed: its check sees only its own bytes
                    if cache == "cold" and MEASUREMENTS[key]["files"]:
                        self.evict(MEASUREMENTS[key]["files"])
                    out: dict[str, Any] = {}

                    def keep(fn: Callable[[], Any] = reads[key], out: dict[str, Any] = out) -> None:
                        out["value"] = fn()

                    per.setdefault(f"{key}.{cache}", []).append(self.measure(keep, rank0=rank0))
                    if rep == 0 and cache == "cold" and "value" in out:
                        self.check(key, out["value"])
                    out.clear()
        self.barrier()
        return {
            "results": per,
            "need": self.need,
            "bytes": self.nbytes,
            "digest_checks": self.compare_digests(),
            "files_written": files_written,
            "lc_packing": lc_packing,
            "write_balance": balance,
            "loadavg": [load0, os.getloadavg()],
            "device": str(self.device),
        }

    def zero_destinations(self, key: str) -> None:
        """Zero the tensors an in-place load of ``key`` fills: the in-place loads of every system
        share them (per layout), and a load that wrote nothing would otherwise pass its check
        on the bytes the load before it left there."""
        if key.endswith("_inplace") or key in ("bcp_load", "bcp_reshard"):
            for t in self.inplace["same" if "load" in key else "swapped"]["flat"].values():
                t.zero_()

    def check(self, key: str, value: Any) -> None:
        """Keep a digest of the first cold load of each kind, to compare after the run."""
        if key in ("lc_load", "lc_reshard", "lc_load_inplace", "lc_reshard_inplace"):
            self.digests[key] = digest(flatten(value))
        elif key in ("torch_load", "dcp_load", "dcp_reshard", "st_load"):
            self.digests[key] = digest(value)
        elif key in ("dcp_load_inplace", "dcp_reshard_inplace", "bcp_load", "bcp_reshard"):
            self.digests[key] = digest(value)
        elif key in PARTIAL_READS:
            # The partial reads: the tensor whole (equal across systems) and its first rows,
            # which are the first rows of rank 0's own shard.
            tensor = _as_torch(value)
            self.digests[key] = digest({PARTIAL_TENSOR: tensor})
            self.digests[f"{key}.rows"] = digest({PARTIAL_TENSOR: tensor[:PARTIAL_ROWS]})
        elif key == "orbax_load":
            import numpy as np

            from layoutckpt.torch._tensors import from_numpy

            self.digests[key] = digest({k: from_numpy(np.asarray(v), str(v.dtype)) for k, v in value.items()})

    def compare_digests(self) -> dict[str, bool]:
        """Same-layout loads must give back the state; both resharded loads must agree; partial
        reads must give rank 0's first rows, and the whole tensor alike in every system."""
        d = self.digests
        same = ("lc_load", "torch_load", "dcp_load", "st_load", "orbax_load", "lc_load_inplace", "dcp_load_inplace")
        out = {k: d[k] == d["state"] for k in (*same, "bcp_load") if k in d}
        for k in ("lc_reshard", "lc_reshard_inplace", "dcp_reshard_inplace", "bcp_reshard"):
            if k in d and "dcp_reshard" in d:
                out[f"{k} == dcp_reshard"] = d[k] == d["dcp_reshard"]
        for k in PARTIAL_READS:
            if k in d:
                out[f"{k} rows"] = d[f"{k}.rows"] == d["rows"]
        wholes = [k for k in ("lc_read_tensor", "torch_load_whole", "torch_mmap_tensor") if k in d]
        for k in wholes[1:]:
            out[f"{k} == {wholes[0]}"] = d[k] == d[wholes[0]]
        return out

    def write_balance(self, per: dict[str, list[Any]]) -> dict[str, Any]:
        """Who wrote the bytes: this rank's bytes in the last save of the state, per system
        (layoutckpt's own count; DCP's and ByteCheckpoint's rank files), and the same for one
        replicated tensor of ``REPLICATED_BYTES`` saved from every rank, with the data files
        each save made (rank 0 counts them; metadata documents left out)."""
        out: dict[str, Any] = {}
        if per.get("lc_save"):
            out["lc"] = per["lc_save"][-1].get("bytes_written")
        for system in ("dcp", "bcp"):
            if per.get(f"{system}_save"):
                out[system] = _rank_file_bytes(self.paths[system], self.rank)
        out["files"] = {s: _data_files(self.paths[s], s) for s in ("lc", "dcp", "bcp") if per.get(f"{s}_save")}
        # one replicated tensor, saved once per system (untimed)
        torch, lc = self.torch, self.lc
        tensor = torch.ones(REPLICATED_BYTES // 4, dtype=torch.float32)
        replicated: dict[str, Any] = {}
        path = os.path.join(self.work, "replicated-lc")
        self.clean(path)
        res = lc.save(path, {"w": tensor}, lc.Layout(self.mesh, [(r".*", lc.P())]))
        replicated["lc"] = res.metrics.bytes
        self.barrier()
        replicated["files"] = {"lc": _data_files(path, "lc") if self.rank == 0 else None}
        if per.get("dcp_save"):
            import torch.distributed.checkpoint as dcp
            from torch.distributed.tensor import Replicate

            path = os.path.join(self.work, "replicated-dcp")
            self.clean(path)
            state = {"w": self.dtensor_of(tensor, [Replicate()])}
            dcp.save(state, checkpoint_id=path, process_group=self.dcp_group)
            self.barrier()
            replicated["dcp"] = _rank_file_bytes(path, self.rank)
            replicated["files"]["dcp"] = _data_files(path, "dcp") if self.rank == 0 else None
        out["replicated"] = replicated
        self.barrier()
        if self.rank == 0:
            for name in ("replicated-lc", "replicated-dcp"):
                shutil.rmtree(os.path.join(self.work, name), ignore_errors=True)
        self.barrier()
        return out

    def dtensor_of(self, local: Any, placements: list[Any]) -> Any:
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, self.dmesh, placements, run_check=False)


def _rank_file_bytes(path: str, rank: int) -> int:
    """Bytes of the rank files a DCP-style checkpoint holds for ``rank`` (``__<rank>_<i>.distcp``)."""
    try:
        names = os.listdir(path)
    except OSError:
        return 0
    return sum(os.path.getsize(os.path.join(path, n)) for n in names if n.startswith(f"__{rank}_"))


def _data_files(path: str, system: str) -> int:
    """Data files a checkpoint holds: a plain layoutckpt checkpoint's shard files (every file but
    its ``.json`` documents), a packed one's data files (``packs/<rank>/d/``: the shards, with
    the rank's B+tree nodes; the manifests and the merged tree are metadata, as the documents
    are), DCP's and ByteCheckpoint's ``.distcp`` rank files."""
    files = files_under(path)
    if system == "lc":
        packs = os.path.join(path, "packs")
        if os.path.isdir(packs):
            return sum(1 for f in files if f.startswith(packs) and os.path.basename(os.path.dirname(f)) == "d")
        return sum(1 for f in files if not f.endswith(".json"))
    return sum(1 for f in files if f.endswith(".distcp"))


def _write_all(f: Any, view: memoryview) -> None:
    """All of ``view`` to the unbuffered file ``f``: one ``write`` moves at most 2 GiB on Linux."""
    while len(view):
        view = view[f.write(view) :]


def _phases(result: Any) -> dict[str, float]:
    """A layoutckpt save's phase times for the JSON (``phase_write`` ...), to tell a slow row's cause."""
    return {f"phase_{name}": seconds for name, seconds in result.metrics.phases}


def _rank_main(rank: int, world: int, opts: dict[str, Any]) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{opts['init_file']}", rank=rank, world_size=world)
    result = _Rank(rank, world, opts).run()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        with open(os.path.join(opts["workdir"], "results.json"), "w") as f:
            json.dump(gathered, f)
    dist.barrier()
    leave_world()


# ---------------------------------------------------------------------------------------------
# Reduction: rows, ratios, targets.


def summarize(per_rank: list[dict[str, Any]], opts: dict[str, Any]) -> dict[str, Any]:
    partial = opts["partial_bytes"]
    logical = {
        "local": sum(r["need"]["local"] for r in per_rank),
        "local0": per_rank[0]["need"]["local"],
        "reshard": sum(r["need"]["reshard"] for r in per_rank),
        "tensor": partial["tensor"],
        "rows": partial["rows"],
    }
    # bytes each rank needs for a read row (the target of bytes read): its own shards
    need_per_rank = {
        "local": [r["need"]["local"] for r in per_rank],
        "local0": [per_rank[0]["need"]["local"]],
        "reshard": [r["need"]["reshard"] for r in per_rank],
        "tensor": [partial["tensor"]],
        "rows": [partial["rows"]],
    }
    rows = []
    for row in table_rows():
        recs = [r["results"].get(row["meas"]) for r in per_rank]  # per rank, per repeat; None off rank 0
        if recs[0] is None:
            continue  # not selected (--only)
        repeats = len(recs[0])
        by_rep = [[rr[i] for rr in recs if rr[i] is not None] for i in range(repeats)]
        times = [max(rec[row["metric"]] for rec in rep) for rep in by_rep]
        s = stats(times)
        nbytes = logical[row["bytes"]]
        out = dict(row, **s)
        out["logical_bytes"] = nbytes
        out["gbps"] = nbytes / s["median"] / GB if s["median"] > 0 else float("inf")
        out["peak_rss"] = statistics.median(max(rec["hwm"] for rec in rep) for rep in by_rep)
        out["rss_before"] = statistics.median(max(rec["rss0"] for rec in rep) for rep in by_rep)
        out["ranks"] = len(by_rep[0])
        if row["cache"]:
            # rchar misses mmap'd reads; read_bytes (storage) catches their cold page faults
            got = [sum(max(rec["rchar"], rec["read_bytes"]) for rec in rep) for rep in by_rep]
            storage = [sum(rec["read_bytes"] for rec in rep) for rep in by_rep]
            needed = sum(need_per_rank[row["bytes"]])
            out["bytes_read"] = statistics.median(got)
            out["storage_read_bytes"] = statistics.median(storage)
            out["bytes_needed"] = needed
            out["read_ratio"] = out["bytes_read"] / needed if needed else None
            # What the system asked the kernel for (read calls), apart from what readahead added.
            requested = [sum(rec["rchar"] for rec in rep) for rep in by_rep]
            out["requested_ratio"] = statistics.median(requested) / needed if needed else None
            out["storage_ratio"] = out["storage_read_bytes"] / needed if needed else None
            out["need_per_rank"] = need_per_rank[row["bytes"]]
            out["peak_rss_per_rank"] = [
                statistics.median(rr[i]["hwm"] for i in range(repeats)) for rr in recs if rr[0] is not None
            ]
            # What the operation itself added: its peak over the RSS it started from.
            out["rss_growth_per_rank"] = [
                statistics.median(rr[i]["hwm"] - rr[i]["rss0"] for i in range(repeats))
                for rr in recs
                if rr[0] is not None
            ]
        rows.append(out)
    # ratios within an operation (and cache state): GB/s over the best peer's and the limit's
    for row in rows:
        same = [r for r in rows if r["op"] == row["op"] and r["cache"] == row["cache"]]
        # a rank-0-only peer of a collective operation moves 1/N of the bytes alone: not the best peer
        ranks = max(r["ranks"] for r in same)
        peers = [r for r in same if r["role"] == "peer" and r["ranks"] == ranks]
        limit = next((r for r in same if r["role"] == "limit"), None)
        best = max(peers, key=lambda r: r["gbps"], default=None)
        row["best_peer"] = best["system"] if best else None
        row["vs_peer"] = row["gbps"] / best["gbps"] if best and row["role"] != "limit" else None
        row["vs_limit"] = row["gbps"] / limit["gbps"] if limit and row["role"] != "limit" else None
    return {
        "rows": rows,
        "targets": targets(rows, len(per_rank)),
        "save_context": save_context(rows),
        "load_context": load_context(rows),
        "logical_bytes": logical,
    }


def write_balance(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Bytes written per rank, max over mean, and data files, per system: for the state's save
    and for one replicated tensor saved from every rank."""
    out: dict[str, Any] = {}
    balances = [r.get("write_balance") or {} for r in per_rank]
    if not balances or not balances[0]:
        return out

    def ratio(values: list[Any]) -> dict[str, Any] | None:
        if not values or any(v is None for v in values) or not sum(values):
            return None
        mean = sum(values) / len(values)
        return {"max": max(values), "mean": mean, "max_over_mean": max(values) / mean, "per_rank": values}

    for system in ("lc", "dcp", "bcp"):
        if system in balances[0]:
            out[system] = ratio([b.get(system) for b in balances])
            if out[system] is not None:
                out[system]["files"] = balances[0]["files"].get(system)
    rep = [b.get("replicated") or {} for b in balances]
    out["replicated"] = {}
    for system in ("lc", "dcp"):
        if system in rep[0]:
            r = ratio([x.get(system) for x in rep])
            if r is not None:
                r["files"] = rep[0]["files"].get(system)
            out["replicated"][system] = r
    return out


def balance_targets(balance: dict[str, Any], world: int) -> list[dict[str, Any]]:
    """The write-balance target of issue 26 (one replicated 128 MiB tensor on more than one rank:
    bytes written per rank max/mean <= 1.5), with DCP's figure beside it."""
    lc = (balance.get("replicated") or {}).get("lc")
    dcp = (balance.get("replicated") or {}).get("dcp")
    name = "bytes written per rank, max/mean, one replicated 128 MiB tensor"
    if dcp:
        name += f" (DCP {dcp['max_over_mean']:.2f})"
    if lc is None:
        return [dict(name=name, value=None, bound=1.5, higher=False, unit="x", verdict="n/a")]
    ok = lc["max_over_mean"] <= 1.5
    return [
        dict(name=name, value=lc["max_over_mean"], bound=1.5, higher=False, unit="x", verdict="PASS" if ok else "MISS")
    ]


def save_context(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Save throughputs over the one-stream raw write, to read the two save targets by: what
    1.5x DCP asks of the disk, and how close layoutckpt comes to the disk's parallel peak."""
    raw = _row(rows, "save", "raw write+fsync")
    if raw is None:
        return {}
    out = {}
    for key, system in (
        ("parallel raw write", f"raw write+fsync, {MACHINE_STREAMS} streams"),
        ("layoutckpt save", "layoutckpt save"),
        ("DCP save", "DCP save"),
    ):
        r = _row(rows, "save", system)
        if r is not None:
            out[key] = r["gbps"] / raw["gbps"]
    if "DCP save" in out:
        out["1.5x DCP save"] = 1.5 * out["DCP save"]
    return out


def load_context(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Warm in-place loads over the checked read of the same bytes (read, crc32c, copy into
    place, no per-chunk work), per operation: where 2x DCP is above 1, the target asks for more
    than any load that checks every byte it reads can give on this machine."""
    out = {}
    for op in ("load in place", "load resharded in place"):
        floor = _row(rows, op, CHECKED_READ, "warm")
        if floor is None:
            continue
        ratios = {}
        for key, system in (("layoutckpt", "layoutckpt load(inplace=True)"), ("DCP", "DCP load")):
            r = _row(rows, op, system, "warm")
            if r is not None:
                ratios[key] = r["gbps"] / floor["gbps"]
        if "DCP" in ratios:
            ratios["2x DCP"] = 2 * ratios["DCP"]
        out[op] = ratios
    return out


def _row(rows: list[dict[str, Any]], op: str, system: str, cache: str | None = None) -> dict[str, Any] | None:
    return next((r for r in rows if r["op"] == op and r["system"] == system and r["cache"] == cache), None)


def targets(rows: list[dict[str, Any]], world: int) -> list[dict[str, Any]]:
    """The issue's targets, reported, never asserted. ``value`` and ``bound`` are in the target's
    own unit; ``higher`` says which side passes. With one rank a resharded load is a load of the
    same layout (every box is the whole array): its speed targets are not applicable."""
    out = _targets(rows)
    if world == 1:
        for t in out:
            if t["name"].startswith(("resharding load GB/s", "warm in-place resharded", "warm resharded")):
                t.update(value=None, verdict="n/a (one rank: no reshard)")
    return out


def _targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []

    def add(name: str, value: float | None, bound: float, higher: bool, unit: str) -> None:
        if value is None:
            out.append(dict(name=name, value=None, bound=bound, higher=higher, unit=unit, verdict="n/a"))
            return
        ok = value >= bound if higher else value <= bound
        out.append(
            dict(name=name, value=value, bound=bound, higher=higher, unit=unit, verdict="PASS" if ok else "MISS")
        )

    def speed(a: dict[str, Any] | None, b: dict[str, Any] | None) -> float | None:
        return a["gbps"] / b["gbps"] if a and b else None

    def time_ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> float | None:
        return a["median"] / b["median"] if a and b else None

    save = _row(rows, "save", "layoutckpt save")
    add("save GB/s / raw write+fsync GB/s", speed(save, _row(rows, "save", "raw write+fsync")), 0.9, True, "x")
    add("save GB/s / DCP save GB/s", speed(save, _row(rows, "save", "DCP save")), 1.5, True, "x")
    blocked = _row(rows, "save_async blocked", "layoutckpt save_async")
    memcpy = _row(rows, "save_async blocked", "memcpy (staging bound)")
    add("save_async blocked / memcpy of the local state", time_ratio(blocked, memcpy), 1.5, False, "x")
    dcp_blocked = _row(rows, "save_async blocked", "DCP async_save")
    add("save_async blocked / DCP async_save blocked", time_ratio(blocked, dcp_blocked), 0.5, False, "x")
    reshard = _row(rows, "load resharded", "layoutckpt load", "cold")
    dcp_reshard = _row(rows, "load resharded", "DCP load", "cold")
    add("resharding load GB/s / DCP resharding load GB/s (cold)", speed(reshard, dcp_reshard), 1.5, True, "x")
    # The bytes the library asks for; a cold read also pulls in what the kernel reads ahead
    # around each request (printed beside it), which no reader of small chunks controls.
    storage = f", from storage {reshard['storage_ratio']:.2f} x with readahead" if reshard else ""
    add(
        f"resharding load bytes requested / bytes needed (cold{storage})",
        reshard["requested_ratio"] if reshard else None,
        1.1,
        False,
        "x",
    )
    part = _row(rows, "read 1 tensor (rank 0)", "layoutckpt open().read", "cold")
    whole = _row(rows, "read 1 tensor (rank 0)", "torch.load whole ckpt", "cold")
    add("torch.load whole ckpt time / partial read of 1 tensor time (cold)", time_ratio(whole, part), 20, True, "x")
    # Warm loads (issue 26): in place against DCP and ByteCheckpoint in place and a memcpy of the
    # same bytes; into fresh tensors against DCP's load into fresh tensors.
    for label, op, lc_name in (
        ("in-place load", "load in place", "layoutckpt load(inplace=True)"),
        ("in-place resharded load", "load resharded in place", "layoutckpt load(inplace=True)"),
    ):
        mine = _row(rows, op, lc_name, "warm")
        for peer, bound in (("DCP load", 2.0), ("ByteCheckpoint load", 2.0), ("memcpy", 0.5)):
            other = _row(rows, op, peer, "warm")
            if other is None and peer.startswith("ByteCheckpoint"):
                continue  # not installed: no row, no target
            add(f"warm {label} GB/s / {peer} GB/s", speed(mine, other), bound, True, "x")
    for label, op in (("load", "load"), ("resharded load", "load resharded")):
        add(
            f"warm {label} into fresh tensors GB/s / DCP GB/s",
            speed(_row(rows, op, "layoutckpt load", "warm"), _row(rows, op, "DCP load", "warm")),
            2.0,
            True,
            "x",
        )
    for label, op in (("load", "load"), ("resharded load", "load resharded")):
        r = _row(rows, op, "layoutckpt load", "cold")
        if r is None:
            add(f"peak RSS growth of {label} (cold, worst rank) vs 1.3 x shard + 300 MB", None, 0, False, "GB")
            continue
        # The worst rank against its own bound. The bound is on what the load holds, its peak
        # over the RSS it started from: the interpreter with torch and tensorstore imported
        # already takes about 0.4 GB, more than the 300 MB allowance, before any load.
        pairs = list(zip(r["rss_growth_per_rank"], r["need_per_rank"], r["peak_rss_per_rank"]))
        growth, need, peak = max(pairs, key=lambda p: p[0] - (1.3 * p[1] + RSS_SLACK))
        add(
            f"peak RSS growth of {label} (cold, worst rank; shard {need / GB:.3f} GB, absolute peak "
            f"{peak / GB:.2f} GB) vs 1.3 x shard + 300 MB",
            growth / GB,
            (1.3 * need + RSS_SLACK) / GB,
            False,
            "GB",
        )
    return out


# ---------------------------------------------------------------------------------------------
# Reporting.


def _fmt(x: float | None, spec: str, missing: str = "-") -> str:
    return missing if x is None else format(x, spec)


def print_table(world: int, summary: dict[str, Any], info: dict[str, Any]) -> None:
    dims = info["dims"]
    b = summary["logical_bytes"]
    print(
        f"\n=== {world} rank(s), tp={world}: hidden={dims['hidden']} inter={dims['inter']} kv={dims['kv']} "
        f"vocab={dims['vocab']} layers={dims['layers']}; {b['local'] / GB:.3f} GB held over all ranks "
        f"({b['local'] / world / GB:.3f} GB per rank), bf16 weights + fp32 exp_avg/exp_avg_sq ==="
    )
    head = (
        f"{'operation':<22} {'system':<37} {'cache':<5} {'median s':>9} {'spread s':>17} {'GB/s':>7} "
        f"{'x peer':>7} {'x limit':>7} {'read/need':>9} {'RSS GB':>7}"
    )
    print(head)
    print("-" * len(head))
    last_op = None
    for r in summary["rows"]:
        if last_op is not None and r["op"] != last_op:
            print()
        last_op = r["op"]
        spread = f"{r['min']:.4f} - {r['max']:.4f}"
        print(
            f"{r['op']:<22} {r['system']:<37} {r['cache'] or '':<5} {r['median']:9.4f} {spread:>17} "
            f"{r['gbps']:7.3g} {_fmt(r['vs_peer'], '7.2f'):>7} {_fmt(r['vs_limit'], '7.2f'):>7} "
            f"{_fmt(r.get('read_ratio'), '9.2f', ''):>9} {r['peak_rss'] / GB:7.2f}"
        )
    print(
        "\nGB/s = the operation's logical bytes (state held, bytes the ranks need, or the tensor/rows "
        "read) / median; x peer, x limit = GB/s over the best peer's / the physical limit's for that "
        "operation and cache state (> 1 is faster). read/need = bytes read (max of rchar and storage "
        "read_bytes, summed over ranks) / bytes the ranks need. RSS GB = peak RSS, max over ranks."
    )
    checks = info["digest_checks"]
    bad = {k: v for k, v in checks.items() if not v}
    print(
        f"checks (crc32 of every loaded tensor): {'all equal' if not bad else 'MISMATCH ' + str(bad)} {sorted(checks)}"
    )
    print(f"files written: {info['files_written']}")
    for label, part in (
        ("the state", summary.get("write_balance") or {}),
        ("one replicated 128 MiB tensor", (summary.get("write_balance") or {}).get("replicated") or {}),
    ):
        cells = [
            f"{name} max/mean {b['max_over_mean']:.2f} (max {b['max'] / GB:.3f} GB, mean {b['mean'] / GB:.3f} GB), "
            f"{b['files']} data files"
            for name, b in part.items()
            if isinstance(b, dict) and "max_over_mean" in b
        ]
        if cells:
            print(f"bytes written per rank, {label}: " + "; ".join(cells))
    print(f"\ntargets for {world} rank(s) (reported, never asserted):")
    width = max(len(t["name"]) for t in summary["targets"])
    for t in summary["targets"]:
        sign = ">=" if t["higher"] else "<="
        value = _fmt(t["value"], ".3f", "n/a")
        print(f"  {t['name']:<{width}} {value:>8} {t['unit']:<2} {sign} {t['bound']:<7.3f} {t['verdict']}")
    context = summary.get("save_context")
    if context:
        print(
            "  save GB/s over the one-stream raw write+fsync: "
            + ", ".join(f"{name} {value:.2f}" for name, value in context.items())
        )
    for op, ratios in (summary.get("load_context") or {}).items():
        print(f"  warm {op} GB/s over the checked read's: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))


def provenance() -> dict[str, Any]:
    """The commit this run measures and when it started, for ``report.py``'s stamp on the table.
    ``commit`` is None outside a git checkout; ``dirty`` says whether files differed from it."""

    def git(*args: str) -> str | None:
        # GIT_OPTIONAL_LOCKS=0: the status check must not rewrite the index of a checkout in use.
        env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}
        here = os.path.dirname(os.path.abspath(__file__))
        try:
            done = subprocess.run(["git", "-C", here, *args], capture_output=True, text=True, env=env, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain") if commit else None
    return {
        "commit": commit,
        "dirty": None if status is None else bool(status),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def machine_info(directory: str) -> dict[str, Any]:
    mem = meminfo()
    fs = filesystem_of(directory)
    return {
        "cores": os.cpu_count(),
        "mem_total_gb": mem.get("MemTotal", 0) / GB,
        "filesystem": fs,
        "python": sys.version.split()[0],
        "free_page_reporting": free_page_reporting(),
        "ext4_journal": ext4_journal(fs),
    }


def free_page_reporting() -> bool | None:
    """Whether this (virtual) machine hands freed memory back to its host (Linux page
    reporting, through virtio-balloon): memory touched again after that faults on the host,
    so a write into a page cache that grows into it slows down by an amount no run controls.
    None where the kernel does not say."""
    try:
        with open("/sys/module/page_reporting/parameters/page_reporting_order") as f:
            f.read()
    except OSError:
        return None
    features = "/sys/bus/virtio/drivers/virtio_balloon"
    try:
        devices = [d for d in os.listdir(features) if d.startswith("virtio")]
    except OSError:
        return False
    for dev in devices:
        try:
            with open(os.path.join(features, dev, "features")) as f:
                bits = f.read().strip()
        except OSError:
            continue
        if len(bits) > 5 and bits[5] == "1":  # VIRTIO_BALLOON_F_REPORTING
            return True
    return False


def plot(path: str, results: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = list(results["worlds"])
    n_rows = max(len(results["worlds"][w]["rows"]) for w in worlds)
    fig, axes = plt.subplots(1, len(worlds), figsize=(7 * len(worlds), 0.28 * n_rows + 1.5), squeeze=False)
    colors = {"limit": "0.6", "lc": "tab:blue", "peer": "tab:orange"}
    for ax, w in zip(axes[0], worlds):
        rows = results["worlds"][w]["rows"]
        labels = [f"{r['op']}: {r['system']}" + (f" [{r['cache']}]" if r["cache"] else "") for r in rows]
        ax.barh(range(len(rows)), [r["gbps"] for r in rows], color=[colors[r["role"]] for r in rows])
        ax.set_yticks(range(len(rows)), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("GB/s (log)")
        ax.set_title(f"{w} rank(s)")
        ax.grid(axis="x", alpha=0.3)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    state_gb = results["worlds"][worlds[0]]["logical_bytes"]["local"] / GB
    fig.legend(handles, ["physical limit", "layoutckpt", "peer"], loc="lower center", ncol=3)
    fig.suptitle(f"layoutckpt benchmark: {state_gb:.2f} GB state, GB/s by operation and system (higher is better)")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=2.0, help="total state size over all ranks, GB (default 2.0)")
    parser.add_argument("--ranks", default="1,2,4", help="world sizes to run, comma-separated (default 1,2,4)")
    parser.add_argument("--repeats", type=int, default=3, help="repeats of every measurement (default 3)")
    parser.add_argument(
        "--warmup", type=int, default=1, help="untimed rounds of every write before the repeats (default 1)"
    )
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="a fresh folder is made (and removed) under it")
    parser.add_argument("--json", help="write every number here")
    parser.add_argument("--plot", help="write a PNG of GB/s by operation and system here (needs matplotlib)")
    parser.add_argument("--quick", action="store_true", help="a tiny state (a few MB) for a smoke run")
    parser.add_argument(
        "--delete-between",
        action="store_true",
        help="delete each output right before the next write to its folder, instead of moving it aside "
        "until the writes are done (saves seconds apart; see docs/performance.md)",
    )
    parser.add_argument(
        "--only", help=f"comma-separated groups {GROUPS} and/or systems {SYSTEMS}; the limits always run"
    )
    parser.add_argument(
        "--packing",
        choices=("auto", "files", "ocdbt"),
        default="auto",
        help="layoutckpt's packing (default auto, the library's: packed above 1,000 stored objects)",
    )
    args = parser.parse_args(argv)

    import torch.multiprocessing as mp

    worlds = [int(w) for w in args.ranks.split(",") if w.strip()]
    dims = dict(QUICK_DIMS) if args.quick else model_dims(args.gb)
    embed_shape, _ = leaves(dims)[PARTIAL_TENSOR]
    partial_bytes = {"tensor": embed_shape[0] * embed_shape[1] * 2, "rows": PARTIAL_ROWS * embed_shape[1] * 2}
    measurements = select(args.only)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.makedirs(args.dir, exist_ok=True)
    root = tempfile.mkdtemp(prefix="lc-bench-", dir=args.dir)
    machine = machine_info(root)
    safetensors_ok = importlib.util.find_spec("safetensors") is not None
    if not safetensors_ok:
        measurements = [m for m in measurements if MEASUREMENTS[m]["system"] != "safetensors"]
    orbax_ok = bool(importlib.util.find_spec("jax") and importlib.util.find_spec("orbax"))
    if not orbax_ok:
        measurements = [m for m in measurements if MEASUREMENTS[m]["system"] != "orbax"]
    orbax = "installed (measured on rank 0 alone, like safetensors)" if orbax_ok else "not installed"
    bcp = bytecheckpoint_status()
    if bcp != "installed":
        measurements = [m for m in measurements if MEASUREMENTS[m]["system"] != "bcp"]
    results: dict[str, Any] = {
        "command": sys.argv if argv is None else ["bench.py", *argv],
        **provenance(),
        "options": {**vars(args), "dims": dims, "partial_tensor": PARTIAL_TENSOR, "measurements": measurements},
        "machine": machine,
        "orbax": orbax,
        "safetensors": "installed" if safetensors_ok else "not installed",
        "bytecheckpoint": bcp,
        "worlds": {},
    }
    # Outputs moved aside stay on disk until a world size's writes are done: every write of
    # every repeat, about --gb each (safetensors and Orbax less). Without that room they are
    # truncated as they are moved aside, never deleted: a run that switched to deleting them
    # (--delete-between) charged every layoutckpt save for the inodes of the one before
    # (docs/performance.md, "Deleting right before saving").
    state_bytes = sum(math.prod(shape) * dtype.itemsize for shape, dtype in leaves(dims).values())
    kept_bytes = int(state_bytes * (args.repeats + args.warmup) * sum(1 for m in measurements if m in WRITES) * 1.1)
    truncate_aside = not args.delete_between and shutil.disk_usage(root).free < kept_bytes
    results["options"]["truncate_aside"] = truncate_aside
    if truncate_aside:
        print(
            f"note: {kept_bytes / 1e9:.0f} GB to keep every output until the writes are done is more than the "
            f"free space under --dir; each output is truncated as it is moved aside (space freed, inodes kept)"
        )
    t_start = time.perf_counter()
    try:
        results["eviction_check"] = check_eviction(root)
        for world in worlds:
            workdir = os.path.join(root, f"w{world}")
            os.makedirs(workdir)
            opts = {
                "repeats": args.repeats,
                "warmup": args.warmup,
                "dims": dims,
                "workdir": workdir,
                "init_file": os.path.join(workdir, "init"),
                "partial_bytes": partial_bytes,
                "measurements": measurements,
                "delete_between": args.delete_between,
                "truncate_aside": truncate_aside,
                "packing": args.packing,
            }
            t0 = time.perf_counter()
            mp.spawn(_rank_main, args=(world, opts), nprocs=world, join=True)
            with open(os.path.join(workdir, "results.json")) as f:
                per_rank = json.load(f)
            free_output(workdir, delete=args.delete_between)  # see _Rank.purge
            summary = summarize(per_rank, opts)
            summary["write_balance"] = write_balance(per_rank)
            summary["targets"] += balance_targets(summary["write_balance"], world)
            info = {
                "dims": dims,
                "digest_checks": {
                    k: all(r["digest_checks"].get(k, True) for r in per_rank) for k in per_rank[0]["digest_checks"]
                },
                "files_written": per_rank[0]["files_written"],
                "lc_packing": per_rank[0].get("lc_packing"),
                "loadavg": per_rank[0]["loadavg"],
                "device": per_rank[0]["device"],
                "wall_s": time.perf_counter() - t0,
            }
            results["worlds"][str(world)] = {**summary, **info, "per_rank": per_rank}
            print_table(world, summary, info)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results["wall_s"] = time.perf_counter() - t_start
    results["meminfo_after"] = meminfo()
    print_notes(results, root)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
        print(f"JSON: {os.path.abspath(args.json)}")
    if args.plot:
        os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
        plot(args.plot, results)
        print(f"plot: {os.path.abspath(args.plot)}")
    return results


def bytecheckpoint_status() -> str:
    """ "installed" where ByteCheckpoint (pip ``bytecheckpoint``, installed with ``--no-deps``: it
    pins torch <= 2.5) imports with the parts the bench calls; otherwise why its rows are left out."""
    if importlib.util.find_spec("bytecheckpoint") is None:
        return "not installed (pip install --no-deps bytecheckpoint, then grpcio, mmh3, universal-pathlib, cachetools)"
    os.environ.setdefault("BYTECHECKPOINT_LOGGING_LEVEL", "WARNING")  # its INFO lines, per call, inherited by the ranks
    try:
        from bytecheckpoint.checkpointer.fsdp2_checkpointer import FSDP2Checkpointer  # noqa: F401
        from bytecheckpoint.planner.fsdp.fsdp_planner import FSDPLoadPlanner, FSDPSavePlanner  # noqa: F401
        from bytecheckpoint.storage import CKPTCounter  # noqa: F401
    except Exception as err:  # noqa: BLE001 - any failure to import leaves its rows out, with a note
        return f"fails to import ({type(err).__name__}: {err}); its rows are left out"
    return "installed"


def print_notes(results: dict[str, Any], root: str) -> None:
    m = results["machine"]
    fs = m["filesystem"]
    print(
        f"\nmachine: {m['cores']} cores, {m['mem_total_gb']:.1f} GB RAM; --dir {os.path.dirname(root)} on "
        f"{fs.get('type', '?')} {fs.get('device', '?')} mounted at {fs.get('mount', '?')} ({fs.get('options', '')})"
    )
    loads = [w["loadavg"] for w in results["worlds"].values()]
    if loads:
        first, last = loads[0][0][0], loads[-1][1][0]
        busy = " -- busier than the core count: expect noise" if max(first, last) > (m["cores"] or 1) else ""
        print(f"load average (1 min): {first:.2f} at the start, {last:.2f} at the end{busy}")
    if m.get("free_page_reporting"):
        print(
            "memory: this virtual machine hands freed memory back to its host (page reporting): a write "
            "whose page cache grows into such memory pays the host's page faults, so writes vary from "
            "repeat to repeat; rows alternate their order between repeats to share it out"
        )
    if m.get("ext4_journal") is False:
        how = (
            "each output was deleted right before the next write (--delete-between), so file creation paid for them"
            if results["options"]["delete_between"]
            else "this run deletes nothing until it ends (outputs are truncated instead), but deletions by other "
            "programs in the last minute or more before it still count"
        )
        print(
            "inodes: ext4 without a journal passes over the inodes freed in the last 1-6 minutes, one lookup each, "
            f"whenever it creates a file, charging writers of many files for recent deletions; {how}"
        )
    ev = results["eviction_check"]
    verdict = "works" if ev["works"] else "DOES NOT WORK: the cold rows are warm"
    resident = ""
    if ev["resident_before"] is not None:
        resident = f", mincore residency {ev['resident_before']:.0%} -> {ev['resident_after_evict']:.0%}"
    print(
        f"page cache: cold rows evict every file of the checkpoint they read (fsync, then "
        f"posix_fadvise DONTNEED, no root) right before the timed read; warm rows repeat the read at "
        f"once. Eviction check on a {ev['bytes'] >> 20} MiB file: {verdict} (storage reads after eviction "
        f"{ev['read_bytes_after_evict'] >> 20} MiB{resident}; read {ev['cold_read_s'] * 1e3:.1f} ms cold, "
        f"{ev['warm_read_s'] * 1e3:.1f} ms warm). Directory metadata is not evicted. The disk may be "
        "virtual, with a host cache under it."
    )
    for w, res in results["worlds"].items():
        # every cold row of at least 1 MiB should fetch what it needs from storage, not the cache
        cold = [
            r
            for r in res["rows"]
            if r["cache"] == "cold" and r["bytes_needed"] >= 1 << 20 and MEASUREMENTS[r["meas"].split(".")[0]]["files"]
        ]
        if cold:
            low = min(cold, key=lambda r: r["storage_read_bytes"] / r["bytes_needed"])
            frac = low["storage_read_bytes"] / low["bytes_needed"]
            print(
                f"  {w} rank(s): every cold row of >= 1 MiB fetched >= {frac:.0%} of the bytes it needs from "
                f"storage (read_bytes; lowest: {low['op']}, {low['system']}); wall time {res['wall_s']:.0f} s "
                f"on {res['device']}"
            )
    print(
        f"safetensors: {results['safetensors']}; Orbax: {results['orbax']}; ByteCheckpoint: "
        f"{results['bytecheckpoint']}; total wall time {results['wall_s']:.0f} s"
    )


if __name__ == "__main__":
    from report import failed_checks

    failed = failed_checks(main())
    if failed:
        print(f"loads that gave wrong data: {failed}", file=sys.stderr)
    sys.exit(1 if failed else 0)
