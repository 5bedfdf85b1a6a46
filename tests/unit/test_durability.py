"""``fsync_tree``, what a save calls before its commit: where Linux's ``syncfs`` is missing or
fails, every file and directory under the root is fsynced instead, none left out."""

from __future__ import annotations

import os
from pathlib import Path

from layoutckpt.storage import _os


def _tree(root: Path) -> set[str]:
    (root / "a" / "b").mkdir(parents=True)
    for rel in ("zarr.json", "a/zarr.json", "a/b/c.0", "a/b/c.1"):
        (root / rel).write_bytes(b"x")
    return {str(root), *(str(p) for p in root.rglob("*"))}


def _synced(monkeypatch, root: Path, syncfs) -> set[str]:
    paths: set[str] = set()
    real = os.fsync

    def fsync(fd: int) -> None:
        paths.add(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(_os, "_SYNCFS", syncfs)
    monkeypatch.setattr(os, "fsync", fsync)
    _os.fsync_tree(root)
    return paths


def test_a_failing_syncfs_falls_back_to_every_file_and_directory(monkeypatch, tmp_path):
    root = tmp_path / "ck"
    want = _tree(root)
    assert want <= _synced(monkeypatch, root, lambda fd: -1)


def test_without_syncfs_every_file_and_directory_is_synced(monkeypatch, tmp_path):
    root = tmp_path / "ck"
    want = _tree(root)
    assert want <= _synced(monkeypatch, root, None)


def test_a_working_syncfs_is_one_call(monkeypatch, tmp_path):
    root = tmp_path / "ck"
    _tree(root)
    calls: list[int] = []
    assert _synced(monkeypatch, root, lambda fd: calls.append(fd) or 0) == set()
    assert len(calls) == 1
