"""The steps of a manager root: step folder names, listing, retention's rule, deletion, leftovers.

Shared by ``CheckpointManager`` (its durable root) and the fast tiers of ``tiers/`` (each
rank's own root), so both list, retire and clean up steps alike. A root is any ``Location``: a
local directory (``step_00000100/`` folders, committed by their marker) or a key prefix of an
object store or of ``memory://`` (``step_00000100/zarr.json`` keys).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .base import _faults
from .storage import _commit, _store
from .storage._commit import LEFTOVER
from .storage._location import MARKER, PENDING, Location, locate

_STEP = re.compile(r"^step_(\d+)$")
STEP_PREFIX = "step_"


def step_dir(step: int) -> str:
    """The folder (or key prefix) of ``step`` under a manager's root."""
    return f"step_{step:08d}"


def step_of(name: str) -> int | None:
    """The step whose folder is called ``name`` (``step_dir``'s inverse), or None. Only the
    names ``step_dir`` gives count: ``step_5`` is a folder of someone else's, which retention
    would never find to delete under its name ``step_00000005``."""
    m = _STEP.match(name)
    return int(m.group(1)) if m and step_dir(int(m.group(1))) == name else None


def to_delete(steps: list[int], keep_last: int | None, keep_every: int | None) -> list[int]:
    """The committed steps retention removes: all but the newest ``keep_last``, the multiples of
    ``keep_every``, and (always) the newest one."""
    steps = sorted(steps)
    if not steps:
        return []
    keep = set(steps if keep_last is None else steps[max(0, len(steps) - keep_last) :])
    if keep_every is not None:
        keep.update(s for s in steps if s % keep_every == 0)
    keep.add(steps[-1])
    return [s for s in steps if s not in keep]


def remove_leftovers(root: Path) -> None:
    """Crash leftovers under the lock: unfinished saves and deletions, uncommitted step folders.

    An ``.old-`` folder is a committed checkpoint set aside by an overwrite; if the crash came
    before its replacement was renamed into place, it is put back instead of deleted.
    """
    for name, action in leftovers(root):
        if action == "restore":
            m = LEFTOVER.match(name)
            assert m is not None
            _commit.rename(root / name, root / m.group("name"))
        else:
            _commit.remove_tree(root / name)


def retire_step(root: str | os.PathLike[str] | Location, step: int) -> None:
    """Delete the committed ``step`` under the manager root ``root`` so that it is never listed
    while partly deleted (``Location.retire``)."""
    loc = locate(root)
    _faults.point("manager.retire", url=f"{loc.url}/{step_dir(step)}")
    loc.child(step_dir(step)).retire()


def leftovers(root: str | os.PathLike[str]) -> list[tuple[str, str]]:
    """The crash leftovers under the manager root ``root``, as ``(entry name, action)``: what a
    manager starting there (or ``collect_garbage``) does with each, ``"remove"`` or ``"restore"``
    (a committed checkpoint an interrupted overwrite set aside, put back under its name)."""
    found = []
    for e in sorted(os.scandir(root), key=lambda e: e.name):
        m = LEFTOVER.match(e.name)
        if m and step_of(m.group("name")) is not None:
            final = Path(root, m.group("name"))
            restore = m.group("kind") == "old" and not final.exists() and _store.is_committed(e.path)
            found.append((e.name, "restore" if restore else "remove"))
        elif step_of(e.name) is not None and e.is_dir() and _unfinished(e.path):
            found.append((e.name, "remove"))
    return found


def _unfinished(path: str) -> bool:
    """Whether the step folder ``path`` is one layoutckpt left uncommitted: empty, or marked
    as a save or a deletion under way (``PENDING``). A folder of someone else's files that
    happens to bear a step's name is left alone."""
    if _store.is_committed(path):
        return False
    names = os.listdir(path)
    return not names or PENDING in names


def step_folders(root: str | os.PathLike[str]) -> list[tuple[int, str, bool]]:
    """Every step folder under the local manager root ``root``, committed or not, as ``(step,
    folder name, committed)`` in name order; empty where ``root`` is no directory."""
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for e in entries:
        step = step_of(e.name)
        if step is not None and e.is_dir():
            found.append((step, e.name, _store.is_committed(e.path)))
    return found


def committed_steps(root: str | os.PathLike[str] | Location) -> list[int]:
    """The committed steps under the manager root ``root``, oldest first (``CheckpointManager.steps``)."""
    loc = locate(root)
    if loc.is_local:
        return sorted(step for step, _, committed in step_folders(loc.url) if committed)
    # One listing of the steps' keys finds every marker (``step_N/zarr.json``).
    keys = loc.keys(STEP_PREFIX)
    found = (step_of(k.removesuffix("/" + MARKER)) for k in keys if k.count("/") == 1 and k.endswith("/" + MARKER))
    return sorted(s for s in found if s is not None)
