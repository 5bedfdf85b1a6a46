"""Kill every rank of a tiered run at a random moment, restart, and check what it resumes from.

Two ranks save every step to their own local directory (a node-local disk each) and persist
every 5th step to S3 (the loopback server); SIGKILL hits both at a random time. The restarted
job must resume from the newest step committed on every rank's fast tier, or on S3, bit for bit:
never older than the last step both ranks reported committed, never a step one rank lacks.
The restarted job trains on and is killed again; a last restart checks once more.

    python tests/crash/test_tiers_crash.py RANK WORLD INIT DURABLE LOCAL START STOP   (a rank)
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORLD = 2


def _state(step: int, rank: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(9000 + step)
    w = torch.randn(64, 256, generator=g)
    return {"w": w.chunk(WORLD)[rank].clone(), "b": torch.randn(300, generator=g).to(torch.bfloat16), "step": step}


def _layout():
    import layoutckpt as lc

    return lc.Layout(lc.Mesh({"tp": WORLD}), [(r"^w$", lc.P("tp", None)), (r".*", lc.P())])


def main(argv: list[str]) -> None:
    """One rank: resume (checking the restored state bit for bit), then save steps until killed."""
    rank, world, init, durable, local, stop = int(argv[0]), int(argv[1]), argv[2], argv[3], argv[4], int(argv[5])
    import torch
    import torch.distributed as dist

    import layoutckpt as lc

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    with lc.CheckpointManager(durable, local=local, persist_every=5, replicas=1, keep_last=3) as mgr:
        start = mgr.latest_step()
        if start is not None:
            out = mgr.load(_layout())
            want = _state(start, rank)
            exact = all(torch.equal(out[k].view(torch.uint8), want[k].view(torch.uint8)) for k in ("w", "b"))
            print(
                f"RESTORED {start} {mgr.tier_metrics().restored_from} {int(exact and out['step'] == start)}", flush=True
            )
        for step in range((start or 0) + 1, stop):
            mgr.save(step, _state(step, rank), _layout()).result()  # committed on this rank's fast tier
            print(f"COMMITTED {step}", flush=True)
    dist.destroy_process_group()


def _job(tmp: Path, durable: str, env: dict, stop: int, tag: str) -> list[subprocess.Popen]:
    init = tmp / f"init-{tag}"
    local = os.fspath(tmp / "node{rank}")
    argv = [str(WORLD), str(init), durable, local, str(stop)]
    procs = []
    for r in range(WORLD):
        with open(tmp / f"{tag}-{r}.out", "w") as out, open(tmp / f"{tag}-{r}.err", "w") as err:
            procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, str(r), *argv],
                    stdout=out,
                    stderr=err,
                    env={**env, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
                    cwd=ROOT,
                    start_new_session=True,
                )
            )
    return procs


def _lines(tmp: Path, tag: str, rank: int) -> list[list[str]]:
    return [line.split() for line in (tmp / f"{tag}-{rank}.out").read_text().splitlines() if line]


def _committed(tmp: Path, tag: str) -> int:
    """The newest step every rank reported committed on its fast tier (0 for none)."""
    return min(max([int(w[1]) for w in _lines(tmp, tag, r) if w[0] == "COMMITTED"], default=0) for r in range(WORLD))


def _run_and_kill(tmp: Path, durable: str, env: dict, tag: str, rng: random.Random) -> None:
    """Start the job, wait until it commits a few steps, then SIGKILL every rank at once."""
    procs = _job(tmp, durable, env, 10_000, tag)
    deadline = time.monotonic() + 90
    while _committed(tmp, tag) < 3 and time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), (tmp / f"{tag}-0.err").read_text()[-3000:]
        time.sleep(0.05)
    time.sleep(rng.uniform(0.0, 1.5))
    for p in procs:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def _restored(tmp: Path, tag: str) -> list[tuple[int, str, int]]:
    return [next((int(w[1]), w[2], int(w[3])) for w in _lines(tmp, tag, r) if w[0] == "RESTORED") for r in range(WORLD)]


@pytest.mark.parametrize("seed", [1])
def test_kill_all_ranks_at_random_then_resume_newest_complete_step(tmp_path, seed):
    from tests.support.s3server import running

    rng = random.Random(seed)
    with running("crash-tiers") as s3:
        env = {**os.environ, **s3.env}
        durable = f"s3://crash-tiers/run-{uuid.uuid4().hex[:8]}"
        _run_and_kill(tmp_path, durable, env, "a", rng)
        floor = _committed(tmp_path, "a")
        _run_and_kill(tmp_path, durable, env, "b", rng)  # resumes (and checks), trains on, killed again
        (step0, _, exact0), (step1, _, exact1) = _restored(tmp_path, "b")
        assert step0 == step1 >= floor and exact0 == exact1 == 1, _restored(tmp_path, "b")
        floor = _committed(tmp_path, "b")
        # The last restart wipes rank 1's local disk first: its piece comes from rank 0's replica.
        import shutil

        shutil.rmtree(tmp_path / "node1")
        procs = _job(tmp_path, durable, env, 0, "c")
        assert [p.wait(120) for p in procs] == [0, 0], (tmp_path / "c-1.err").read_text()[-3000:]
        restored = _restored(tmp_path, "c")
        assert restored[0][0] == restored[1][0] >= floor and all(r[2] == 1 for r in restored), restored
        assert [r[1] for r in restored] in (["local", "peer"], ["durable", "durable"]), restored


if __name__ == "__main__":
    main(sys.argv[1:])
