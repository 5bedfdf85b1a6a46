"""Hostile and damaged DCP checkpoints meet ``import_dcp`` with ``trust_pickle=True``: what the
restricted unpicklers admit cannot change a class for the process, read outside the folder,
blow up into vast arrays or values, or carry damaged bytes into the new checkpoint; each case
ends as a typed error naming the array, with nothing left at the destination.

The checkpoints are crafted by pickling DCP's own metadata classes (what ``dcp.save`` writes)
and by writing ``torch.save`` archives and raw pickle opcodes by hand."""

from __future__ import annotations

import io
import pathlib
import pickle
import random
import struct
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

import layoutckpt as lc
from layoutckpt import _dcp

DATA = "__0_0.distcp"


def _tensor(dtype: torch.dtype, size: tuple[int, ...]) -> TensorStorageMetadata:
    return TensorStorageMetadata(
        TensorProperties(dtype=dtype),
        torch.Size(size),
        [ChunkStorageMetadata(torch.Size((0,) * len(size)), torch.Size(size))],
    )


def _folder(path: Path, items: dict[str, tuple[object, bytes]], prefix: bytes = b"", file: str = DATA) -> Path:
    """A DCP folder of ``items`` (name: (storage metadata, the item's bytes)), all in one data
    file that the metadata calls ``file``; ``prefix``: raw opcodes put at the start of the
    ``.metadata`` pickle."""
    path.mkdir()
    blob, storage, sdm = b"", {}, {}
    for name, (meta, item) in items.items():
        offset = torch.Size((0,) * len(meta.size)) if isinstance(meta, TensorStorageMetadata) else None
        storage[MetadataIndex(name, offset)] = _StorageInfo(file, len(blob), len(item))
        sdm[name] = meta
        blob += item
    (path / DATA).write_bytes(blob)
    raw = pickle.dumps(Metadata(state_dict_metadata=sdm, planner_data={}, storage_data=storage), protocol=2)
    (path / ".metadata").write_bytes(raw[:2] + prefix + raw[2:])
    return path


def _archive(pkl: bytes, compression: int = zipfile.ZIP_STORED) -> bytes:
    """A torch.save-like archive holding the pickle ``pkl`` as its data.pkl."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression) as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/byteorder", b"little")
    return out.getvalue()


def _saved(t: torch.Tensor) -> bytes:
    out = io.BytesIO()
    torch.save(t, out)
    return out.getvalue()


def _refused(src: Path, dst: Path, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        lc.import_dcp(src, dst, trust_pickle=True)
    assert not dst.exists() and not [p for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.")]


def test_a_pickle_cannot_set_attributes_on_an_admitted_class(tmp_path: Path) -> None:
    """BUILD on ``pathlib.PosixPath`` itself would make every path's ``name`` lie for the whole
    process, and pass the check that keeps an item's file inside the folder."""
    (tmp_path / "victim").mkdir()
    (tmp_path / "victim" / "secret.pt").write_bytes(_saved(torch.arange(4.0)))
    escape = "../victim/secret.pt"
    key = escape.encode()
    build = (
        b"cpathlib\nPosixPath\nN}X" + struct.pack("<I", 4) + b"nameX" + struct.pack("<I", len(key)) + key + b"s\x86b0"
    )
    item = (_tensor(torch.float32, (4,)), b"")
    src = _folder(tmp_path / "evil", {"stolen": item}, prefix=build, file=escape)
    _refused(src, tmp_path / "out", lc.FormatError, "expected a file name in the checkpoint's folder")
    assert pathlib.Path("/etc/hosts").name == "hosts"


def test_a_data_file_that_links_out_of_the_folder_is_refused(tmp_path: Path) -> None:
    dcp_save({"w": torch.ones(3)}, tmp_path / "ckpt")
    outside = tmp_path / "outside.distcp"
    (tmp_path / "ckpt" / DATA).rename(outside)
    (tmp_path / "ckpt" / DATA).symlink_to(outside)
    _refused(tmp_path / "ckpt", tmp_path / "out", lc.FormatError, "links out of the checkpoint's folder")


def test_a_stride_0_item_cannot_declare_more_elements_than_it_stores(tmp_path: Path) -> None:
    n = 1 << 28  # 1 GiB of float32 from a 4-byte storage record, were it believed
    src = _folder(tmp_path / "ckpt", {"w": (_tensor(torch.float32, (n,)), _saved(torch.ones(1).expand(n)))})
    _refused(src, tmp_path / "out", lc.FormatError, r"declares 268435456 elements, more than its storage record")


def test_damaged_tensor_bytes_fail_the_archive_crc(tmp_path: Path) -> None:
    w = torch.arange(16.0)
    dcp_save({"w": w}, tmp_path / "ckpt")
    data = tmp_path / "ckpt" / DATA
    raw = bytearray(data.read_bytes())
    raw[raw.find(w.numpy().tobytes()) + 23] ^= 0x40  # a bit of element 5
    data.write_bytes(bytes(raw))
    _refused(tmp_path / "ckpt", tmp_path / "out", lc.IntegrityError, r"'w'.*fails its CRC-32")


def test_a_compressed_item_pickle_is_refused_before_it_is_inflated(tmp_path: Path) -> None:
    bomb = _archive(b"\x80\x02" + b"N" * (8 << 20) + b".", zipfile.ZIP_DEFLATED)
    assert len(bomb) < 100_000
    src = _folder(tmp_path / "ckpt", {"v": (BytesStorageMetadata(), bomb)})
    _refused(src, tmp_path / "out", lc.FormatError, r"'v'.*data.pkl is compressed")


def _shared_lists(levels: int) -> bytes:
    """A pickle of ``levels`` lists, each holding the one below twice: 2**levels leaves to walk."""
    p = b"\x80\x02]q\x00"
    for i in range(1, levels + 1):
        p += b"]r" + struct.pack("<I", i) + b"(" + (b"j" + struct.pack("<I", i - 1)) * 2 + b"e"
    return p + b"."


def test_a_value_of_shared_lists_is_left_out_by_its_size_not_walked(tmp_path: Path) -> None:
    """2**60 items to walk in a few hundred bytes: counted up to the limit, then left out by
    name, as a value too large for the tree; the tensors still import."""
    items = {
        "w": (_tensor(torch.float32, (3,)), _saved(torch.ones(3))),
        "v": (BytesStorageMetadata(), _archive(_shared_lists(60))),
    }
    done = lc.import_dcp(_folder(tmp_path / "ckpt", items), tmp_path / "out", trust_pickle=True)
    assert done.skipped == ("v",) and lc.load(tmp_path / "out")["w"].tolist() == [1.0] * 3


def test_a_damaged_value_fails_the_import_rather_than_being_left_out(tmp_path: Path) -> None:
    dcp_save({"w": torch.ones(3), "step": 7}, tmp_path / "ckpt")
    data = tmp_path / "ckpt" / DATA
    raw = bytearray(data.read_bytes())
    at = raw.find(pickle.dumps(7, protocol=2)[2:])  # the value's opcodes in its data.pkl
    raw[at] ^= 0xFF
    data.write_bytes(bytes(raw))
    _refused(tmp_path / "ckpt", tmp_path / "out", lc.FormatError, r"'step'")


def test_raw_bytes_and_objects_are_still_left_out_by_name(tmp_path: Path) -> None:
    dcp_save({"w": torch.ones(3), "blob": io.BytesIO(b"\x00raw"), "obj": {1, 2}}, tmp_path / "ckpt")
    done = lc.import_dcp(tmp_path / "ckpt", tmp_path / "out", trust_pickle=True)
    assert sorted(done.skipped) == ["blob", "obj"]


def test_ctrl_c_during_an_import_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    dcp_save({"w": torch.ones(3)}, tmp_path / "ckpt")

    def interrupted(*_: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(_dcp, "_write_share", interrupted)
    with pytest.raises(KeyboardInterrupt):
        lc.import_dcp(tmp_path / "ckpt", tmp_path / "out", trust_pickle=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_overlap_by_the_grid_and_by_the_sweep_agrees_with_every_pair() -> None:
    rng = random.Random(0)
    for _ in range(500):
        dims = rng.randint(1, 3)
        boxes = [
            tuple((lo, lo + rng.randint(1, 4)) for lo in (rng.randint(0, 6) for _ in range(dims)))
            for _ in range(rng.randint(2, 8))
        ]
        pairs = any(_dcp._overlap(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])
        assert (_dcp._overlapping(boxes) is not None) == pairs, boxes
        assert (_dcp._swept(boxes) is not None) == pairs, boxes


def dcp_save(state: dict, path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dcp.save without a process group says so
        dcp.save(state, checkpoint_id=path)
