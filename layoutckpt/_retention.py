"""A manager root's lock, and retention applied from outside a training job.

``CheckpointManager`` holds ``root/.layoutckpt.lock`` (an ``flock``) while it lives, so two jobs
never interleave their saves and deletions; ``collect_garbage`` (``layoutckpt gc``) takes the
same lock to apply a manager's retention when no manager runs there.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path

from ._steps import committed_steps, leftovers, remove_leftovers, retire_step, step_of, to_delete
from .base._errors import CheckpointNotFoundError, ManagerLockedError
from .storage._commit import LEFTOVER
from .storage._location import locate

LOCK_FILE = ".layoutckpt.lock"

_LOCK_FDS: set[int] = set()


def _close_locks_in_child() -> None:
    """A forked child must not keep the root locked after its parent's manager is gone."""
    for fd in _LOCK_FDS:
        try:
            os.close(fd)  # the child's copy only: the parent's lock stays
        except OSError:
            pass
    _LOCK_FDS.clear()


os.register_at_fork(after_in_child=_close_locks_in_child)


def take_lock(root: Path) -> int:
    fd = os.open(root / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise ManagerLockedError(
            f"another CheckpointManager ({holder}) manages this root; close it first, or give each "
            "run its own root directory"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.ctime()}\n".encode(), 0)
    _LOCK_FDS.add(fd)
    return fd


def release_lock(fd: int) -> None:
    """Unlock explicitly: a forked child (a data loader worker) shares the descriptor, and a
    plain close would leave the root locked until that child exits."""
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
    _LOCK_FDS.discard(fd)


def check_retention(keep_last: int | None, keep_every: int | None) -> None:
    for name, value in (("keep_last", keep_last), ("keep_every", keep_every)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name} must be a positive integer or None, got {value!r}")


def steps_after_cleanup(root: str | os.PathLike[str]) -> list[int]:
    """The committed steps under ``root`` once the crash leftovers are dealt with, oldest first:
    those committed now, and those the cleanup puts back (``leftovers``: ``"restore"``)."""
    loc = locate(root)
    steps = set(committed_steps(loc))
    if loc.is_local and Path(loc.url).is_dir():
        for name, action in leftovers(loc.url):
            m = LEFTOVER.match(name)
            step = step_of(m.group("name")) if m and action == "restore" else None
            if step is not None:
                steps.add(step)
    return sorted(steps)


def collect_garbage(
    root: str | os.PathLike[str], *, keep_last: int | None, keep_every: int | None = None, dry_run: bool = False
) -> list[int]:
    """Apply a manager's retention to ``root`` when no manager runs there; the steps deleted.

    As a manager starting on ``root`` would, the crash leftovers go (see ``leftovers``); then
    every committed step that ``to_delete`` retires for ``keep_last`` and ``keep_every`` is
    deleted, the newest committed step never. The manager's lock is held throughout, so this
    refuses (``ManagerLockedError``) while a ``CheckpointManager`` manages ``root``; a plain
    ``save`` into ``root`` that is still running would lose its unfinished folder, so run it
    when no job writes there. With ``dry_run`` nothing is touched (and no lock taken): the
    steps returned are those that would go.
    """
    check_retention(keep_last, keep_every)
    loc = locate(root)
    if not loc.is_local:
        # No lock and no leftovers to sweep on an object store (see the module docstring).
        doomed = to_delete(committed_steps(loc), keep_last, keep_every)
        if not dry_run:
            for step in doomed:
                retire_step(loc, step)
        return doomed
    path = Path(loc.url)
    if not path.is_dir():
        raise CheckpointNotFoundError(
            2, f"no CheckpointManager root at {os.fspath(path)!r}: not a directory", os.fspath(path)
        )
    if dry_run:
        return to_delete(steps_after_cleanup(path), keep_last, keep_every)
    fd = take_lock(path)
    try:
        remove_leftovers(path)
        doomed = to_delete(committed_steps(loc), keep_last, keep_every)
        for step in doomed:
            retire_step(loc, step)
        return doomed
    finally:
        release_lock(fd)
