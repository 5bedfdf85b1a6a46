"""Packed checkpoints (``packing="ocdbt"``): the same objects in TensorStore's OCDBT database.

What this file proves, in one process: a packed checkpoint reads back bit for bit (NumPy and torch
leaves, several dtypes, JSON leaves) in a handful of files where a plain one stores one file per
shard and document; ``packing="auto"`` packs exactly above ``PACK_ABOVE_OBJECTS`` objects;
``IOConfig.pack_bytes`` bounds a data file; a slice reads only the inner chunks it needs (bytes
counted by TensorStore's file-kvstore counter, which sees the database's reads); plain TensorStore
opens every array from the documented spec while plain zarr-python finds no array (never a wrong
one); damage in a data file or the database's manifest is an ``IntegrityError`` or a ``verify``
finding, never silently wrong data; ``save_async``, ``overwrite``, ``memory://``, a
``CheckpointManager`` with retention, and ``s3://`` (a real S3-protocol server, PUT requests
counted from its own request log) all work on packed checkpoints.
"""

from __future__ import annotations

import base64
import itertools
import json
import math
import os
import urllib.request
import warnings
from collections import Counter
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
import torch
import zarr

import layoutckpt as lc
from layoutckpt._verify import verify
from layoutckpt.cli import _main as _cli
from layoutckpt.storage import _os, _packs
from layoutckpt.storage._location import KvPrefix, locate
from tests.support.counters import bytes_read
from tests.support.s3server import running

JSON_LEAVES = {"step": 17, "lr": 0.25, "name": "packed", "warm": True, "none": None}


# --- states -------------------------------------------------------------------------------------


def leaf(i: int) -> np.ndarray | torch.Tensor:
    """Array ``i``: one of four kinds (NumPy float32, torch bfloat16, NumPy int64, torch
    float32), deterministic and different per ``i``."""
    g = np.random.default_rng(i)
    kind = i % 4
    if kind == 0:
        return g.standard_normal((4, 6)).astype(np.float32)
    if kind == 1:
        raw = g.integers(0, 1 << 16, size=(5, 3), dtype=np.uint16)
        return torch.from_numpy(raw.view(np.int16).copy()).view(torch.bfloat16)
    if kind == 2:
        return g.integers(-(1 << 62), 1 << 62, size=(7,), dtype=np.int64)
    return torch.from_numpy(g.standard_normal((2, 2, 2)).astype(np.float32))


def state_of(n: int) -> dict:
    """``n`` single-shard arrays as ``l<i>.w``, and the JSON leaves under ``cfg``."""
    return {**{f"l{i}": {"w": leaf(i)} for i in range(n)}, "cfg": dict(JSON_LEAVES)}


def bits(x) -> bytes:
    if isinstance(x, torch.Tensor):
        return x.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return np.ascontiguousarray(x).tobytes()


def as_numpy(x) -> np.ndarray:
    """What a NumPy reader gives for a leaf (bfloat16 as ml_dtypes' type)."""
    if isinstance(x, torch.Tensor):
        if x.dtype == torch.bfloat16:
            return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return x.numpy()
    return x


def assert_state(out: dict, n: int) -> None:
    """``out`` is ``state_of(n)`` bit for bit, leaf types and dtypes included."""
    want = state_of(n)
    assert set(out) == set(want)
    for i in range(n):
        got, exp = out[f"l{i}"]["w"], want[f"l{i}"]["w"]
        assert type(got) is type(exp), (i, type(got))
        assert got.dtype == exp.dtype and tuple(got.shape) == tuple(exp.shape), (i, got.dtype, got.shape)
        assert bits(got) == bits(exp), i
    assert out["cfg"] == JSON_LEAVES


def files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def relative(root: Path) -> list[str]:
    return [p.relative_to(root).as_posix() for p in files(root)]


def data_files(root: Path, rank: int = 0) -> list[Path]:
    return sorted((root / _packs.rank_base(rank) / "d").iterdir())


# A rank's database: its manifest and its data files, one per writing thread
# (``test_a_rank_writes_a_data_file_per_thread``) below the default pack_bytes.
MOST_DATA_FILES_PER_RANK = lc.IOConfig().threads


def assert_packed_files(root: Path, world: int = 1) -> int:
    """The files of a packed checkpoint saved by ``world`` ranks, each below ``pack_bytes``: the
    marker, the root database (manifest and its B-tree) and each rank's database; nothing per
    array. Returns how many."""
    names = relative(root)
    assert {"zarr.json", "manifest.ocdbt"} <= set(names), names
    root_btree = [n for n in names if n.startswith("d/")]
    assert 1 <= len(root_btree) <= 2, names
    for r in range(world):
        base = _packs.rank_base(r)
        assert f"{base}/manifest.ocdbt" in names, names
        assert 1 <= len([n for n in names if n.startswith(f"{base}/d/")]) <= MOST_DATA_FILES_PER_RANK, names
    others = [n for n in names if n not in ("zarr.json", "manifest.ocdbt") and not n.startswith(("d/", "packs/"))]
    assert not others, others
    assert len(names) <= 3 + world * (1 + MOST_DATA_FILES_PER_RANK)
    return len(names)


def zarr_members(path: Path) -> tuple[list[str], list[str]]:
    """The arrays and groups zarr-python finds at the root (its warnings about the objects it
    does not know, the database's files, silenced)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zarr.errors.ZarrUserWarning)
        group = zarr.open_group(path, mode="r")
        return list(group.array_keys()), list(group.group_keys())


def root_meta(root: Path) -> dict:
    return json.loads((root / "zarr.json").read_bytes())["attributes"]["layoutckpt"]


def cli(capsys, *argv) -> tuple[int, str]:
    code = _cli.main([str(a) for a in argv])
    out, _ = capsys.readouterr()
    return code, out


# --- 1. round trips, the choice of "auto", the files on disk ------------------------------------


@pytest.mark.parametrize(
    ("packing", "n", "expected"),
    [
        ("ocdbt", 10, "ocdbt"),
        ("ocdbt", 600, "ocdbt"),
        ("files", 600, "files"),
        ("auto", 600, "ocdbt"),
        ("auto", 10, "files"),
    ],
)
def test_round_trip_is_bit_exact_in_the_packing_asked_for(tmp_path, packing, n, expected):
    path = tmp_path / "ck"
    lc.save(path, state_of(n), packing=packing)
    assert lc.open(path).meta.packing == expected
    assert_state(lc.load(path), n)
    with lc.open(path) as rd:
        assert sorted(rd.value_keys()) == sorted(f"cfg.{k}" for k in JSON_LEAVES)
        for i in (0, 1, n - 1):
            assert bits(rd.read(f"l{i}.w")) == bits(as_numpy(leaf(i)))

    found = verify(lc.open(path))  # every group and array document, every shard's checksums
    assert found.ok and found.arrays == n and found.shards == n, found.problems[:3]

    names = relative(path)
    meta = root_meta(path)
    if expected == "ocdbt":
        # The commit marker, the root database, rank 0's database: nothing per array.
        assert meta["packing"] == "ocdbt" and meta["format_version"] == lc.FORMAT_VERSION
        assert_packed_files(path)
        assert not any(name.endswith("c.0.0") or name.endswith("c.0") for name in names)
    else:
        assert meta.get("packing", "files") == "files"
        assert "manifest.ocdbt" not in names and not (path / "packs").exists()
        # A shard, an array document and a group document per array, and the marker.
        assert len(names) == 3 * n + 1, len(names)
        if n == 600:
            assert len(names) > 1000


def test_auto_packs_exactly_above_the_threshold(tmp_path):
    """``auto`` counts a shard and a document per array: 500 single-shard arrays are 1000
    objects (files), 501 are 1002 (packed)."""
    assert _packs.PACK_ABOVE_OBJECTS == 1000
    below = tmp_path / "below"
    lc.save(below, state_of(500))
    assert lc.open(below).meta.packing == "files"
    above = tmp_path / "above"
    lc.save(above, state_of(501))
    assert lc.open(above).meta.packing == "ocdbt"
    assert assert_packed_files(above) < 100 and len(files(below)) == 3 * 500 + 1
    assert_state(lc.load(above), 501)


def test_a_packed_load_opens_each_data_file_once_and_closes_it(tmp_path, monkeypatch):
    """A load reads 600 shards from one data file: the file is opened a few times in all (by
    each reading thread that finds it not yet open, and for the B+tree's nodes), not once per
    shard, and closed when the load ends."""
    path = tmp_path / "ck"
    lc.save(path, state_of(600), packing="ocdbt")
    opened = []
    real = _os.open_regular_at
    monkeypatch.setattr(_os, "open_regular_at", lambda fd, rel: opened.append(rel) or real(fd, rel))
    before = len(os.listdir("/proc/self/fd"))
    assert_state(lc.load(path), 600)
    assert len(os.listdir("/proc/self/fd")) == before
    data = Counter(rel for rel in opened if "/d/" in rel)
    assert data and max(data.values()) <= 4, data


def test_packed_with_compression_and_a_multi_chunk_array(tmp_path):
    """zstd-compressed shards, an array of many inner chunks and a 0-d one, packed."""
    path = tmp_path / "ck"
    big = torch.arange(512 * 256, dtype=torch.float32).reshape(512, 256) % 97
    state = {"big": big, "scalar": np.array(3.5, dtype=np.float64), "e": np.zeros((0, 4), np.float32), "k": 4}
    lc.save(path, state, packing="ocdbt", compression="zstd", inner_chunk_bytes=16 << 10)
    rd = lc.open(path)
    assert rd.meta.packing == "ocdbt" and rd.info("big").compression == "zstd"
    assert math.prod(s // c for s, c in zip(rd.info("big").shard_shape, rd.info("big").inner_chunk_shape)) > 1
    out = lc.load(path)
    assert bits(out["big"]) == bits(big) and out["big"].dtype == torch.float32
    assert out["scalar"].shape == () and out["scalar"] == 3.5
    assert out["e"].shape == (0, 4) and out["k"] == 4
    # compressed: the data file holds fewer bytes than the array
    assert sum(f.stat().st_size for f in data_files(path)) < big.numel() * 4


# --- 2. the rank's data files: one per writing thread, none much past pack_bytes ----------------


def pack_state(n: int, nbytes: int) -> dict[str, np.ndarray]:
    """``n`` float32 arrays of ``nbytes`` each, all different."""
    return {f"a{i}": np.arange(nbytes // 4, dtype=np.float32) * (i + 1) for i in range(n)}


def stored_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in data_files(path))


def test_small_pack_bytes_stores_each_byte_once_and_reads_back_exactly(tmp_path):
    """64 arrays of 16 KiB (1 MiB) with ``pack_bytes`` of 64 KiB: a thread starts a new data
    file every 4 arrays; every byte is stored once, and everything reads back."""
    state = pack_state(64, 16 << 10)
    total = sum(a.nbytes for a in state.values())
    assert total == 1 << 20
    path = tmp_path / "small"
    lc.save(path, state, packing="ocdbt", io=lc.IOConfig(pack_bytes=64 << 10))
    assert lc.open(path).meta.packing == "ocdbt"
    # Each shard once (its crc32c and index besides), then the documents and the B+tree.
    assert total <= stored_bytes(path) < total + 64 * 1024 + (64 << 10)
    out = lc.load(path)
    assert all(bits(out[k]) == bits(v) for k, v in state.items())
    with lc.open(path) as rd:
        assert bits(rd.read("a63", np.s_[100:200])) == bits(state["a63"][100:200])


def test_pack_bytes_bounds_each_data_file(tmp_path):
    """What ``IOConfig.pack_bytes`` promises: a thread starts a new data file once its file holds
    ``pack_bytes``, so no data file holds much more than ``pack_bytes`` and one shard."""
    pack, shard = 8 << 10, 8 << 10
    state = pack_state(128, shard)
    path = tmp_path / "ck"
    lc.save(path, state, packing="ocdbt", io=lc.IOConfig(pack_bytes=pack))
    sizes = sorted(f.stat().st_size for f in data_files(path))
    assert len(sizes) >= 128 * shard // (pack + shard), sizes
    # One file also holds the rank's share of the zarr.json documents (< 1 KiB each) and the tree.
    assert sizes[-2] <= pack + shard + 4096 and sizes[-1] <= pack + shard + 128 * 1024, sizes


@pytest.mark.parametrize("threads", [1, 3])
def test_a_rank_writes_a_data_file_per_thread(tmp_path, threads):
    """Below ``pack_bytes`` a rank's shards lie in at most one data file per writing thread, on a
    local disk and on an object store alike, and read back exactly."""
    state = state_of(600)
    io = lc.IOConfig(threads=threads)
    path, url = tmp_path / "disk", f"memory://packing/{tmp_path.name}/per-thread-{threads}"
    for where in (path, url):
        lc.save(where, state, packing="ocdbt", io=io)
        assert_state(lc.load(where), 600)
    assert 1 <= len(data_files(path)) <= threads
    assert 1 <= len(locate(url).keys(f"{_packs.rank_base(0)}/d/")) <= threads


def test_each_data_file_starts_its_writeback_once_whole(tmp_path, monkeypatch):
    """A data file written through the page cache asks the kernel to start writing it once it is
    complete (``_os.start_writeback``), so the save's final sync does not find every file still
    in memory: each data file once, at its final size."""
    started: list[int] = []
    real = _os.start_writeback
    monkeypatch.setattr(_os, "start_writeback", lambda fd: (started.append(os.fstat(fd).st_size), real(fd)))
    path = tmp_path / "wb"
    lc.save(path, pack_state(64, 16 << 10), packing="ocdbt", io=lc.IOConfig(direct_io=False, pack_bytes=256 << 10))
    sizes = sorted(f.stat().st_size for f in data_files(path))
    assert len(sizes) >= 4
    assert sorted(started) == sizes, (started, sizes)


def test_data_files_go_past_the_page_cache_where_the_file_system_allows(tmp_path, monkeypatch):
    """Where the file system takes ``O_DIRECT``, a data file is written past the page cache in
    blocks and cut back to its length: the values lie packed one after another all the same."""
    fd = _os.create_file(tmp_path / "probe", direct=True)
    direct = _os.is_direct(fd)
    os.close(fd)
    blocks: list[int] = []
    real = _os.write_direct
    monkeypatch.setattr(_os, "write_direct", lambda fd, buf, at: (blocks.append(len(buf)), real(fd, buf, at)))
    state = pack_state(6, 3 << 20)
    path = tmp_path / "direct"
    lc.save(path, state, packing="ocdbt", io=lc.IOConfig(direct_bytes=1 << 20))
    assert (len(blocks) >= 18) == direct, (direct, blocks)
    out = lc.load(path)
    assert all(bits(out[k]) == bits(v) for k, v in state.items())
    assert sum(a.nbytes for a in state.values()) <= stored_bytes(path) < sum(a.nbytes for a in state.values()) + 65536


# --- 3. partial reads -----------------------------------------------------------------------------

CRC = 4
INDEX_ENTRY = 16


def chunk_accounting(info: lc.ArrayInfo, box) -> int:
    """The most a read of ``box`` fetches of the shard: the inner chunks it overlaps (each with its
    crc32c) and the index of each shard it overlaps, twice: TensorStore reads it, and layoutckpt
    reads it once more to check that no two entries overlap."""
    shard, inner = info.shard_shape, info.inner_chunk_shape
    chunk_bytes = info.dtype.itemsize * math.prod(inner) + CRC
    index_bytes = INDEX_ENTRY * math.prod(s // c for s, c in zip(shard, inner)) + CRC
    total = 0
    for cell in itertools.product(*(range(a // s, -(-b // s)) for (a, b), s in zip(box, shard))):
        sub = [(max(a, i * s), min(b, (i + 1) * s)) for (a, b), i, s in zip(box, cell, shard)]
        total += (
            math.prod((hi - 1) // c - lo // c + 1 for (lo, hi), c in zip(sub, inner)) * chunk_bytes
            + 2 * index_bytes
            + 32
        )  # the index twice, and once the binding block before it (format 5.4)
    return total


@pytest.mark.parametrize("index", [np.s_[0:10, 0:10], np.s_[300:400, 600:700], np.s_[1000:, :5]])
def test_a_slice_of_a_packed_array_reads_only_its_inner_chunks(tmp_path, index):
    """Bytes counted by TensorStore's file-kvstore counter: the OCDBT database reads its manifest,
    its B-tree node and byte ranges of the data file through the file kvstore, so the counter sees
    every byte a packed read fetches."""
    path = tmp_path / "ck"
    big = np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)  # 4 MiB, one shard
    lc.save(path, {"big": big, "small": np.arange(5)}, packing="ocdbt")
    # What the database reads besides the shard's bytes: its manifest and B-tree.
    btree = (path / "manifest.ocdbt").stat().st_size + sum(f.stat().st_size for f in (path / "d").iterdir())
    assert btree < 4096

    rd = lc.open(path)
    info = rd.info("big")
    assert info.shard_shape == (1024, 1024) and info.inner_chunk_shape[0] < 1024
    box = tuple((sl.start or 0, n if sl.stop is None else sl.stop) for sl, n in zip(index, info.shape))
    before = bytes_read()
    got = rd.read("big", index)
    fetched = bytes_read() - before
    assert got.tobytes() == big[index].tobytes()
    assert big[index].nbytes <= fetched <= chunk_accounting(info, box) + 4 * btree, (fetched, info)
    assert fetched < big.nbytes // 8


# --- 4. plain TensorStore reads it; plain zarr-python finds nothing --------------------------------


def test_plain_tensorstore_opens_every_array_from_the_documented_spec(tmp_path):
    n = 600
    path = (tmp_path / "ck").absolute()
    lc.save(path, state_of(n), packing="auto")
    assert lc.open(path).meta.packing == "ocdbt"
    kvstore = {"driver": "ocdbt", "base": f"file://{path}/"}
    for i in range(n):
        arr = ts.open({"driver": "zarr3", "kvstore": kvstore, "path": f"l{i}/w/"}, open=True).result()
        want = as_numpy(leaf(i))
        got = arr.read().result()
        assert got.dtype == want.dtype and got.shape == want.shape, i
        assert got.tobytes() == want.tobytes(), i


def test_plain_zarr_finds_no_array_in_a_packed_checkpoint(tmp_path):
    """zarr-python does not read OCDBT: it must find nothing (the root group, no members),
    never a stale or a wrong array."""
    path = tmp_path / "ck"
    lc.save(path, state_of(20), packing="ocdbt")
    group = zarr.open_group(path, mode="r")
    assert dict(group.attrs)["layoutckpt"]["packing"] == "ocdbt"  # what tells a reader why
    assert zarr_members(path) == ([], [])
    with pytest.raises(KeyError):
        group["l5"]
    with pytest.raises(FileNotFoundError):
        zarr.open_array(path / "l5" / "w", mode="r")


# --- 5. integrity -----------------------------------------------------------------------------------


def damaged_state() -> dict:
    return {
        "A": np.random.default_rng(1).standard_normal((64, 64)).astype(np.float32),
        "B": torch.linspace(-3, 3, 40).to(torch.bfloat16).reshape(8, 5),
        "C": np.arange(50, dtype=np.int64) * 3,
        "step": 11,
    }


def holding(path: Path, payload: bytes) -> tuple[Path, int]:
    """The data file of rank 0 that holds ``payload`` (stored once, uncompressed), and where."""
    found = [(f, f.read_bytes().find(payload)) for f in data_files(path)]
    found = [(f, at) for f, at in found if at >= 0]
    assert len(found) == 1, found
    data, at = found[0]
    assert data.read_bytes().find(payload, at + 1) < 0, "the payload is stored twice"
    return data, at


def flip_in_data_file(path: Path, payload: bytes) -> None:
    """Flip one byte in the middle of ``payload`` where it lies in rank 0's data file."""
    data, at = holding(path, payload)
    raw = bytearray(data.read_bytes())
    raw[at + len(payload) // 2] ^= 0x5A
    data.write_bytes(bytes(raw))


def test_verify_passes_then_a_flipped_byte_in_a_data_file_is_found(tmp_path, capsys):
    path = tmp_path / "ck"
    full = damaged_state()
    lc.save(path, full, packing="ocdbt")
    found = verify(lc.open(path))
    assert found.ok and (found.arrays, found.shards) == (3, 3) and found.warnings == []
    code, out = cli(capsys, "verify", path, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["ok"] and doc["arrays"] == 3 and doc["problems"] == []

    flip_in_data_file(path, full["A"].tobytes())

    with pytest.raises(lc.IntegrityError, match="array 'A'"):
        lc.load(path)
    with pytest.raises(lc.IntegrityError, match="array 'A'"):
        lc.open(path).read("A")
    found = verify(lc.open(path))
    assert [(p.array, p.shard) for p in found.problems] == [("A", "c.0.0")], found.problems
    assert "fails its checksum" in found.problems[0].text
    code, out = cli(capsys, "verify", path, "--json")
    doc = json.loads(out)
    assert code == 1 and doc["damaged_arrays"] == ["A"]
    # The other arrays are untouched.
    out = lc.load(path, select=["B", "C", "step"])
    assert bits(out["B"]) == bits(full["B"]) and bits(out["C"]) == bits(full["C"]) and out["step"] == 11


def test_a_deleted_root_manifest_is_an_integrity_error(tmp_path, capsys):
    """Without ``manifest.ocdbt`` the database is empty: every read is ``IntegrityError`` (missing
    from storage), ``verify`` reports every array, and the CLI exits 1."""
    path = tmp_path / "ck"
    lc.save(path, damaged_state(), packing="ocdbt")
    (path / "manifest.ocdbt").unlink()
    rd = lc.open(path)  # the commit marker is a plain file: the checkpoint is still found
    assert rd.meta.packing == "ocdbt"
    with pytest.raises(lc.IntegrityError, match="missing from storage"):
        lc.load(path)
    for name in ("A", "B", "C"):
        with pytest.raises(lc.IntegrityError, match=f"array '{name}'"):
            rd.read(name)
    found = verify(lc.open(path))
    assert not found.ok and found.damaged_arrays == ["A", "B", "C"]
    assert cli(capsys, "verify", path)[0] == 1


def test_a_damaged_root_manifest_fails_loads_with_integrity_error(tmp_path, capsys):
    """The manifest carries a crc32c: one flipped byte is an ``IntegrityError`` on every read;
    ``verify`` of arrays at the root reports each, and the CLI exits 1."""
    path = tmp_path / "ck"
    lc.save(path, damaged_state(), packing="ocdbt")
    raw = bytearray((path / "manifest.ocdbt").read_bytes())
    raw[len(raw) // 2] ^= 0x5A
    (path / "manifest.ocdbt").write_bytes(bytes(raw))
    with pytest.raises(lc.IntegrityError, match="fail their integrity check"):
        lc.load(path)
    with pytest.raises(lc.IntegrityError):
        lc.open(path).read("C")
    found = verify(lc.open(path))
    assert not found.ok and found.damaged_arrays == ["A", "B", "C"], found.problems
    assert cli(capsys, "verify", path)[0] == 1


def test_verify_reports_a_damaged_root_database_wherever_the_byte_lies(tmp_path):
    """Arrays in groups (``l0.w``): ``verify`` reads the group documents through TensorStore
    first. A flipped byte in the zstd frame of the root's manifest or B-tree node fails before
    its checksum is checked, where TensorStore's error carries no status code: it is damage
    all the same, wherever it lies."""
    path = tmp_path / "ck"
    lc.save(path, state_of(3), packing="ocdbt")
    for stored in [path / "manifest.ocdbt", *(path / "d").iterdir()]:
        good = stored.read_bytes()
        for at in range(len(good)):
            raw = bytearray(good)
            raw[at] ^= 0x5A
            stored.write_bytes(bytes(raw))
            try:
                found = verify(lc.open(path))
            except lc.IntegrityError:
                continue
            assert not found.ok, (stored.name, at)
        stored.write_bytes(good)


def test_a_truncated_data_file_is_an_integrity_error(tmp_path):
    path = tmp_path / "ck"
    full = damaged_state()
    lc.save(path, full, packing="ocdbt")
    data, at = holding(path, full["A"].tobytes())
    data.write_bytes(data.read_bytes()[: at + full["A"].nbytes // 2])
    with pytest.raises(lc.IntegrityError):
        lc.load(path)


def test_a_deleted_data_file_is_an_integrity_error(tmp_path):
    path = tmp_path / "ck"
    full = damaged_state()
    lc.save(path, full, packing="ocdbt")
    data, _ = holding(path, full["A"].tobytes())
    data.unlink()
    with pytest.raises(lc.IntegrityError):
        lc.load(path)
    assert not verify(lc.open(path)).ok


# --- 6. save_async, overwrite, memory:// ----------------------------------------------------------


def test_save_async_packed_round_trip(tmp_path):
    path = tmp_path / "ck"
    state = state_of(40)
    fut = lc.save_async(path, state, packing="ocdbt", step=3)
    result = fut.result()
    assert result.arrays_written == 40
    assert lc.open(path).meta.packing == "ocdbt" and lc.open(path).step == 3
    assert_state(lc.load(path), 40)
    assert_packed_files(path)


def test_overwrite_replaces_a_packed_checkpoint_whole(tmp_path):
    path = tmp_path / "ck"
    old = {"w": np.full((32, 32), 1.0, np.float32), "v": np.arange(10)}
    new = {"w": np.full((32, 32), 2.0, np.float32), "u": np.arange(3)}
    lc.save(path, old, packing="ocdbt")
    old_data = {p.name for p in data_files(path)}
    with pytest.raises(lc.CheckpointExistsError):
        lc.save(path, new, packing="ocdbt")

    # packed over packed: the new checkpoint's files only
    lc.save(path, new, packing="ocdbt", overwrite=True)
    rd = lc.open(path)
    assert rd.keys() == ["w", "u"] and bits(rd.read("w")) == bits(new["w"])
    assert not old_data & {p.name for p in data_files(path)}
    assert_packed_files(path)
    assert not [p for p in tmp_path.iterdir() if p.name != "ck"]  # nothing set aside remains

    # files over packed: no database left behind
    lc.save(path, old, packing="files", overwrite=True)
    assert lc.open(path).meta.packing == "files"
    assert not (path / "packs").exists() and not (path / "manifest.ocdbt").exists() and not (path / "d").exists()
    assert bits(lc.load(path)["w"]) == bits(old["w"])

    # packed over files: no plain shard left for zarr-python to read as if current
    lc.save(path, new, packing="ocdbt", overwrite=True)
    assert not list(path.glob("**/c.*")) and not (path / "v").exists()
    assert zarr_members(path) == ([], [])
    out = lc.load(path)
    assert set(out) == {"w", "u"} and bits(out["w"]) == bits(new["w"]) and bits(out["u"]) == bits(new["u"])


def test_memory_location_packed_round_trip(tmp_path):
    url = f"memory://packing/{tmp_path.name}/ck"
    lc.save(url, state_of(600), packing="auto")
    assert lc.open(url).meta.packing == "ocdbt"
    assert_state(lc.load(url), 600)
    loc = locate(url)
    assert isinstance(loc, KvPrefix)
    keys = loc.keys()
    assert "zarr.json" in keys and "manifest.ocdbt" in keys and "packs/00000/manifest.ocdbt" in keys
    assert len(keys) < (3 * 600 + 1) // 10, keys  # a files checkpoint of this state: 1801 objects


# --- 7. CheckpointManager ---------------------------------------------------------------------------


def test_manager_retention_removes_a_packed_step_whole(tmp_path):
    root = tmp_path / "run"
    with lc.CheckpointManager(root, keep_last=2, packing="ocdbt") as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": np.full((16, 16), step, np.float32), "s": step})
            mgr.wait()
        assert mgr.steps() == [2, 3]
        assert not Path(mgr.path(1)).exists()
        for step in (2, 3):
            assert lc.open(mgr.path(step)).meta.packing == "ocdbt"
            out = mgr.load(step=step)
            assert bits(out["w"]) == bits(np.full((16, 16), step, np.float32)) and out["s"] == step
            assert_packed_files(Path(mgr.path(step)))
    left = sorted(p.name for p in root.iterdir() if not p.name.startswith(".layoutckpt"))
    assert left == [Path(mgr.path(2)).name, Path(mgr.path(3)).name]


# --- 8. S3 ----------------------------------------------------------------------------------------

BUCKET = "packing"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """The loopback S3 server, with moto's request recorder writing to a file of ours."""
    recording = tmp_path_factory.mktemp("moto") / "requests.jsonl"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOTO_RECORDER_FILEPATH", str(recording))  # the server process inherits it
        with running(BUCKET) as server:
            server.recording = recording
            yield server


def _recorder(server, what: str) -> None:
    req = urllib.request.Request(f"{server.endpoint}/moto-api/recorder/{what}", method="POST")
    urllib.request.urlopen(req, timeout=10).close()


def recorded_save(server, url: str, state, **options) -> Counter:
    """Save, counting the requests the server received meanwhile by method (PUT: objects written)."""
    _recorder(server, "reset-recording")
    _recorder(server, "start-recording")
    try:
        lc.save(url, state, **options)
    finally:
        _recorder(server, "stop-recording")
    lines = server.recording.read_text().splitlines()
    return Counter(json.loads(line)["method"] for line in lines)


def s3_keys(server, prefix: str) -> list[str]:
    kv = ts.KvStore.open({"driver": "s3", "bucket": BUCKET, "path": prefix, "endpoint": server.endpoint}).result()
    return sorted(k.decode() for k in kv.list().result())


def test_s3_packed_checkpoint_is_a_few_objects(s3, tmp_path):
    n = 600
    state = state_of(n)
    packed = f"s3://{BUCKET}/{tmp_path.name}/auto"
    requests = recorded_save(s3, packed, state, packing="auto")
    assert lc.open(packed).meta.packing == "ocdbt"
    assert_state(lc.load(packed), n)
    keys = s3_keys(s3, f"{tmp_path.name}/auto/")
    assert "zarr.json" in keys and "manifest.ocdbt" in keys and len(keys) <= 8, keys
    assert 3 <= requests["PUT"] <= 12, requests

    plain = f"s3://{BUCKET}/{tmp_path.name}/files"
    requests_files = recorded_save(s3, plain, state, packing="files")
    assert lc.open(plain).meta.packing == "files"
    keys_files = s3_keys(s3, f"{tmp_path.name}/files/")
    assert len(keys_files) == 3 * n + 1 > 800
    assert requests_files["PUT"] >= 3 * n + 1 and requests_files["PUT"] > 100 * requests["PUT"], requests_files
    with lc.open(plain) as rd:
        assert bits(rd.read(f"l{n - 1}.w")) == bits(as_numpy(leaf(n - 1)))


def test_recorded_bodies_hold_the_data_once(s3, tmp_path):
    """The packed save's PUTs carry each shard's bytes once: no array is written twice."""
    url = f"s3://{BUCKET}/{tmp_path.name}/ck"
    payload = np.random.default_rng(5).standard_normal((128, 64)).astype(np.float32)
    recorded_save(s3, url, {"x": payload, **{f"s{i}": np.arange(3) + i for i in range(5)}}, packing="ocdbt")
    bodies = b"".join(
        base64.b64decode(e["body"]) if e.get("body_encoded") else e.get("body", "").encode()
        for e in map(json.loads, s3.recording.read_text().splitlines())
        if e["method"] == "PUT"
    )
    assert bodies.count(payload.tobytes()[:256]) == 1
    assert bits(lc.open(url).read("x")) == bits(payload)
