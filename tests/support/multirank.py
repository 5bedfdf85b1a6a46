"""A pool of real ``torch.distributed`` (gloo) processes that tests send work to.

Starting processes costs seconds, so one pool of ``size`` ranks lives for the whole session.
Every prefix of its ranks forms a process group (``groups[k]`` holds ranks ``0..k-1``), so one
pool runs saves and loads on any world size from 1 to ``size``: the library is called with
``group=`` exactly as a job with that many ranks would call it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any


def leave_world() -> None:
    """End a spawned rank whose results are out: destroy its process groups; the rank then ends
    through the interpreter's shutdown, as any process does.

    That is safe after the library's collectives: each returns only once gloo's worker threads
    hold none of its tensors (``layoutckpt/torch/_dist.py`` says why that matters). A rank whose
    very last step is a torch collective of its own (``all_gather_object``, a DTensor's
    ``full_tensor``) on a group that outlives ``destroy_process_group`` (a ``DeviceMesh`` keeps
    its groups) can still abort as it exits; such a rank ends on a library call, or hands its
    result back without a collective.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


class RankFailure(AssertionError):
    """A task raised on some rank; the message holds every rank's traceback."""


def _worker(rank: int, size: int, init_file: str, inbox: Any, outbox: Any) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
    groups = {k: dist.new_group(list(range(k))) for k in range(1, size + 1)}
    outbox.put((rank, "ready", None))
    while True:
        task = inbox.get()
        if task is None:
            break
        fn, k, args = task
        try:
            outbox.put((rank, "ok", fn(rank, groups[k], *args)))
        except BaseException:  # noqa: BLE001 - every failure goes back to the test
            outbox.put((rank, "err", traceback.format_exc()))
    outbox.close()
    outbox.join_thread()  # what the queue's feeder thread still holds, sent before leaving
    leave_world()


class RankPool:
    def __init__(self, size: int) -> None:
        self.size = size
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._dir = tempfile.mkdtemp(prefix="lc-pool-")
        init_file = os.path.join(self._dir, "init")
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(self.size)]
        self._procs = [
            ctx.Process(target=_worker, args=(r, self.size, init_file, self._inboxes[r], self._outbox), daemon=True)
            for r in range(self.size)
        ]
        for p in self._procs:
            p.start()
        for _ in range(self.size):
            rank, status, _ = self._outbox.get(timeout=180)
            assert status == "ready", (rank, status)

    def run(self, fn: Callable[..., Any], nranks: int, *args: Any, timeout: float = 120) -> list[Any]:
        """Run ``fn(rank, group, *args)`` on ranks ``0..nranks-1``; their results, by rank."""
        assert 1 <= nranks <= self.size
        for r in range(nranks):
            self._inboxes[r].put((fn, nranks, args))
        results: dict[int, tuple[str, Any]] = {}
        try:
            while len(results) < nranks:
                rank, status, value = self._outbox.get(timeout=timeout)
                results[rank] = (status, value)
        except queue.Empty:
            self.restart()
            raise RankFailure(f"{fn.__name__} on {nranks} ranks hung for {timeout}s; got {sorted(results)}") from None
        errors = {r: v for r, (s, v) in sorted(results.items()) if s == "err"}
        if errors:
            raise RankFailure("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in errors.items()))
        return [results[r][1] for r in range(nranks)]

    def run_expecting_errors(self, fn: Callable[..., Any], nranks: int, *args: Any) -> list[str]:
        """Run a task every rank of which must raise; their tracebacks, by rank."""
        try:
            self.run(fn, nranks, *args)
        except RankFailure as failure:
            text = str(failure)
            chunks = text.split("--- rank ")[1:]
            if len(chunks) != nranks:
                raise AssertionError(f"only {len(chunks)} of {nranks} ranks raised:\n{text}") from None
            return [c.split("---\n", 1)[1] for c in chunks]
        raise AssertionError(f"{fn.__name__} raised on no rank")

    def restart(self) -> None:
        self.close()
        self._start()

    def close(self) -> None:
        for q in self._inboxes:
            q.put(None)
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()


# --- fresh worlds: mp.spawn, for tests whose ranks need a world of their own (pipelining, FSDP2)


def _spawned_rank(rank: int, fn: Callable[..., Any], world: int, out: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import pickle
    from pathlib import Path

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/init-{fn.__name__}", rank=rank, world_size=world)
    try:
        result = fn(rank, world, Path(out))
        if rank == 0:
            with open(Path(out) / f"{fn.__name__}.pkl", "wb") as f:
                pickle.dump(result, f)
    except BaseException:
        dist.destroy_process_group()
        raise  # to mp.spawn, which reports it
    leave_world()
    # These ranks end on torch's own collectives (a DTensor's ``full_tensor`` on a DeviceMesh
    # group), whose tensors the library cannot let go of; gloo's worker freeing them during the
    # interpreter's shutdown aborts about one world in forty ("terminate called without an active
    # exception"). The result is on disk, so the rank skips that shutdown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn: Callable[..., Any], world: int, out: os.PathLike[str]) -> Any:
    """Run ``fn(rank, world, out)`` on a fresh gloo world of ``world`` ranks; rank 0's result
    (pickled by the test's own process: nothing here reads a checkpoint)."""
    import pickle

    import torch.multiprocessing as torch_mp

    torch_mp.spawn(_spawned_rank, args=(fn, world, os.fspath(out)), nprocs=world, join=True)
    with open(os.path.join(out, f"{fn.__name__}.pkl"), "rb") as f:
        return pickle.load(f)
