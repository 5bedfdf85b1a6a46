"""What every command shares: the program name, the two errors ``main`` maps to exit codes, and
the lookups that raise them (opening a checkpoint, compiling ``--select``)."""

from __future__ import annotations

import re

from .._reader import Reader
from ..base._errors import CheckpointNotFoundError

PROG = "layoutckpt"


class UsageError(Exception):
    """Bad input on the command line (exit 2)."""


class NotFound(Exception):
    """A name or path the command was given does not exist (exit 1)."""


def name_regex(text: str) -> re.Pattern[str]:
    try:
        return re.compile(text)
    except re.error as err:
        raise UsageError(
            f"--select {text!r} is not a regular expression ({err}); write e.g. --select '^model\\.'"
        ) from None


def open_checkpoint(path: str) -> Reader:
    try:
        return Reader(path)
    except CheckpointNotFoundError as err:
        raise NotFound(f"{err.strerror}; check the path (`layoutckpt ls` lists a run's steps)") from None
