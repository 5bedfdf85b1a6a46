"""Publishing a finished directory under its final name (``storage._commit.publish``)."""

from __future__ import annotations

import os

import pytest

import layoutckpt as lc
from layoutckpt.storage import _commit, _os


def _folder(path, text):
    path.mkdir()
    (path / "f").write_text(text)
    return path


def test_exchange_swaps_two_directories_in_one_step_or_leaves_both(tmp_path):
    a, b = _folder(tmp_path / "a", "A"), _folder(tmp_path / "b", "B")
    swapped = _os.exchange(a, b)  # False off Linux, or on a file system that cannot
    assert ((a / "f").read_text(), (b / "f").read_text()) == (("B", "A") if swapped else ("A", "B"))


def test_an_overwrite_never_leaves_the_final_name_absent(tmp_path, monkeypatch):
    # A process killed between renaming the old checkpoint aside and the new one into place
    # left neither under the name; where the file system swaps, no such instant exists.
    final, tmp = _folder(tmp_path / "ck", "old"), _folder(tmp_path / ".ck.tmp-1", "new")
    swaps = _os.exchange(_folder(tmp_path / "x", ""), _folder(tmp_path / "y", ""))
    moved = []
    real_rename = os.rename
    monkeypatch.setattr(os, "rename", lambda src, dst: (moved.append(src), real_rename(src, dst)))
    _commit.publish(tmp, final, overwrite=True)
    # Where no swap is possible, the old checkpoint is renamed aside (the next test).
    assert (os.fspath(final) not in map(os.fspath, moved)) == swaps
    assert (final / "f").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "x", "y"]


def test_an_overwrite_where_no_swap_is_possible_renames_the_old_one_aside(tmp_path, monkeypatch):
    final, tmp = _folder(tmp_path / "ck", "old"), _folder(tmp_path / ".ck.tmp-1", "new")
    monkeypatch.setattr(_os, "exchange", lambda a, b: False)
    _commit.publish(tmp, final, overwrite=True)
    assert (final / "f").read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]


def test_a_checkpoint_committed_there_meanwhile_is_an_exists_error(tmp_path):
    # Two saves to one path: the second to commit finds the first's directory there.
    final, tmp = _folder(tmp_path / "ck", "first"), _folder(tmp_path / ".ck.tmp-1", "second")
    with pytest.raises(lc.CheckpointExistsError, match="another save committed first"):
        _commit.publish(tmp, final)
    assert (final / "f").read_text() == "first"
