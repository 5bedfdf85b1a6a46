"""The read side's guards, one at a time: files opened only as regular files inside the
checkpoint, shard indexes checked, decoded sizes read from chunk headers, the root checksum."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from layoutckpt.base._errors import FormatError
from layoutckpt.format import _format
from layoutckpt.format._shard import ABSENT, codec_for, declared_size
from layoutckpt.storage import _os
from layoutckpt.storage._shardread import _index_problem


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "ckpt/a").mkdir(parents=True)
    (tmp_path / "ckpt/a/f").write_bytes(b"inside")
    (tmp_path / "outside").write_bytes(b"outside")
    return tmp_path


def test_a_regular_file_inside_is_read(tree):
    assert _os.read_regular(tree / "ckpt", "a/f", 100) == b"inside"


def test_the_root_itself_may_be_a_link(tree):
    (tree / "link").symlink_to(tree / "ckpt")
    assert _os.read_regular(tree / "link", "a/f", 100) == b"inside"


@pytest.mark.parametrize("openat2", [True, False], ids=["openat2", "walk"])
def test_links_and_special_files_are_refused(tree, monkeypatch, openat2):
    monkeypatch.setattr(_os, "_openat2_works", openat2 and _os._openat2_works)
    root = tree / "ckpt"
    (root / "to_outside").symlink_to(tree / "outside")
    (root / "dir_link").symlink_to(root / "a")
    os.mkfifo(root / "fifo")
    for rel in ("to_outside", "dir_link/f", "fifo", "a"):
        with pytest.raises(_os.NotRegularFile):
            _os.read_regular(root, rel, 100)
    with pytest.raises(FileNotFoundError):
        _os.read_regular(root, "a/missing", 100)


def test_a_document_over_its_limit_is_not_read(tree):
    with pytest.raises(_os.NotRegularFile, match="above the limit of 3"):
        _os.read_regular(tree / "ckpt", "a/f", 3)


def _index(*entries):
    table = np.array(entries, dtype="<u8")
    return table[:, 0], table[:, 1]


@pytest.mark.parametrize(
    ("entries", "problem"),
    [
        ([(0, 10), (10, 10)], None),
        ([(10, 10), (0, 10)], None),  # any order (5.4)
        ([(ABSENT, ABSENT), (0, 10)], None),
        ([(0, 10), (0, 10)], "overlap"),
        ([(0, 10), (5, 10)], "overlap"),
        ([(0, 10), (15, 10)], "outside"),  # past the 20 bytes before the index
        ([(ABSENT - 1, 10)], "outside"),
        ([(0, 3)], "outside"),  # shorter than its checksum
        ([(ABSENT, 10)], "only one"),
    ],
)
def test_index_checks(entries, problem):
    found = _index_problem(*_index(*entries), 20)
    assert (found is None) if problem is None else (problem in found)


@pytest.mark.parametrize("compression", ["zstd", "blosc"])
@pytest.mark.parametrize("nbytes", [4, 300, 70_000, 1 << 20])
def test_declared_size_is_the_encoded_size(compression, nbytes):
    raw = np.random.default_rng(0).integers(0, 4, nbytes, dtype=np.uint8)
    encoded = np.frombuffer(codec_for(compression, 4).encode(raw), np.uint8)
    assert declared_size(compression, encoded) == nbytes
    assert declared_size(compression, encoded[:3]) is None


def _root(meta_edit=None) -> bytes:
    meta = _format.CheckpointMeta(arrays={}, tree={"dict": []}, mesh=_format.Mesh({}), rules=(), step=3)
    raw = _format.root_document(meta)
    if meta_edit is None:
        return raw
    doc = json.loads(raw)
    meta_edit(doc["attributes"]["layoutckpt"])
    return json.dumps(doc, indent=2).encode()


def test_the_checksum_ignores_whitespace_but_not_values():
    assert _format.parse_root_document(_root(), "c").step == 3
    assert _format.parse_root_document(_root(lambda d: None), "c").step == 3  # re-indented
    with pytest.raises(FormatError, match="fails its checksum"):
        _format.parse_root_document(_root(lambda d: d.update(step=4)), "c")
    with pytest.raises(FormatError, match="fails its checksum"):
        _format.parse_root_document(_root(lambda d: d.update(extra=1)), "c")


def test_an_edit_of_a_compact_document_fails_its_checksum():
    # The bytes as written are hashed without re-encoding them: an edit in place is caught
    # there as well as after re-serializing.
    raw = _root()
    assert b'"step":3' in raw
    with pytest.raises(FormatError, match="fails its checksum"):
        _format.parse_root_document(raw.replace(b'"step":3', b'"step":4'), "c")


def test_a_document_read_again_is_parsed_once_and_an_edit_of_it_still_fails():
    raw = _root()
    first = _format.parse_root_document(raw, "c")
    assert _format.parse_root_document(bytes(bytearray(raw)), "c") is first  # equal bytes, read again
    with pytest.raises(FormatError, match=r"^d: zarr\.json fails its checksum"):
        _format.parse_root_document(raw.replace(b'"step":3', b'"step":4'), "d")
    with pytest.raises(FormatError, match=r"^e: zarr\.json fails its checksum"):
        _format.parse_root_document(raw.replace(b'"step":3', b'"step":4'), "e")  # failures not kept


def test_the_metadata_a_reader_gives_is_a_copy_of_the_shared_document(tmp_path):
    import layoutckpt as lc

    lc.save(tmp_path / "c", {"w": np.arange(3)}, metadata={"config": {"lr": 0.1}})
    lc.open(tmp_path / "c").metadata["config"]["lr"] = 0.0
    assert lc.open(tmp_path / "c").metadata == {"config": {"lr": 0.1}}
    with lc.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, {"w": np.arange(3)}, metadata={"config": {"lr": 0.1}}).result()
        mgr.metadata(1)["config"]["lr"] = 0.0
        assert mgr.metadata(1) == {"config": {"lr": 0.1}}


@pytest.mark.parametrize("n", [16, 17, 500])  # both ways of checking: in Python, with NumPy
def test_long_indexes_are_checked_alike(n):
    entries = [(i * 10, 10) for i in range(n)][::-1]
    assert _index_problem(*_index(*entries), n * 10) is None
    assert "overlap" in _index_problem(*_index(*entries[:-1], (5, 10)), n * 10)
    assert "outside" in _index_problem(*_index(*entries), n * 10 - 1)
    assert "only one" in _index_problem(*_index(*entries[:-1], (ABSENT, 10)), n * 10)
