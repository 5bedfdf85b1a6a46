"""Run checkpointing jobs as real processes, kill them in the middle of a save, and check what a
crash leaves: the helpers of ``tests/crash/test_crash.py`` and ``tools/stress_kill.py``.

A job is ``world`` rank processes of ``tests/support/crash_worker.py`` (gloo over a ``file://`` rendezvous),
each in its own process group, saving one step through a ``CheckpointManager(root, keep_last=2)``.
Ranks are started cold with ``subprocess.Popen`` (``PopenLauncher``), or forked from a server that
has already imported torch (``ForkServer``; the same ``main``, seconds cheaper per job).

``run_job`` kills them: at a phase (the worker kills itself, deterministic), or from here after a
random delay past the moment every rank printed ``SAVING`` (one rank, or all of them). When a rank
dies, the rest of the job is killed ``grace`` seconds later, as a scheduler tears down a job that
lost a rank; ranks that wait for a dead peer would otherwise wait for the gloo timeout.

``verify`` then checks the directory as the crash left it, without touching it:

- every committed step (a ``step_%08d`` directory holding the root ``zarr.json``) loads bit-exact
  against ``crash_worker.expected_full`` (``lc.load`` without a layout, in this process, no
  ``torch.distributed``), with its JSON leaves, metadata and every rank's ``rank_state``;
- the step committed before the crash is still there (and loads bit-exact);
- the interrupted step is committed or invisible as the ranks' progress allows
  (``possible_outcomes``: never committed unless rank 0 reached the rename and every rank reached
  the agreement; always committed once rank 0 returned from the rename), and exactly as expected
  for a deterministic phase kill.

``verify_restart`` runs the job again for the next step without kills, then checks that it
committed, that no leftover (``.tmp-``, ``.del-``, ``.old-``, uncommitted ``step_*``) remains, and
that ``CheckpointManager(root).steps()`` is what retention (``keep_last=2``) must leave.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import layoutckpt as lc
from layoutckpt.storage._location import PENDING
from tests.support import crash_worker as cw

WORKER = Path(__file__).resolve().parent / "crash_worker.py"
PYTHON = sys.executable
STEP_DIR = re.compile(r"^step_(\d{8})$")
LOCK = ".layoutckpt.lock"
# Events in the order a save reaches them; a rank's progress is the furthest it printed.
ORDER = ("START", "SAVING", "stage", "STAGED", "write", "agree", "marker", "rename", "renamed", "retire", "COMMITTED")


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        GLOO_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        OPENBLAS_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    return env


# --- launching ---------------------------------------------------------------------------------


class PopenProc:
    def __init__(self, argv: list[str], out: Path, err: Path) -> None:
        with open(out, "wb") as o, open(err, "wb") as e:
            self._p = subprocess.Popen(
                [PYTHON, str(WORKER), *argv],
                stdin=subprocess.DEVNULL,
                stdout=o,
                stderr=e,
                env=worker_env(),
                start_new_session=True,  # its own process group (and session)
            )
        self.pid = self._p.pid

    def poll(self) -> int | None:
        return self._p.poll()

    def kill(self) -> None:
        if self._p.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float) -> int | None:
        try:
            return self._p.wait(timeout)
        except subprocess.TimeoutExpired:
            return None


class PopenLauncher:
    """Every rank a fresh interpreter: ``import torch`` and all."""

    name = "popen"

    def spawn(self, argv: list[str], out: Path, err: Path) -> PopenProc:
        return PopenProc(argv, out, err)

    def close(self) -> None:
        pass


class ForkedProc:
    def __init__(self, server: ForkServer, pid: int) -> None:
        self._server = server
        self.pid = pid

    def poll(self) -> int | None:
        return self._server.exit_code(self.pid)

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while self.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        return self.poll()


class ForkServer:
    """Ranks forked from ``crash_worker.py --serve``, which has torch imported already."""

    name = "fork"

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [PYTHON, str(WORKER), "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=worker_env(),
            start_new_session=True,
        )
        self._cond = threading.Condition()
        self._started: dict[int, int] = {}
        self._exits: dict[int, int] = {}
        self._ready = False
        self._ids = iter(range(1 << 62))
        self._reader = threading.Thread(target=self._read, daemon=True, name="fork-server-reader")
        self._reader.start()
        with self._cond:
            if not self._cond.wait_for(lambda: self._ready or self._proc.poll() is not None, timeout=120):
                raise RuntimeError("the fork server did not start within 120 s")
        if not self._ready:
            raise RuntimeError(f"the fork server exited with {self._proc.poll()}")

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for raw in self._proc.stdout:
            words = raw.decode().split()
            with self._cond:
                if words == ["READY"]:
                    self._ready = True
                elif words[:1] == ["STARTED"]:
                    self._started[int(words[1])] = int(words[2])
                elif words[:1] == ["EXIT"]:
                    self._exits[int(words[1])] = int(words[2])
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def spawn(self, argv: list[str], out: Path, err: Path) -> ForkedProc:
        ident = next(self._ids)
        request = {"id": ident, "argv": argv, "out": str(out), "err": str(err)}
        assert self._proc.stdin is not None
        self._proc.stdin.write((json.dumps(request) + "\n").encode())
        self._proc.stdin.flush()
        with self._cond:
            if not self._cond.wait_for(lambda: ident in self._started, timeout=30):
                raise RuntimeError("the fork server did not start a worker within 30 s")
            return ForkedProc(self, self._started.pop(ident))

    def exit_code(self, pid: int) -> int | None:
        with self._cond:
            return self._exits.get(pid)

    def close(self) -> None:
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()  # the server kills its children and exits
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
        self._reader.join(10)
        if self._proc.stdout is not None:
            self._proc.stdout.close()


Launcher = PopenLauncher | ForkServer


# --- running a job -----------------------------------------------------------------------------


@dataclass
class RandomKill:
    """Kill ``targets`` (ranks) ``delay`` seconds after every rank printed ``after`` (an event)."""

    targets: list[int]
    delay: float
    after: str = "SAVING"


@dataclass
class JobResult:
    step: int
    world: int
    returncodes: list[int | None]
    events: list[dict[str, float]]  # per rank: event -> monotonic time (first occurrence)
    stderr: list[str]
    killed: list[int] = field(default_factory=list)  # the ranks this harness killed as the target
    kill_time: float | None = None
    torn_down: list[int] = field(default_factory=list)  # ranks killed because a peer had died
    timed_out: bool = False
    failures: list[str] = field(default_factory=list)  # per rank: the error it printed (FAILED), or ""
    values: dict[int, dict[str, list[str]]] = field(default_factory=dict)  # rank -> event -> its words
    seconds: float = 0.0  # from the start of the ranks to the end of the last one
    hwm_at_kill: list[int | None] = field(default_factory=list)  # each rank's peak resident kB when killed

    def committed_on(self, rank: int) -> bool:
        return "COMMITTED" in self.events[rank]

    def progress(self, rank: int, before: float | None = None) -> str:
        """The furthest event ``rank`` had printed (by ``before``, default: ever)."""
        seen = [e for e, t in self.events[rank].items() if e in ORDER and (before is None or t <= before)]
        return max(seen, key=ORDER.index, default="START")

    def save_seconds(self) -> float:
        """From the last rank's ``SAVING`` to the last rank's ``COMMITTED``."""
        return self.span("SAVING", "COMMITTED")

    def span(self, start: str, end: str) -> float:
        """From the last rank's event ``start`` to the last rank's event ``end``."""
        return max(e[end] for e in self.events) - max(e[start] for e in self.events)

    def peak_kb(self) -> list[int | None]:
        """Each rank's peak resident size in kB (its ``PEAK`` line), None where it printed none."""
        return [
            int(self.values.get(r, {}).get("PEAK", [-1])[0]) if "PEAK" in self.values.get(r, {}) else None
            for r in range(self.world)
        ]

    def describe(self) -> str:
        lines = [f"step {self.step} on {self.world} ranks: returncodes {self.returncodes}"]
        if self.killed:
            lines.append(f"killed {self.killed} at {self.kill_time}")
        if self.torn_down:
            lines.append(f"torn down {self.torn_down}")
        if self.timed_out:
            lines.append("TIMED OUT")
        for r in range(self.world):
            lines.append(f"--- rank {r}: {sorted(self.events[r].items(), key=lambda kv: kv[1])}")
            if self.stderr[r].strip():
                lines.append(self.stderr[r].strip()[-3000:])
        return "\n".join(lines)


def _parse_events(text: str) -> dict[str, float]:
    events: dict[str, float] = {}
    for line in text.splitlines():
        words, _, stamp = line.rpartition(" @")
        if not words or not stamp:
            continue
        name = words.split()[-1] if words.startswith("PHASE ") else words.split()[0]
        try:
            events.setdefault(name, float(stamp))
        except ValueError:
            continue
    return events


def run_job(
    launcher: Launcher,
    root: Path,
    step: int,
    world: int,
    workdir: Path,
    *,
    mb: float,
    kill_at: str | None = None,
    kill_rank: int = 0,
    random_kill: RandomKill | None = None,
    grace: float = 0.5,
    timeout: float = 120.0,
    save_timeout: float | None = None,
    busy: list[float] | None = None,
    tcp: bool = False,
    mode: str = "manager",
    extra: list[str] | None = None,
) -> JobResult:
    """Run one job to its end: completion, or a kill followed by the teardown of its other ranks.

    ``save_timeout`` is the workers' ``timeout=``; ``busy`` the seconds each rank's main thread
    spins before waiting for its save; ``tcp`` a ``tcp://`` rendezvous, whose store lives in
    rank 0's process (as under torchrun), instead of a file."""
    workdir.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    # A world of one needs no torch.distributed: the worker then saves without a process group.
    init = f"tcp://127.0.0.1:{free_port()}" if tcp else "none" if world == 1 else str(workdir / f"init-{tag}")
    outs = [workdir / f"{tag}-rank{r}.out" for r in range(world)]
    errs = [workdir / f"{tag}-rank{r}.err" for r in range(world)]
    argv_common = ["--world", str(world), "--init", init, "--root", str(root), "--step", str(step)]
    argv_common += ["--mb", str(mb), "--mode", mode, *(extra or [])]
    if kill_at is not None:
        argv_common += ["--kill-at", kill_at, "--kill-rank", str(kill_rank)]
    if save_timeout is not None:
        argv_common += ["--timeout", str(save_timeout)]
    argvs = [["--rank", str(r), *argv_common, "--busy", str(busy[r] if busy else 0.0)] for r in range(world)]
    began = time.monotonic()
    procs = [launcher.spawn(argvs[r], outs[r], errs[r]) for r in range(world)]

    def events(rank: int) -> dict[str, float]:
        try:
            return _parse_events(outs[rank].read_text(errors="replace"))
        except FileNotFoundError:
            return {}

    result = JobResult(step, world, [None] * world, [{} for _ in range(world)], [""] * world)
    deadline = time.monotonic() + timeout
    first_death: float | None = None
    try:
        while True:
            now = time.monotonic()
            rcs = [p.poll() for p in procs]
            if random_kill is not None and result.kill_time is None:
                evs = [events(r) for r in range(world)]
                if all(random_kill.after in e for e in evs):
                    start = max(e[random_kill.after] for e in evs)
                    if now >= start + random_kill.delay:
                        result.hwm_at_kill = [_hwm_kb(p.pid) for p in procs]
                        for r in random_kill.targets:
                            procs[r].kill()
                        result.kill_time = time.monotonic()
                        result.killed = list(random_kill.targets)
                        first_death = result.kill_time
            if first_death is None and any(rc is not None and rc != 0 for rc in rcs):
                first_death = now
            if first_death is not None and now >= first_death + grace:
                for r, p in enumerate(procs):
                    if p.poll() is None and r not in result.torn_down and r not in result.killed:
                        p.kill()
                        result.torn_down.append(r)
            if all(rc is not None for rc in rcs):
                break
            if now > deadline:
                result.timed_out = True
                for p in procs:
                    p.kill()
            time.sleep(0.002)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(30)
    result.seconds = time.monotonic() - began
    result.returncodes = [p.poll() for p in procs]
    result.values = {r: _event_words(outs[r]) for r in range(world)}
    result.events = [events(r) for r in range(world)]
    result.stderr = [e.read_text(errors="replace") if e.exists() else "" for e in errs]
    result.failures = [_failure(out) for out in outs]
    return result


def _hwm_kb(pid: int) -> int | None:
    """The peak resident size (VmHWM, kB) of the live process ``pid``, or None."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _event_words(out: Path) -> dict[str, list[str]]:
    """Each event a worker printed -> the words after its name (first occurrence)."""
    found: dict[str, list[str]] = {}
    text = out.read_text(errors="replace") if out.exists() else ""
    for line in text.splitlines():
        words = line.rpartition(" @")[0].split()
        if words and not words[0].startswith("PHASE"):
            found.setdefault(words[0], words[1:])
    return found


def _failure(out: Path) -> str:
    """The error a worker printed on its ``FAILED`` line, or ""."""
    text = out.read_text(errors="replace") if out.exists() else ""
    for line in text.splitlines():
        if line.startswith("FAILED "):
            return line[len("FAILED ") :].rpartition(" @")[0]
    return ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the state on disk -------------------------------------------------------------------------


@dataclass
class Scan:
    committed: list[int]
    uncommitted: list[str]  # step_* directories without the marker
    leftovers: list[str]  # dot-names other than the lock file

    @property
    def tmp_dirs(self) -> list[str]:
        return [n for n in self.leftovers if ".tmp-" in n]


def scan(root: Path) -> Scan:
    """What is under ``root``, by this test's own definition of committed (the root marker file)."""
    committed, uncommitted, leftovers = [], [], []
    for entry in sorted(os.listdir(root)) if root.exists() else []:
        m = STEP_DIR.match(entry)
        if m:
            (committed if (root / entry / "zarr.json").is_file() else uncommitted).append(entry)
        elif entry.startswith(".") and entry != LOCK:
            leftovers.append(entry)
    return Scan(sorted(int(STEP_DIR.match(n).group(1)) for n in committed), uncommitted, leftovers)


def step_path(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def same_bits(a: Any, b: torch.Tensor) -> bool:
    if not isinstance(a, torch.Tensor) or a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def check_step(path: Path, step: int, mb: float, loaded: Any = None) -> list[str]:
    """Problems with the committed checkpoint of ``step`` at ``path`` (empty: bit-exact)."""
    problems = []
    try:
        state = lc.load(path) if loaded is None else loaded
        expected = cw.expected_full(step, mb)
        for name, got in cw.flat_arrays(state).items():
            if not same_bits(got, expected[name]):
                problems.append(f"step {step}: array {name} differs from the expected bits")
        if state.get("step") != step or state.get("name") != "crash-test":
            problems.append(f"step {step}: JSON leaves {state.get('step')!r}, {state.get('name')!r}")
        reader = lc.open(path)
        meta = reader.metadata
        if meta.get("step") != step:
            problems.append(f"step {step}: metadata {meta}")
        world = meta.get("world")
        if reader.rank_states() != [{"rank": r, "step": step} for r in range(world or 0)]:
            problems.append(f"step {step}: rank states {reader.rank_states()}")
    except Exception as err:  # noqa: BLE001 - reported as a problem
        problems.append(f"step {step}: {type(err).__name__}: {err}")
    return problems


@dataclass
class Verdict:
    step: int
    committed: bool  # whether the interrupted step is committed
    scan: Scan
    problems: list[str]

    @property
    def outcome(self) -> str:
        return "committed" if self.committed else "invisible"


def possible_outcomes(job: JobResult) -> set[str]:
    """What the interrupted step may have become, from how far each rank had got when it died.

    Rank 0 renames the checkpoint into place and prints ``renamed`` after; it needs every rank's
    agreement, which a rank gives after printing ``agree``. So: committed only if rank 0 printed
    ``rename`` and every rank printed ``agree``; certainly committed once rank 0 printed ``renamed``.
    """
    # A rank's events are written unbuffered before it acts, so all of them precede its death.
    reached = [ORDER.index(job.progress(r)) for r in range(job.world)]
    if reached[0] >= ORDER.index("renamed"):
        return {"committed"}
    if reached[0] < ORDER.index("rename") or min(reached) < ORDER.index("agree"):
        return {"invisible"}
    return {"committed", "invisible"}


def verify(
    root: Path, step: int, previous: int | None, mb: float, job: JobResult, expect: str | None = None
) -> Verdict:
    """Check ``root`` as a killed save of ``step`` left it (read-only)."""
    s = scan(root)
    problems = []
    for k in s.committed:
        problems += check_step(step_path(root, k), k, mb)
    if previous is not None and previous not in s.committed:
        problems.append(f"the previously committed step {previous} is gone: {s}")
    committed = step in s.committed
    outcome = "committed" if committed else "invisible"
    allowed = possible_outcomes(job)
    if outcome not in allowed:
        problems.append(f"step {step} is {outcome}, but the ranks' progress allows only {sorted(allowed)}")
    if expect is not None and outcome != expect:
        problems.append(f"step {step} is {outcome}, expected {expect}")
    return Verdict(step, committed, s, problems)


def verify_restart(
    launcher: Launcher, root: Path, step: int, workdir: Path, *, world: int, mb: float, timeout: float = 120.0
) -> list[str]:
    """Run the job again for ``step`` without kills; problems with what it leaves (empty: fine)."""
    before = scan(root).committed
    job = run_job(launcher, root, step, world, workdir, mb=mb, timeout=timeout)
    problems = []
    if job.returncodes != [0] * world or not all(job.committed_on(r) for r in range(world)):
        return [f"the restart job did not commit step {step}:\n{job.describe()}"]
    s = scan(root)
    if s.leftovers or s.uncommitted:
        problems.append(f"leftovers after the restart: {s.leftovers + s.uncommitted}")
    expected = sorted({*before, step})[-cw.KEEP_LAST :]
    with lc.CheckpointManager(root) as mgr:
        if mgr.steps() != expected or s.committed != expected:
            problems.append(f"steps() is {mgr.steps()} (on disk {s.committed}), expected {expected}")
        if mgr.latest_step() != step:
            problems.append(f"latest_step() is {mgr.latest_step()}, expected {step}")
        for k in mgr.steps():
            problems += check_step(mgr.path(k), k, mb, loaded=mgr.load(step=k))
    return problems


def seed_root(root: Path, steps: list[int], mb: float) -> None:
    """Committed checkpoints of ``steps`` saved by one process (no torch.distributed)."""
    with lc.CheckpointManager(root, keep_last=cw.KEEP_LAST, async_save=False) as mgr:
        for s in steps:
            mgr.save(
                s,
                cw.build_state(s, 1, 0, mb),
                cw.layout_for(1),
                metadata={"step": s, "world": 1, "mb": mb},
                rank_state={"rank": 0, "step": s},
            )


def copy_root(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(LOCK))
    return dst


def random_kill(rng: random.Random, world: int, horizon: float) -> RandomKill:
    """One random rank or all of them, after a delay uniform in [0, horizon]."""
    targets = list(range(world)) if rng.random() < 0.3 else [rng.randrange(world)]
    return RandomKill(targets, rng.uniform(0.0, horizon))


# --- a world of one, retention and restarts ----------------------------------------------------


def seed_many(root: Path, steps: list[int], arrays: int) -> None:
    """Committed steps of ``crash_worker.build_many`` states (many small files each), saved by
    ``lc.save`` into their step folders as a manager would."""
    for s in steps:
        lc.save(step_path(root, s), cw.build_many(s, arrays), metadata={"step": s, "arrays": arrays})


def check_many(path: Path, step: int, arrays: int) -> list[str]:
    """Problems with the committed ``build_many`` state of ``step`` at ``path`` (empty: bit-exact)."""
    try:
        state = lc.load(path)
        expected = cw.build_many(step, arrays)
        if sorted(state.get("p", {})) != sorted(expected["p"]) or state.get("step") != step:
            return [f"step {step}: names {sorted(state.get('p', {}))[:3]}..., step leaf {state.get('step')!r}"]
        return [
            f"step {step}: array p.{k} differs" for k, t in expected["p"].items() if not same_bits(state["p"][k], t)
        ]
    except Exception as err:  # noqa: BLE001 - reported as a problem
        return [f"step {step}: {type(err).__name__}: {err}"]


def check_committed(path: Path, step: int) -> list[str]:
    """Problems with any committed checkpoint these tests write (either kind of state, as its
    metadata says): it loads bit-exact, and ``verify`` (as ``layoutckpt verify``) finds nothing."""
    from layoutckpt._verify import verify as verify_checkpoint

    try:
        with lc.open(path) as rd:
            meta = rd.metadata
            found = verify_checkpoint(rd)
    except Exception as err:  # noqa: BLE001 - reported as a problem
        return [f"step {step}: {type(err).__name__}: {err}"]
    problems = [f"step {step}: verify: {p.text}" for p in found.problems]
    if "arrays" in meta:
        return problems + check_many(path, step, meta["arrays"])
    return problems + check_step(path, step, meta["mb"])


def aside(root: Path, step: int, kind: str) -> Path:
    """Rename the step folder ``step`` to a crash leftover of ``kind`` (``tmp``, ``del``, ``old``)."""
    dst = root / f".{step_dir_name(step)}.{kind}-{uuid.uuid4().hex[:12]}"
    os.rename(step_path(root, step), dst)
    return dst


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


# The leftovers ``seed_leftovers`` makes: what a manager starting there must do with each step.
LEFTOVER_STEPS = {4: "restore", 5: "remove", 6: "remove", 7: "remove"}


def seed_leftovers(root: Path, arrays: int) -> None:
    """Beside committed steps, one leftover of each kind a crash leaves (many files each): step 4
    set aside whole by an interrupted overwrite (``.old-``, its folder gone: to be put back),
    step 5 half retired (``.del-``), step 6 a finished save never renamed (``.tmp-``, its marker
    inside), step 7 a step folder without its marker, marked as under way (``PENDING``)."""
    seed_many(root, [4, 5, 6, 7], arrays)
    aside(root, 4, "old")
    aside(root, 5, "del")
    aside(root, 6, "tmp")
    (step_path(root, 7) / "zarr.json").unlink()
    (step_path(root, 7) / PENDING).write_bytes(b"")


def restart_in_process(root: Path, expected: list[int], *, keep_last: int | None = None) -> list[str]:
    """Start a manager on ``root`` in this process (no torch.distributed): it must start, leave no
    leftover, and list exactly ``expected``, each step bit-exact and verified."""
    problems = []
    try:
        with lc.CheckpointManager(root, keep_last=keep_last) as mgr:
            steps = mgr.steps()
    except Exception as err:  # noqa: BLE001 - reported as a problem
        return [f"the manager did not start: {type(err).__name__}: {err}"]
    s = scan(root)
    if s.leftovers or s.uncommitted:
        problems.append(f"leftovers after a restart: {s.leftovers + s.uncommitted}")
    if steps != expected or s.committed != expected:
        problems.append(f"steps() is {steps} (on disk {s.committed}), expected {expected}")
    for k in s.committed:
        problems += check_committed(step_path(root, k), k)
    return problems


def _save_errors() -> set[str]:
    """The names of ``lc.SaveError`` and its subclasses, as a worker prints them."""
    found, todo = set(), [lc.SaveError]
    while todo:
        cls = todo.pop()
        found.add(cls.__name__)
        todo += cls.__subclasses__()
    return found


def survivor_error(job: JobResult, rank: int, killed: int) -> str:
    """How surviving ``rank`` ended: ``"committed"``, ``"typed"`` (a ``SaveError``, or a subclass,
    naming rank ``killed``), ``"other"`` (any other error, such as gloo's, which names only the
    peer's address), or ``"none"`` (it printed neither)."""
    if job.committed_on(rank):
        return "committed"
    text = job.failures[rank].strip("'\"")  # the worker prints the repr of "Type: message"
    if not text:
        return "none"
    kind = text.split(":", 1)[0]
    return "typed" if kind in _save_errors() and re.search(rf"\brank {killed}\b", text) else "other"


def survivor_cause(job: JobResult, rank: int) -> str:
    """The ``__cause__`` of the error ``rank`` failed with, as ``Type: message`` ("None": none)."""
    words = job.values.get(rank, {}).get("CAUSE", ["None"])
    return " ".join(words).strip("'\"")


def survivor_problems(job: JobResult, killed: int, committed: bool, limit: float) -> list[str]:
    """Problems with what the ranks that were not killed reported: each must end on its own
    within ``limit`` seconds of the kill, with success where the step is committed, else with a
    typed error (``SaveError``) naming rank ``killed``."""
    problems = []
    if job.torn_down or job.timed_out:
        problems.append(f"ranks {job.torn_down} hung and were torn down")
    for r in range(job.world):
        if r == killed or r in job.torn_down:
            continue
        if committed and not job.committed_on(r):
            problems.append(f"rank {r} reported {job.failures[r]!r} for a committed step")
        if not committed and job.committed_on(r):
            problems.append(f"rank {r} reported success, but the step is not committed")
        if not committed and survivor_error(job, r, killed) != "typed":
            problems.append(f"rank {r}'s error is no SaveError naming rank {killed}: {job.failures[r]!r}")
        ended = job.events[r].get("FAILED", job.events[r].get("COMMITTED"))
        if job.kill_time is not None and ended is not None and ended - job.kill_time > limit:
            problems.append(f"rank {r} ended {ended - job.kill_time:.1f} s after the kill, above {limit:.1f} s")
    return problems
