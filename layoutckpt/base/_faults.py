"""Named fault points: the phases of a save where a test may stop, trace or kill the process.

The library calls ``point(name, **detail)`` at each phase below. With no hook installed that is
one dict lookup; a test installs hooks for some names with ``hooks(...)`` (a context manager) and
each is called as ``hook(**detail)`` on the thread that reached the point. A hook may raise (the
library handles that as any failure at that phase) or end the process (a crash test).

Points, in the order a save reaches them (``detail`` keywords in brackets):

- ``save.stage_buffer`` (nbytes): a staging buffer is about to be taken for one box
  (``save_async``).
- ``save.write`` (url): this rank starts writing its boxes.
- ``save.box_written`` (name): one box landed in storage (a whole shard file, or a TensorStore
  write); also each shard ``import_safetensors`` writes.
- ``save.agree`` (rank): this rank's boxes are durable (or failed); it reports to the others.
- ``save.agreed`` (rank, staging, final): every rank reported success; rank 0 commits next.
- ``commit.marker`` (staging, final): the commit marker is about to be written (rank 0).
- ``commit.publish`` (staging, final): the finished temporary directory or file is about to be
  renamed into place (local file systems: a checkpoint, its marker written; an exported file).
- ``commit.published`` (final): it is in place under its final name (on object stores: the
  marker is written).
- ``save.committed`` (rank, final): this rank learnt that the commit succeeded.
- ``manager.retire`` (url): a manager is about to delete a committed step.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

POINTS = (
    "save.stage_buffer",
    "save.write",
    "save.box_written",
    "save.agree",
    "save.agreed",
    "commit.marker",
    "commit.publish",
    "commit.published",
    "save.committed",
    "manager.retire",
)

# The installed hooks by point name. Empty unless a test is inside ``hooks(...)``; replaced
# whole (never mutated) so that ``point`` reads it without a lock.
_HOOKS: dict[str, Callable[..., None]] = {}
_LOCK = threading.Lock()


def point(name: str, /, **detail: Any) -> None:
    """Reached fault point ``name``: call its hook, if a test installed one."""
    hook = _HOOKS.get(name)
    if hook is not None:
        hook(**detail)


@contextlib.contextmanager
def hooks(installed: Mapping[str, Callable[..., None]]) -> Iterator[None]:
    """Install ``installed`` (point name -> hook) for the ``with`` block, over any installed
    already; on leaving, the points it named get back what they had."""
    global _HOOKS
    unknown = sorted(set(installed) - set(POINTS))
    if unknown:
        raise ValueError(f"no fault points named {unknown}; the points are {list(POINTS)}")
    with _LOCK:
        before = _HOOKS
        _HOOKS = {**before, **installed}
    try:
        yield
    finally:
        with _LOCK:
            restored = dict(_HOOKS)
            for name in installed:
                if name in before:
                    restored[name] = before[name]
                else:
                    restored.pop(name, None)
            _HOOKS = restored
