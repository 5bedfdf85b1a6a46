"""One rank of a checkpointing job that saves one step through a ``CheckpointManager``, and can
be killed (SIGKILL, no cleanup of any kind) at a chosen phase of that save.

    python tests/crash_worker.py --rank R --world N --init FILE --root ROOT --step S \
        [--kill-at PHASE] [--kill-rank R] [--mb MB]

The job saves a deterministic state (``build_state``): every value comes from a
``torch.Generator`` seeded by the step, so any reader rebuilds the expected full arrays with
``expected_full(step, mb)`` and compares bit for bit. Arrays are sharded over the ``tp`` axis (rows,
columns, an uneven 1-D split) or replicated.

The worker prints, on stdout, one line per event, stamped ``@<time.monotonic()>``:
``SAVING S`` right before ``mgr.save``; ``PHASE <name>`` the first time this rank reaches a phase of
the save (``stage``, ``write``, ``agree``, and on rank 0 ``marker``, ``rename``, ``renamed``,
``retire``); ``STAGED S`` when ``mgr.save`` returned; ``COMMITTED S`` after ``mgr.wait()``.

Phase kills (only in the process of ``--kill-rank``), placed by reading ``layoutckpt/_save.py``:

==============  ========================================  =========================================
phase           rank 0                                    any other rank
==============  ========================================  =========================================
stage           2nd staging buffer taken                  same
                (``HostBuffers.acquire``)
write           after its 2nd shard write landed          same
                (``_shardfile.write_shard`` proxied for
                local files, ``_store.open_array`` for
                TensorStore)
before-marker   about to write the marker                 entering ``_commit``: its writes are done
                (``_store.write_file`` of the tmp dir's   and durable, but it has not agreed
                root ``zarr.json``; the ranks agreed)
after-marker    entering ``_store.commit_dir``: the       right after the ranks agreed, once rank 0
                marker is in the tmp dir, not renamed     has written the marker
after-rename    right after ``commit_dir`` renamed it     once rank 0 broadcast the commit's status
==============  ========================================  =========================================

``python tests/crash_worker.py --serve`` is a fork server for the same workers: it imports torch
and layoutckpt once, then forks one child per request read on stdin (a JSON line ``{"id", "argv",
"out", "err"}``); each child takes its own process group, sends stdout/stderr to the named files
and runs ``main(argv)``. The server answers ``READY``, ``STARTED <id> <pid>`` and
``EXIT <pid> <returncode>`` lines. A job then starts in tens of milliseconds instead of seconds of
``import torch``, and the children are killed with SIGKILL exactly like cold-started ones.

Expected outcomes: the step is committed only for ``after-rename`` on any rank and for
``after-marker`` on a rank other than 0 (rank 0 needs nobody once the ranks agreed); every other
kill leaves it invisible. ``expected_outcome`` says so for the harness.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

PHASES = ("stage", "write", "before-marker", "after-marker", "after-rename")
KEEP_LAST = 2


def expected_outcome(phase: str, kill_rank: int) -> str:
    """'committed' or 'invisible': what a kill of ``kill_rank`` at ``phase`` leaves for that step."""
    if phase == "after-rename" or (phase == "after-marker" and kill_rank != 0):
        return "committed"
    return "invisible"


# --- the deterministic state -------------------------------------------------------------------


def shapes(mb: float) -> dict[str, tuple[int, ...]]:
    """Global shapes for a state of about ``mb`` MiB; independent of the world size."""
    n = int(mb * 2**20)
    return {
        "model.layers.0.w": (max(8, int(0.40 * n) // (4 * 256)), 256),  # float32, rows over tp
        "model.layers.0.v": (128, max(8, int(0.20 * n) // (2 * 128)) | 1),  # bf16, odd #cols over tp
        "model.emb": (max(8, int(0.25 * n) // (4 * 64)), 64),  # float32, replicated
        "opt.m": (max(16, int(0.15 * n) // 4) + 3,),  # float32, uneven 1-D split over tp
        "opt.count": (7,),  # int64, replicated
    }


def expected_full(step: int, mb: float) -> dict[str, Any]:
    """The full arrays of ``step``, rebuilt from the step alone."""
    import torch

    sh = shapes(mb)
    g = torch.Generator().manual_seed(7919 * step + 17)
    return {
        "model.layers.0.w": torch.randn(sh["model.layers.0.w"], generator=g),
        "model.layers.0.v": torch.randn(sh["model.layers.0.v"], generator=g).to(torch.bfloat16),
        "model.emb": torch.randn(sh["model.emb"], generator=g) * 3 + 1,
        "opt.m": torch.rand(sh["opt.m"], generator=g),
        "opt.count": torch.randint(0, 2**40, sh["opt.count"], generator=g, dtype=torch.int64),
    }


# (name -> dim split over tp, or None for replicated)
SPLIT = {"model.layers.0.w": 0, "model.layers.0.v": 1, "model.emb": None, "opt.m": 0, "opt.count": None}


def layout_for(world: int) -> Any:
    import layoutckpt as lc

    mesh = lc.Mesh({"tp": world})
    return lc.Layout(
        mesh,
        [
            (r"layers\.0\.w$", lc.P("tp", None)),
            (r"layers\.0\.v$", lc.P(None, "tp")),
            (r"^opt\.m$", lc.P("tp")),
            (r".*", lc.P()),
        ],
    )


def build_state(step: int, world: int, rank: int, mb: float) -> dict[str, Any]:
    """This rank's shards (``torch.chunk`` pieces) of the step's state, plus JSON leaves."""
    full = expected_full(step, mb)
    local = {}
    for name, t in full.items():
        dim = SPLIT[name]
        if dim is None:
            local[name] = t
        else:
            pieces = t.chunk(world, dim=dim)
            assert len(pieces) == world, (name, t.shape, world)
            local[name] = pieces[rank].contiguous()
    return {
        "model": {
            "layers": [{"w": local["model.layers.0.w"], "v": local["model.layers.0.v"]}],
            "emb": local["model.emb"],
        },
        "opt": {"m": local["opt.m"], "count": local["opt.count"]},
        "step": step,
        "name": "crash-test",
    }


def flat_arrays(state: dict[str, Any]) -> dict[str, Any]:
    """The arrays of a (loaded) state by global name."""
    return {
        "model.layers.0.w": state["model"]["layers"][0]["w"],
        "model.layers.0.v": state["model"]["layers"][0]["v"],
        "model.emb": state["model"]["emb"],
        "opt.m": state["opt"]["m"],
        "opt.count": state["opt"]["count"],
    }


# --- phase hooks -------------------------------------------------------------------------------


def die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # not reached


def event(*words: object) -> None:
    """One timestamped line on stdout, written with a single ``write`` so threads never interleave.

    The stamp is ``time.monotonic()``, one clock for every process of the machine, so the harness
    compares it with its own."""
    os.write(1, (" ".join(map(str, words)) + f" @{time.monotonic():.6f}\n").encode())


_seen: set[str] = set()


def trace(phase: str) -> None:
    if phase not in _seen:
        _seen.add(phase)
        event("PHASE", phase)


class _KillingStore:
    """A TensorStore proxy: counts the writes issued through it and dies after the ``n``-th landed."""

    def __init__(self, store: Any, state: dict[str, int]) -> None:
        self._store = store
        self._state = state

    def __getitem__(self, index: Any) -> _KillingStore:
        return _KillingStore(self._store[index], self._state)

    def write(self, data: Any, **kwargs: Any) -> Any:
        w = self._store.write(data, **kwargs)
        self._state["writes"] += 1
        if self._state["writes"] >= self._state["n"]:
            w.result()  # this write's chunks are on disk in the tmp dir
            die()
        return w


class _KillingOpen:
    def __init__(self, future: Any, state: dict[str, int]) -> None:
        self._future = future
        self._state = state

    def result(self) -> _KillingStore:
        return _KillingStore(self._future.result(), self._state)


class _CommitComm:
    """The commit's communicator on a rank other than 0, dying after the agreement or the status."""

    def __init__(self, comm: Any, tmp: Any, final: Any, phase: str) -> None:
        self._comm = comm
        self._tmp = tmp.root  # the local staging directory and destination (LocalDir)
        self._final = final.root
        self._phase = phase

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)

    def all_reduce(self, values: Any, op: str) -> Any:
        out = self._comm.all_reduce(values, op)
        if self._phase == "after-marker" and out == [0]:
            # The ranks agreed: rank 0 now commits without us. Die once the marker is written.
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                if (self._tmp / "zarr.json").exists() or (self._final / "zarr.json").exists():
                    break
                time.sleep(0.001)
            die()
        return out

    def broadcast_bytes(self, data: Any) -> Any:
        out = self._comm.broadcast_bytes(data)
        if self._phase == "after-rename":
            die()
        return out


def install_hooks(rank: int, kill_at: str | None, kill_rank: int) -> None:
    """Trace every phase on this rank; in the ``kill_rank`` process, also die at ``kill_at``."""
    from layoutckpt import _manager, _save
    from layoutckpt.storage import _shardfile, _store
    from layoutckpt.torch import _staging

    kill = kill_at if rank == kill_rank else None

    # Staging takes one pooled host buffer per shard; the 2nd means one shard is on its way.
    acquire = _staging.HostBuffers.acquire
    acquired = [0]

    def traced_acquire(self: Any, *args: Any, **kwargs: Any) -> Any:
        trace("stage")
        acquired[0] += 1
        if kill == "stage" and acquired[0] == 2:
            die()
        return acquire(self, *args, **kwargs)

    _staging.HostBuffers.acquire = traced_acquire

    write = _save._write

    def traced_write(*args: Any, **kwargs: Any) -> Any:
        trace("write")
        return write(*args, **kwargs)

    _save._write = traced_write

    open_array = _store.open_array
    writes = {"writes": 0, "n": 2}

    def killing_open(*args: Any, **kwargs: Any) -> Any:
        fut = open_array(*args, **kwargs)
        return _KillingOpen(fut, writes) if kill == "write" else fut

    _store.open_array = killing_open

    write_shard = _shardfile.write_shard
    lock = threading.Lock()

    def killing_write_shard(*args: Any, **kwargs: Any) -> Any:
        out = write_shard(*args, **kwargs)  # this shard file is whole in the tmp dir
        with lock:
            writes["writes"] += 1
            if kill == "write" and writes["writes"] >= writes["n"]:
                die()
        return out

    _shardfile.write_shard = killing_write_shard

    commit = _save._commit

    def traced_commit(comm: Any, tmp: Any, final: Any, *args: Any, **kwargs: Any) -> Any:
        trace("agree")
        if rank != 0 and kill == "before-marker":
            die()
        if rank != 0 and kill in ("after-marker", "after-rename"):
            comm = _CommitComm(comm, tmp, final, kill)
        return commit(comm, tmp, final, *args, **kwargs)

    _save._commit = traced_commit

    # The commit marker is the root zarr.json of the temporary directory; every rank fsyncs its
    # own files before it agrees, so the marker (not an fsync) is the landmark.
    write_file = _store.write_file

    def traced_write_file(path: Path, *args: Any, **kwargs: Any) -> Any:
        if Path(path).name == "zarr.json" and ".tmp-" in Path(path).parent.name:
            trace("marker")
            if kill == "before-marker":
                die()
        return write_file(path, *args, **kwargs)

    _store.write_file = traced_write_file

    commit_dir = _store.commit_dir

    def traced_commit_dir(*args: Any, **kwargs: Any) -> Any:
        trace("rename")
        if kill == "after-marker":
            die()
        out = commit_dir(*args, **kwargs)
        trace("renamed")
        if kill == "after-rename":
            die()
        return out

    _store.commit_dir = traced_commit_dir

    retire = _manager._retire_dir

    def traced_retire(*args: Any, **kwargs: Any) -> Any:
        trace("retire")
        return retire(*args, **kwargs)

    _manager._retire_dir = traced_retire


# --- main --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--init", required=True, help="file for init_method=file:// (must not exist yet)")
    ap.add_argument("--root", required=True)
    ap.add_argument("--step", type=int, required=True)
    ap.add_argument("--kill-at", choices=PHASES)
    ap.add_argument("--kill-rank", type=int, default=0)
    ap.add_argument("--mb", type=float, default=20.0, help="size of the full state in MiB")
    args = ap.parse_args(argv)

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    import layoutckpt as lc

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{args.init}", rank=args.rank, world_size=args.world)
    install_hooks(args.rank, args.kill_at, args.kill_rank)

    mgr = lc.CheckpointManager(args.root, keep_last=KEEP_LAST)
    state = build_state(args.step, args.world, args.rank, args.mb)
    layout = layout_for(args.world)
    event("SAVING", args.step)
    mgr.save(
        args.step,
        state,
        layout,
        metadata={"step": args.step, "world": args.world, "mb": args.mb},
        rank_state={"rank": args.rank, "step": args.step},
    )
    event("STAGED", args.step)
    mgr.wait()
    event("COMMITTED", args.step)
    mgr.close()
    sys.stdout.flush()
    sys.stderr.flush()
    # No process-group teardown: a peer may already be gone, and nothing is left to agree on.
    os._exit(0)


def _child(request: dict[str, Any]) -> None:
    """In a forked child of the server: become an independent rank process, run it, never return."""
    rc = 1
    try:
        os.setpgid(0, 0)
        for fd, path, flags in (
            (0, os.devnull, os.O_RDONLY),
            (1, request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
            (2, request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        ):
            opened = os.open(path, flags, 0o644)
            os.dup2(opened, fd)
            os.close(opened)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        rc = main(request["argv"])
    except SystemExit as exit_:
        rc = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported on the child's stderr
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)


def serve() -> int:
    """The fork server (see the module docstring); exits, killing its children, when stdin closes."""
    import json
    import select

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed

    import layoutckpt  # noqa: F401 - preloaded for the children

    torch.set_num_threads(1)

    def say(line: str) -> None:
        os.write(1, (line + "\n").encode())

    children: dict[int, int] = {}
    pending = b""
    say("READY")
    while True:
        readable, _, _ = select.select([0], [], [], 0.002)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.pop(pid, None)
            say(f"EXIT {pid} {os.waitstatus_to_exitcode(status)}")
        if not readable:
            continue
        data = os.read(0, 1 << 16)
        if not data:
            break
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(request)
            try:
                os.setpgid(pid, pid)  # also here, so a kill right after STARTED reaches the group
            except OSError:
                pass
            children[pid] = request["id"]
            say(f"STARTED {request['id']} {pid}")
    for pid in children:
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(serve() if sys.argv[1:] == ["--serve"] else main())
