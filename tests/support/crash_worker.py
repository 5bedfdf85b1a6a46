"""One rank of a checkpointing job that saves one step through a ``CheckpointManager``, and can
be killed (SIGKILL, no cleanup of any kind) at a chosen phase of that save.

    python tests/support/crash_worker.py --rank R --world N --init FILE --root ROOT --step S \
        [--kill-at PHASE] [--kill-rank R] [--mb MB]

The job saves a deterministic state (``build_state``): every value comes from a
``torch.Generator`` seeded by the step, so any reader rebuilds the expected full arrays with
``expected_full(step, mb)`` and compares bit for bit. Arrays are sharded over the ``tp`` axis (rows,
columns, an uneven 1-D split) or replicated.

The worker prints, on stdout, one line per event, stamped ``@<time.monotonic()>``:
``SAVING S`` right before ``mgr.save``; ``PHASE <name>`` the first time this rank reaches a phase of
the save (``stage``, ``write``, ``agree``, and on rank 0 ``marker``, ``rename``, ``renamed``,
``retire``); ``STAGED S`` when ``mgr.save`` returned; ``COMMITTED S`` after ``mgr.wait()``; on a
failure ``FAILED`` with the error, then ``CAUSE`` with its ``__cause__`` (or ``None``).

Phase kills (only in the process of ``--kill-rank``) are hooks on the library's fault points
(``layoutckpt/base/_faults.py``), installed for the life of the process:

==============  ========================================  =========================================
phase           rank 0                                    any other rank
==============  ========================================  =========================================
stage           taking its 2nd staging buffer             same
                (``save.stage_buffer``)
write           after its 2nd box landed, a shard file    same
                or a TensorStore write
                (``save.box_written``)
before-marker   about to write the marker, the ranks      its writes are done and durable, but it
                agreed (``commit.marker``)                has not agreed (``save.agree``)
after-marker    the marker is in the tmp dir, not yet     the ranks agreed (``save.agreed``), and
                renamed (``commit.publish``)              rank 0 has written the marker
after-rename    the tmp dir was renamed into place        rank 0 broadcast the commit's status
                (``commit.published``)                    (``save.committed``)
before-plan     right after ``SAVING``, before the save   same
                call: the others agree on the plan
                without it
at-agree        its writes are done and durable, before   same
                the ranks agree to commit
                (``save.agree``)
==============  ========================================  =========================================

``python tests/support/crash_worker.py --serve`` is a fork server for the same workers: it imports torch
and layoutckpt once, then forks one child per request read on stdin (a JSON line ``{"id", "argv",
"out", "err"}``); each child takes its own process group, sends stdout/stderr to the named files
and runs ``main(argv)``. The server answers ``READY``, ``STARTED <id> <pid>`` and
``EXIT <pid> <returncode>`` lines. A job then starts in tens of milliseconds instead of seconds of
``import torch``, and the children are killed with SIGKILL exactly like cold-started ones.

Other modes (``--mode``), each of one process unless said otherwise, for kills timed by the harness:

- ``save`` / ``save_async``: ``lc.save`` (or ``lc.save_async(...).result()``) of the step into
  ``ROOT/step_%08d`` without a manager, in a world of one (``--init none``: no
  ``torch.distributed``) or of ``--world`` ranks; events ``SAVING``, ``STAGED`` (async), ``COMMITTED``.

``--sync`` makes the manager of ``--mode manager`` save synchronously (``async_save=False``): the
ranks then agree to commit over the process group, as ``lc.save`` does, instead of the store.
- ``retain``: a ``CheckpointManager(ROOT, keep_last=K)`` over a root of many committed steps
  saves one more (``build_many``: ``--arrays`` small arrays, so that each step is many files)
  synchronously, and waits for the retention that deletes the old ones: ``RETAINING``, then
  ``PHASE retire`` before the first delete, ``RETAINED`` once retention is done.
- ``restart``: only starts a ``CheckpointManager(ROOT)`` (which takes the lock and removes or
  restores the leftovers of crashes) and closes it: ``STARTING``, ``STARTED``.

Every mode ends with ``PEAK <kB>`` (the process's peak resident size) on success or failure.

Expected outcomes: the step is committed only for ``after-rename`` on any rank and for
``after-marker`` on a rank other than 0 (rank 0 needs nobody once the ranks agreed); every other
kill (``before-plan`` and ``at-agree`` included) leaves it invisible. ``expected_outcome`` says so for the harness.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

PHASES = ("stage", "write", "before-marker", "after-marker", "after-rename", "before-plan", "at-agree")
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


def build_many(step: int, arrays: int) -> dict[str, Any]:
    """A state of ``arrays`` small float32 arrays (a file or two each once saved), from the step alone."""
    import torch

    g = torch.Generator().manual_seed(104729 * step + 3)
    return {"p": {f"a{i:03d}": torch.randn(16 + i % 7, generator=g) for i in range(arrays)}, "step": step}


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


def _wait_for_marker(staging: str, final: str) -> None:
    """Until rank 0 has written the commit marker (in the tmp dir, or renamed already)."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if (Path(staging) / "zarr.json").exists() or (Path(final) / "zarr.json").exists():
            return
        time.sleep(0.001)


_INSTALLED = contextlib.ExitStack()  # the hooks stay for the life of the process
_KILL_AT: list[str] = []  # the phase this process dies at, for the kills outside the library


def saving(step: int) -> None:
    """Print ``SAVING``; the process of a ``before-plan`` kill dies right after."""
    event("SAVING", step)
    if _KILL_AT == ["before-plan"]:
        die()


def install_hooks(rank: int, kill_at: str | None, kill_rank: int) -> None:
    """Trace every phase on this rank; in the ``kill_rank`` process, also die at ``kill_at``."""
    from layoutckpt.base import _faults

    kill = kill_at if rank == kill_rank else None
    _KILL_AT[:] = [kill] if kill else []
    counts = {"buffers": 0, "boxes": 0}
    lock = threading.Lock()

    def counted(what: str) -> int:
        with lock:
            counts[what] += 1
            return counts[what]

    def stage_buffer(**_: Any) -> None:
        trace("stage")
        # Staging takes one pooled host buffer per box; the 2nd means one box is on its way.
        if counted("buffers") == 2 and kill == "stage":
            die()

    def box_written(**_: Any) -> None:
        if counted("boxes") >= 2 and kill == "write":
            die()  # this box is whole in the tmp dir

    def agree(**_: Any) -> None:
        trace("agree")
        if (rank != 0 and kill == "before-marker") or kill == "at-agree":
            die()

    def agreed(staging: str, final: str, **_: Any) -> None:
        if rank != 0 and kill == "after-marker":
            _wait_for_marker(staging, final)  # rank 0 now commits without us
            die()

    def marker(**_: Any) -> None:
        trace("marker")
        if kill == "before-marker":
            die()

    def publish(**_: Any) -> None:
        trace("rename")
        if kill == "after-marker":
            die()

    def published(**_: Any) -> None:
        trace("renamed")
        if kill == "after-rename":
            die()

    def committed(**_: Any) -> None:
        if rank != 0 and kill == "after-rename":
            die()

    hooks = {
        "save.stage_buffer": stage_buffer,
        "save.write": lambda **_: trace("write"),
        "save.box_written": box_written,
        "save.agree": agree,
        "save.agreed": agreed,
        "commit.marker": marker,
        "commit.publish": publish,
        "commit.published": published,
        "save.committed": committed,
        "manager.retire": lambda **_: trace("retire"),
    }
    _INSTALLED.enter_context(_faults.hooks(hooks))


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
    ap.add_argument("--timeout", type=float, help="the manager's timeout= for its saves, in seconds")
    ap.add_argument("--busy", type=float, default=0.0, help="seconds the main thread spins before mgr.wait()")
    ap.add_argument("--mode", choices=MODES, default="manager")
    ap.add_argument("--keep-last", type=int, default=KEEP_LAST, help="retention of --mode retain")
    ap.add_argument("--arrays", type=int, default=32, help="arrays of the state of --mode retain")
    ap.add_argument("--packing", choices=("auto", "files", "ocdbt"), default="auto", help="save's packing=")
    ap.add_argument("--sync", action="store_true", help="the manager saves synchronously (async_save=False)")
    args = ap.parse_args(argv)

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    import layoutckpt as lc

    torch.set_num_threads(1)
    # A tcp:// rendezvous puts the store in rank 0's process, as torchrun's env:// does.
    if args.init != "none":  # "none": a world of one without torch.distributed
        init = args.init if args.init.startswith("tcp://") else f"file://{args.init}"
        dist.init_process_group("gloo", init_method=init, rank=args.rank, world_size=args.world)
    install_hooks(args.rank, args.kill_at, args.kill_rank)
    try:
        MODES[args.mode](args, lc)
    except Exception as err:
        event("FAILED", repr(f"{type(err).__name__}: {err}"))
        cause = err.__cause__
        event("CAUSE", repr(f"{type(cause).__name__}: {cause}") if cause is not None else "None")
        event("PEAK", _peak_kb())
        raise
    event("PEAK", _peak_kb())
    sys.stdout.flush()
    sys.stderr.flush()
    # No process-group teardown: a peer may already be gone, and nothing is left to agree on.
    os._exit(0)


def _save_one_step(args: argparse.Namespace, lc: Any) -> None:
    options = {} if args.timeout is None else {"timeout": args.timeout}
    mgr = lc.CheckpointManager(
        args.root, keep_last=KEEP_LAST, packing=args.packing, async_save=not args.sync, **options
    )
    state = build_state(args.step, args.world, args.rank, args.mb)
    layout = layout_for(args.world)
    saving(args.step)
    mgr.save(
        args.step,
        state,
        layout,
        metadata={"step": args.step, "world": args.world, "mb": args.mb},
        rank_state={"rank": args.rank, "step": args.step},
    )
    event("STAGED", args.step)
    # A training loop's main thread keeps the GIL busy while the commit runs in the background.
    spin_until = time.monotonic() + args.busy
    while time.monotonic() < spin_until:
        pass
    mgr.wait()
    event("COMMITTED", args.step)
    mgr.close()


def _peak_kb() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _plain_save(args: argparse.Namespace, lc: Any, *, asynchronous: bool) -> None:
    """``lc.save`` or ``lc.save_async`` of the step, no manager (``--mode save``/``save_async``)."""
    path = Path(args.root) / f"step_{args.step:08d}"
    state = build_state(args.step, args.world, args.rank, args.mb)
    options = dict(
        metadata={"step": args.step, "world": args.world, "mb": args.mb},
        rank_state={"rank": args.rank, "step": args.step},
        packing=args.packing,
    )
    if args.timeout is not None:
        options["timeout"] = args.timeout
    saving(args.step)
    if asynchronous:
        fut = lc.save_async(path, state, layout_for(args.world), **options)
        event("STAGED", args.step)
        fut.result()
    else:
        lc.save(path, state, layout_for(args.world), **options)
    event("COMMITTED", args.step)


def _retain(args: argparse.Namespace, lc: Any) -> None:
    """Save one more step under ``keep_last`` and wait for the retention it sets off (``--mode retain``)."""
    mgr = lc.CheckpointManager(args.root, keep_last=args.keep_last, async_save=False)
    event("RETAINING", args.step)
    mgr.save(args.step, build_many(args.step, args.arrays), metadata={"step": args.step, "arrays": args.arrays})
    event("COMMITTED", args.step)
    mgr.wait()
    event("RETAINED", args.step)
    mgr.close()


def _restart(args: argparse.Namespace, lc: Any) -> None:
    """Start a manager on the root, cleaning up its leftovers, and close it (``--mode restart``)."""
    event("STARTING")
    mgr = lc.CheckpointManager(args.root)
    event("STARTED", *mgr.steps())
    mgr.close()


MODES = {
    "manager": _save_one_step,
    "save": lambda args, lc: _plain_save(args, lc, asynchronous=False),
    "save_async": lambda args, lc: _plain_save(args, lc, asynchronous=True),
    "retain": _retain,
    "restart": _restart,
}


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
