"""Randomized kill stress for ``CheckpointManager`` saves: many jobs, each SIGKILLed at a random
moment of its save, each followed by ``verify`` (what the crash left) and a restart (the next step
commits, the leftovers are gone, retention is right).

    .venv/bin/python tools/stress_kill.py --runs 60 --world 2 --seed 0
    .venv/bin/python tools/stress_kill.py --mode survivor --runs 20 --launcher fork
    .venv/bin/python tools/stress_kill.py --mode retain --runs 30 --launcher fork

One training run on one root: the job saving step ``s`` is killed (one random rank, or all ranks),
a random delay in [0, T] after every rank printed ``SAVING s``, where T is the measured duration
of an unkilled save (the median of three); the rest of the job is killed ``--grace`` seconds
later. The restart saves ``s + 1``; the next run kills the save of ``s + 2``. Prints one line per
run, then a summary (kills by the phase the killed rank had reached and by delay bucket,
committed vs invisible outcomes, violations) and exits 1 on any violation. ``--launcher fork``
forks ranks from a server with torch imported (much faster); ``popen`` (the default) starts every
rank cold.

Other modes (``--mode``), each its own measured duration T (median of three unkilled runs):

- ``survivor``: one random rank of a ``--world`` job is killed during a manager save that is
  not torn down (``--grace`` is raised to outlast the save's ``--save-timeout``): every other
  rank must end on its own within twice that timeout (plus ``--slack``), with success if the step
  was committed and otherwise a ``SaveError`` naming the killed rank; and no corrupt commit.
- ``save``, ``save_async``: a world of one, ``lc.save``/``lc.save_async`` without a manager.
- ``retain``: a manager's retention deletes (``keep_last=2`` over six steps of many files),
  killed over the measured deletes.
- ``restart``: a manager starting on a root with a leftover of each kind, killed over its start.

Each of these runs on a fresh copy of its root and prints the figures the issue asks for:
trials, kills that landed, detected failures, silent corruptions, hangs and peak memory.
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
    ap.add_argument("--mode", choices=("manager", *OTHER_MODES), default="manager")
    ap.add_argument("--save-timeout", type=float, default=1.5, help="the survivors' timeout= (--mode survivor)")
    ap.add_argument("--slack", type=float, default=3.0, help="seconds a survivor may take beyond 2 x timeout")
    args = ap.parse_args()
    if args.mode != "manager":
        return other_mode(args)

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


# --- the other modes ---------------------------------------------------------------------------

OTHER_MODES = ("survivor", "save", "save_async", "retain", "restart")
ARRAYS = 32
KEEP = 2


@dataclass
class Trial:
    run: int
    delay: float
    fraction: float
    target: int
    landed: bool  # the target was killed (not already done)
    reached: str  # the furthest event the target had printed when killed
    outcome: str
    problems: list[str]
    hung: bool
    survivor_error: str = ""
    survivor_seconds: float | None = None  # from the kill to the end of the slowest survivor
    peak_kb: int = 0  # the largest peak resident size a rank printed
    silent: bool = False  # wrong data listed, a good step lost, or success reported for no commit


def _setup(args: argparse.Namespace, launcher: ch.Launcher, work: Path) -> tuple[Path, dict]:
    """The base root of the mode, and the keywords of its jobs."""
    base = work / "base"
    if args.mode in ("survivor", "save", "save_async"):
        ch.seed_root(base, [1], args.mb)
        if args.mode == "survivor":
            job = ch.run_job(launcher, base, 2, args.world, work / "jobs", mb=args.mb)
            if job.returncodes != [0] * args.world:
                raise SystemExit(f"an unkilled save failed:\n{job.describe()}")
            return base, dict(step=3, world=args.world, mode="manager", window=("SAVING", "COMMITTED"))
        return base, dict(step=2, world=1, mode=args.mode, window=("SAVING", "COMMITTED"))
    if args.mode == "retain":
        ch.seed_many(base, list(range(1, 7)), ARRAYS)
        extra = ["--keep-last", str(KEEP), "--arrays", str(ARRAYS)]
        return base, dict(step=7, world=1, mode="retain", extra=extra, window=("retire", "RETAINED"))
    ch.seed_many(base, [1, 2, 3], ARRAYS)
    ch.seed_leftovers(base, ARRAYS)
    return base, dict(step=0, world=1, mode="restart", window=("STARTING", "STARTED"))


def _job(args, launcher, root: Path, jobs: Path, spec: dict, kill: ch.RandomKill | None = None) -> ch.JobResult:
    options = dict(mode=spec["mode"], extra=spec.get("extra"), random_kill=kill)
    if args.mode == "survivor":
        options.update(grace=4 * args.save_timeout + 10, save_timeout=args.save_timeout)
    return ch.run_job(launcher, root, spec["step"], spec["world"], jobs, mb=args.mb, **options)


def _check(args, launcher, root: Path, jobs: Path, spec: dict, job: ch.JobResult, kill: ch.RandomKill) -> Trial:
    s = ch.scan(root)
    problems: list[str] = []
    outcome = "-"
    if args.mode in ("survivor", "save", "save_async"):
        verdict = ch.verify(root, spec["step"], spec["step"] - 1, args.mb, job)
        problems += verdict.problems
        outcome = verdict.outcome
    elif args.mode == "retain":
        if not {6, 7} <= set(s.committed) or not set(s.committed) <= set(range(1, 8)) or s.uncommitted:
            problems.append(f"after the kill: committed {s.committed}, uncommitted {s.uncommitted}")
        outcome = f"{7 - len(s.committed)} deleted, {sum('.del-' in n for n in s.leftovers)} half"
    else:
        aside = [n for n in s.leftovers if n.startswith(".step_00000004.old-")]
        if s.committed not in ([1, 2, 3], [1, 2, 3, 4]) or (4 not in s.committed and len(aside) != 1):
            problems.append(f"after the kill: committed {s.committed}, leftovers {s.leftovers}")
        outcome = "restored" if 4 in s.committed else "aside"
    for k in s.committed:
        problems += ch.check_committed(ch.step_path(root, k), k)
    target = kill.targets[0]
    landed = job.returncodes[target] == -9
    trial = Trial(
        0,
        kill.delay,
        0.0,
        target,
        landed,
        job.progress(target, before=job.kill_time) if landed else "exited",
        outcome,
        problems,
        bool(job.timed_out or job.torn_down),
        peak_kb=max((p for p in [*job.peak_kb(), *job.hwm_at_kill] if p is not None), default=0),
    )
    trial.silent = bool(problems)
    if args.mode == "survivor" and landed:
        limit = 2 * args.save_timeout + args.slack
        survivors = ch.survivor_problems(job, target, outcome == "committed", limit)
        trial.silent |= any("reported success" in p for p in survivors)
        trial.problems += survivors
        others = [r for r in range(job.world) if r != target]
        trial.survivor_error = ",".join(sorted({ch.survivor_error(job, r, target) for r in others}))
        ends = [job.events[r].get("FAILED", job.events[r].get("COMMITTED")) for r in others]
        if job.kill_time is not None and all(e is not None for e in ends):
            trial.survivor_seconds = max(ends) - job.kill_time
    # Then a restart: the next start (and, for saves, the next save) must succeed and clean up.
    if args.mode in ("save", "save_async") and outcome != "committed":
        redo = _job(args, launcher, root, jobs, spec)
        if redo.returncodes != [0]:
            trial.problems.append(f"the save could not be redone:\n{redo.describe()}")
    if args.mode == "survivor":
        trial.problems += ch.verify_restart(launcher, root, spec["step"] + 1, jobs, world=args.world, mb=args.mb)
    else:
        expected = {
            "save": [1, 2],
            "save_async": [1, 2],
            "retain": ch.scan(root).committed,
            "restart": [1, 2, 3, 4],
        }[args.mode]
        trial.problems += ch.restart_in_process(root, expected)
    return trial


def other_mode(args: argparse.Namespace) -> int:
    import resource

    rng = random.Random(args.seed)
    work = Path(args.workdir or tempfile.mkdtemp(prefix=f"lc-stress-{args.mode}-"))
    launcher = ch.ForkServer() if args.launcher == "fork" else ch.PopenLauncher()
    started = time.monotonic()
    trials: list[Trial] = []
    try:
        base, spec = _setup(args, launcher, work)
        start, end = spec["window"]
        durations = []
        for i in range(3):
            root = ch.copy_root(base, work / f"measure-{i}")
            job = _job(args, launcher, root, work / "jobs", spec)
            if any(rc != 0 for rc in job.returncodes):
                print(f"an unkilled run failed:\n{job.describe()}", file=sys.stderr)
                return 2
            durations.append(job.span(start, end))
            shutil.rmtree(root)
        horizon = statistics.median(durations)
        print(
            f"mode {args.mode}: unkilled {start}->{end}: {[round(d * 1000) for d in durations]} ms, "
            f"T = {horizon * 1000:.0f} ms; workdir {work}",
            flush=True,
        )
        for run in range(args.runs):
            root = ch.copy_root(base, work / f"run-{run:03d}")
            target = rng.randrange(spec["world"])
            kill = ch.RandomKill([target], rng.uniform(0.0, horizon), after=start)
            job = _job(args, launcher, root, work / "jobs", spec, kill)
            trial = _check(args, launcher, root, work / "jobs", spec, job, kill)
            trial.run, trial.fraction = run, kill.delay / horizon
            trials.append(trial)
            if trial.problems:
                (root / ".." / f"run-{run:03d}.txt").resolve().write_text(
                    job.describe() + "\n\n" + "\n".join(trial.problems)
                )
            else:
                shutil.rmtree(root)
            extra = (
                f"  survivors: {trial.survivor_error or '-'} after {trial.survivor_seconds or 0:.2f} s"
                if args.mode == "survivor"
                else ""
            )
            print(
                f"run {run:3d}  kill rank {target} at {kill.delay * 1000:6.1f} ms ({trial.fraction:4.0%} of T)  "
                f"{'reached ' + trial.reached if trial.landed else 'after the end'}  -> {trial.outcome}{extra}  "
                f"{'VIOLATION: ' + '; '.join(trial.problems) if trial.problems else 'ok'}",
                flush=True,
            )
    finally:
        launcher.close()
    landed = [t for t in trials if t.landed]
    silent = [t for t in trials if t.silent]
    violations = [t for t in trials if t.problems]
    hung = [t for t in trials if t.hung]
    peak = max((t.peak_kb for t in trials), default=0)
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    lines = [
        "",
        f"stress_kill --mode {args.mode}: {len(trials)} trials, world {spec['world']}, seed {args.seed}, "
        f"T = {horizon * 1000:.0f} ms, {time.monotonic() - started:.0f} s",
        f"  kills that landed before the end: {len(landed)}; outcomes: "
        + ", ".join(f"{o} {n}" for o, n in collections.Counter(t.outcome for t in trials).most_common()),
        "  reached at the kill: "
        + ", ".join(f"{o} {n}" for o, n in collections.Counter(t.reached for t in trials).most_common()),
    ]
    if args.mode == "survivor":
        detected = [t for t in landed if not t.problems]
        waits = [t.survivor_seconds for t in landed if t.survivor_seconds is not None]
        lines.append(
            f"  detected (every survivor ended on its own, as the commit says): {len(detected)} of {len(landed)}; "
            f"survivors ended: {dict(collections.Counter(t.survivor_error for t in landed))} (typed: SaveError "
            f"naming the rank; other: anything else, a violation); "
            f"slowest survivor {max(waits, default=0):.2f} s after the kill (limit {2 * args.save_timeout + args.slack:.1f} s)"
        )
    lines.append(
        f"  silent (wrong data listed, a good step lost, success without a commit): {len(silent)}; "
        f"hangs: {len(hung)}; trials with any violation: {len(violations)}"
    )
    lines.append(f"  peak resident memory: ranks {peak / 1024:.0f} MiB, this checker {own / 1024:.0f} MiB")
    print("\n".join(lines))
    if violations:
        print(f"failure records under {work}")
        return 1
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
