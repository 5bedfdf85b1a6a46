"""Randomized kill stress for ``CheckpointManager`` saves: many jobs, each SIGKILLed at a random
moment of its save, each followed by ``verify`` (what the crash left) and a restart (the next step
commits, the leftovers are gone, retention is right).

    .venv/bin/python tools/stress_kill.py --runs 60 --world 2 --seed 0

One training run on one root: the job saving step ``s`` is killed (one random rank, or all ranks),
a random delay in [0, T] after every rank printed ``SAVING s``, where T is the measured duration
of an unkilled save (the median of three); the rest of the job is killed ``--grace`` seconds
later. The restart saves ``s + 1``; the next run kills the save of ``s + 2``. Prints one line per
run, then a summary (kills by the phase the killed rank had reached and by delay bucket,
committed vs invisible outcomes, violations) and exits 1 on any violation. ``--launcher fork``
forks ranks from a server with torch imported (much faster); ``popen`` (the default) starts every
rank cold.
"""

from __future__ import annotations

import argparse
import collections
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

# Run as a script from tools/: the repository root on the path makes ``tests.support`` importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support import crash_harness as ch


@dataclass
class Row:
    run: int
    step: int
    target: str
    delay: float
    fraction: float
    phase: str
    outcome: str
    problems: list[str] = field(default_factory=list)


BUCKETS = ["0-25%", "25-50%", "50-75%", "75-100%"]


def bucket(fraction: float) -> str:
    return BUCKETS[min(3, int(fraction * 4))]


def phase_of(job: ch.JobResult, kill: ch.RandomKill) -> str:
    """How far the killed rank (for all ranks: rank 0, the committer) had got when killed."""
    rank = kill.targets[0] if len(kill.targets) == 1 else 0
    if job.returncodes[rank] == 0:
        return "exited"
    return job.progress(rank, before=job.kill_time)


def table(title: str, rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [title, line.format(*header), line.format(*("-" * w for w in widths))]
    out += [line.format(*map(str, r)) for r in rows]
    return "\n".join(out)


def summary(rows: list[Row], args: argparse.Namespace, horizon: float, seconds: float) -> str:
    parts = [
        f"stress_kill: {len(rows)} runs, world {args.world}, seed {args.seed}, {args.mb} MiB state, "
        f"launcher {args.launcher}, T = {horizon * 1000:.0f} ms, {seconds:.0f} s"
    ]
    kinds = ("rank 0", "other rank", "all ranks")

    def kind(r: Row) -> str:
        return "all ranks" if r.target == "all" else "rank 0" if r.target == "rank0" else "other rank"

    def counts(key, order: list[str]) -> list[list[str]]:
        groups: dict[str, list[Row]] = collections.defaultdict(list)
        for r in rows:
            groups[key(r)].append(r)
        out = []
        for name in sorted(groups, key=lambda n: order.index(n) if n in order else len(order)):
            g = groups[name]
            by_kind = [str(sum(kind(r) == k for r in g)) for k in kinds]
            out.append(
                [
                    name,
                    str(len(g)),
                    *by_kind,
                    str(sum(r.outcome == "committed" for r in g)),
                    str(sum(r.outcome == "invisible" for r in g)),
                    str(sum(bool(r.problems) for r in g)),
                ]
            )
        return out

    header = ["kills", *kinds, "committed", "invisible", "violations"]
    parts.append(
        table(
            "\nby the phase the killed rank had reached:",
            counts(lambda r: r.phase, [*ch.ORDER, "exited"]),
            ["phase", *header],
        )
    )
    parts.append(
        table(
            "\nby delay after SAVING (fraction of T):",
            counts(lambda r: bucket(r.fraction), BUCKETS),
            ["delay", *header],
        )
    )
    failed = [r for r in rows if r.problems]
    parts.append(
        f"\ntotal: {len(rows)} kills, {sum(r.outcome == 'committed' for r in rows)} committed, "
        f"{sum(r.outcome == 'invisible' for r in rows)} invisible, {len(failed)} runs with violations"
    )
    for r in failed:
        parts.append(f"\nrun {r.run} (step {r.step}, kill {r.target} at {r.delay:.3f}s, {r.phase}):")
        parts += [f"  - {p}" for p in r.problems]
    return "\n".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=60)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mb", type=float, default=20.0, help="size of the saved state in MiB")
    ap.add_argument("--grace", type=float, default=0.5, help="seconds before the rest of a job is killed")
    ap.add_argument("--launcher", choices=("popen", "fork"), default="popen")
    ap.add_argument("--workdir", help="default: a new temporary directory (removed unless a run failed)")
    args = ap.parse_args()

    rng = random.Random(args.seed)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="lc-stress-"))
    root, jobs = workdir / "root", workdir / "jobs"
    launcher = ch.ForkServer() if args.launcher == "fork" else ch.PopenLauncher()
    started = time.monotonic()
    rows: list[Row] = []
    try:
        # Three unkilled saves: the previous checkpoints, and T (their median duration).
        durations = []
        for step in (1, 2, 3):
            job = ch.run_job(launcher, root, step, args.world, jobs, mb=args.mb)
            if job.returncodes != [0] * args.world:
                print(f"an unkilled save failed:\n{job.describe()}", file=sys.stderr)
                return 2
            durations.append(job.save_seconds())
        horizon = statistics.median(durations)
        print(f"unkilled saves: {[round(d * 1000) for d in durations]} ms, T = {horizon * 1000:.0f} ms", flush=True)
        print(f"workdir {workdir}", flush=True)
        step = 4
        for run in range(args.runs):
            previous = max(ch.scan(root).committed)
            kill = ch.random_kill(rng, args.world, horizon)
            job = ch.run_job(launcher, root, step, args.world, jobs, mb=args.mb, random_kill=kill, grace=args.grace)
            verdict = ch.verify(root, step, previous, args.mb, job)
            problems = list(verdict.problems)
            if job.timed_out:
                problems.append("the killed job did not end")
            target = "all" if len(kill.targets) == args.world else f"rank{kill.targets[0]}"
            row = Row(run, step, target, kill.delay, kill.delay / horizon, phase_of(job, kill), verdict.outcome)
            snapshot = workdir / f"failure-{run:03d}"
            if problems:
                shutil.copytree(root, snapshot / "root", symlinks=True)
            problems += ch.verify_restart(launcher, root, step + 1, jobs, world=args.world, mb=args.mb)
            if problems:
                (snapshot / "job.txt").parent.mkdir(parents=True, exist_ok=True)
                (snapshot / "job.txt").write_text(job.describe() + "\n\n" + "\n".join(problems))
            else:
                shutil.rmtree(jobs, ignore_errors=True)
            row.problems = problems
            rows.append(row)
            print(
                f"run {run:3d}  step {step:4d}  kill {target:5s} at {kill.delay * 1000:6.1f} ms "
                f"({row.fraction:4.0%} of T)  reached {row.phase:9s} -> {row.outcome:9s}  "
                f"{'VIOLATION: ' + '; '.join(problems) if problems else 'ok'}",
                flush=True,
            )
            step += 2
    finally:
        launcher.close()
    print("\n" + summary(rows, args, horizon, time.monotonic() - started))
    if any(r.problems for r in rows):
        print(f"\nfailure snapshots under {workdir}")
        return 1
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
