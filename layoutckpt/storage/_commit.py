"""The commit protocol on a local file system, written once.

Whatever is published (a save's checkpoint directory, an imported checkpoint, an exported
``.safetensors`` file) is built under a hidden temporary name beside its final one
(``temp_path``), made durable, then renamed into place and the rename made durable
(``publish``): at every instant the final name is absent, the old whole thing or the new whole
thing, never a mix. A checkpoint's commit marker is written last, inside the temporary directory,
just before the rename (``_location.LocalDir.commit``). Deleting is the same steps backwards
(``retire``): renamed aside first, so the name disappears at once and whole, then removed.
Object stores, which have no rename, commit by writing the marker last (``_location.KvPrefix``).

Leftovers of a crash carry a mark a cleanup recognises (``LEFTOVER``): ``.tmp-`` (not yet
published), ``.old-`` (a checkpoint an overwrite set aside, still whole) and ``.del-`` (being
deleted).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from ..base import _faults
from ..base._errors import CheckpointExistsError
from . import _os

TMP_MARK = ".tmp-"
# ``.NAME.KIND-HEX``: what ``temp_path``, ``publish`` and ``retire`` leave if the process dies.
LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|del|old)-[0-9a-f]+$")


def new_token() -> int:
    """48 random bits (12 hex digits): small enough to travel in an int64 collective."""
    return uuid.uuid4().int & ((1 << 48) - 1)


def temp_path(final: Path, token: int) -> Path:
    """The hidden temporary name beside ``final`` under which it is built."""
    return final.parent / f".{final.name}{TMP_MARK}{token:012x}"


def _beside(path: Path, kind: str) -> Path:
    return path.parent / f".{path.name}.{kind}-{uuid.uuid4().hex[:12]}"


def publish(tmp: Path, final: Path, *, overwrite: bool = False) -> None:
    """Rename the finished, durable ``tmp`` to ``final``, then make the rename durable.

    A directory already at ``final`` is refused (``CheckpointExistsError``) unless
    ``overwrite``; then the two are swapped in one step, so ``final`` always names a whole
    checkpoint, and the old one is deleted after. Where the file system cannot swap, the old one
    is first renamed aside (``.old-``), so ``final`` is absent for an instant. A file at
    ``final`` is replaced in one rename.
    """
    _faults.point("commit.publish", staging=os.fspath(tmp), final=os.fspath(final))
    aside = None
    if overwrite and final.is_dir():
        if _os.exchange(tmp, final):
            _os.fsync_dir(final.parent)
            _faults.point("commit.published", final=os.fspath(final))
            remove_tree(tmp)  # the old checkpoint, under the temporary name
            return
        aside = _beside(final, "old")
        os.rename(final, aside)
    try:
        rename(tmp, final)
    except OSError as err:
        if err.errno not in (errno.ENOTEMPTY, errno.EEXIST) or overwrite:
            raise
        raise CheckpointExistsError(
            f"{os.fspath(final)!r} appeared while this was written there (another save committed first); "
            "this one committed nothing: save to another path, or pass overwrite=True"
        ) from err
    _faults.point("commit.published", final=os.fspath(final))
    if aside is not None:
        remove_tree(aside)


def rename(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst`` (in the same directory) and make the rename durable."""
    os.replace(src, dst)
    _os.fsync_dir(dst.parent)


def write_file_atomically(file: Path, write: Callable[[BinaryIO], None]) -> None:
    """Publish the file ``file`` whose bytes ``write(f)`` writes: a reader never sees half of
    it under its name, and a crash leaves at most a ``.tmp-`` file beside it."""
    tmp = write_beside(file, write)
    try:
        publish(tmp, file)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_beside(file: Path, write: Callable[[BinaryIO], None]) -> Path:
    """The durable temporary file beside ``file`` whose bytes ``write(f)`` writes, for the
    caller to publish; removed where the write fails."""
    tmp = temp_path(file, new_token())
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def retire(path: Path) -> bool:
    """Delete the directory ``path`` so that it is never seen partly deleted: renamed aside
    (``.del-``) and the rename made durable first, then removed. False if it was not there."""
    aside = _beside(path, "del")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    _os.fsync_dir(path.parent)
    remove_tree(aside)
    return True


def remove_tree(path: Path) -> None:
    """Remove ``path`` and everything under it; what is already gone is no error. A symbolic
    link (a checkpoint path that was one, set aside by an overwrite) is removed, not followed."""
    if path.is_symlink():
        path.unlink(missing_ok=True)
        return
    shutil.rmtree(path, ignore_errors=True)
