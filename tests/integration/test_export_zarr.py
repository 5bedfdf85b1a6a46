"""``export_zarr`` / ``layoutckpt export --to zarr``: a packed checkpoint becomes a plain one.

The export is the same checkpoint: the same metadata but ``packing``, every array and per-rank
document bit for bit, ``verify`` passes, and plain zarr-python reads every array; it is a file
per shard and per document (the golden packed checkpoint unpacks to the golden parallel one,
file for file); it commits as a save does (nothing at the destination after a failure, an
existing checkpoint refused without ``overwrite``); a plain source is refused with a
``ValueError``; and any location works at either end (``memory://``, ``s3://`` on moto).
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import attrs
import ml_dtypes
import numpy as np
import pytest
import torch
import zarr

import layoutckpt as lc
from layoutckpt import _unpack
from layoutckpt._verify import verify
from layoutckpt.base import _faults
from layoutckpt.cli import _main as cli
from layoutckpt.storage._location import locate
from tests.support.paths import GOLDEN
from tests.support.s3server import running

MANY = 600
MESH = {"tp": 2}
# name -> (global shape, torch dtype, spec); sharded over tp so each rank's pack holds its half.
ARRAYS = {
    "model.w": ((8, 6), torch.float32, ("tp", None)),
    "model.bf": ((6, 10), torch.bfloat16, (None, "tp")),
    "model.f8": ((9,), torch.float8_e4m3fn, ("tp",)),
    "model.mask": ((4, 5), torch.bool, ()),
    "opt.step": ((), torch.int64, ()),
    "opt.u8": ((7, 3), torch.uint8, ("tp", None)),
    "opt.v": ((3, 4, 5), torch.float64, (None, None, "tp")),
}
JSON_LEAVES = {"lr": 0.001, "name": "export", "betas": [0.9, 0.95]}
CARRIERS = {
    torch.bfloat16: (torch.int16, ml_dtypes.bfloat16),
    torch.float8_e4m3fn: (torch.uint8, ml_dtypes.float8_e4m3fn),
}


def full(i: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Random bits of the dtype (NaNs and all), the same on every rank."""
    g = torch.Generator().manual_seed(77 + i)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g, dtype=torch.uint8).bool()
    width = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (int(np.prod(shape)) * width,), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype in CARRIERS:
        carrier, np_type = CARRIERS[t.dtype]
        return t.view(carrier).numpy().view(np_type)
    return t.numpy()


def bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8).tobytes()


def rank_state_of(rank: int) -> dict:
    return {"rank": rank, "rng": np.arange(4, dtype=np.uint32) * (rank + 1), "seen": [rank, "x"], "b": b"\x00\xff"}


def _save_mixed(rank, group, path):
    mesh = lc.Mesh(MESH)
    state: dict = {"model": {}, "opt": {}, "cfg": dict(JSON_LEAVES)}
    rules = []
    for i, (name, (shape, dtype, spec)) in enumerate(ARRAYS.items()):
        box = lc.shard_box(shape, lc.P(*spec), mesh, rank)
        part, leaf = name.split(".")
        state[part][leaf] = full(i, shape, dtype)[tuple(slice(a, b) for a, b in box)].clone()
        rules.append((f"^{name.replace('.', '[.]')}$", lc.P(*spec)))
    layout = lc.Layout(mesh, rules)
    lc.save(
        path,
        state,
        layout,
        group=group,
        step=7,
        metadata={"run": "export"},
        packing="ocdbt",
        rank_state=rank_state_of(rank),
    )
    return True


def many_state() -> dict:
    rng = np.random.default_rng(5)
    return {f"layer{i:03d}": rng.standard_normal((3, 4)).astype(np.float32) for i in range(MANY)}


@pytest.fixture(scope="module")
def many(tmp_path_factory):
    path = tmp_path_factory.mktemp("many") / "ck"
    lc.save(path, many_state(), packing="ocdbt")
    return path


@pytest.fixture(scope="module")
def mixed(ranks, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("mixed") / "ck")
    assert ranks.run(_save_mixed, 2, path) == [True, True]
    return path


def files_of(root: Path) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, names in os.walk(root) for f in names)


def shard_count(meta) -> int:
    return len(_unpack.shard_bytes(meta))


def assert_same_checkpoint(dst, src) -> None:
    """``dst`` holds ``src``'s checkpoint, plain: its metadata but packing, every array and
    JSON value and per-rank document bit for bit, and verify passes."""
    got, want = lc.open(dst), lc.open(src)
    assert want.meta.packing == "ocdbt" and got.meta.packing == "files"
    assert got.meta == attrs.evolve(want.meta, packing="files", writers={})
    for name in want.keys():
        assert bits(got.read(name)) == bits(want.read(name)), name
    assert [got.read(n) for n in got.value_keys()] == [want.read(n) for n in want.value_keys()]
    assert repr(got.rank_states()) == repr(want.rank_states())
    v = verify(got)
    assert v.ok and v.shards == shard_count(got.meta), v.problems


def run(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# --- the export is the same checkpoint, plain -----------------------------------------------


def test_many_arrays_export_to_a_file_per_shard_and_load_equal(many, tmp_path):
    dst = tmp_path / "plain"
    calls = []
    copied = lc.export_zarr(many, dst, progress=lambda done, total: calls.append((done, total)))
    meta = lc.open(dst).meta
    assert meta.packing == "files" and len(meta.arrays) == MANY
    files = files_of(dst)
    shards = [f for f in files if os.path.basename(f) != "zarr.json"]
    assert len(shards) == shard_count(meta) == MANY  # one file per shard, nothing packed
    assert len(files) == 2 * MANY + 1  # and a document per array, and the root's
    assert copied == sum((dst / f).stat().st_size for f in files if f != "zarr.json")
    loaded, want = lc.load(dst), many_state()
    assert loaded.keys() == want.keys() and all(bits(loaded[k]) == bits(want[k]) for k in want)
    assert_same_checkpoint(dst, many)
    # Progress in the arrays' bytes, after each batch, to the checkpoint's size.
    total = sum(a.nbytes for a in want.values())
    assert calls and calls[-1] == (total, total)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)


def test_small_batches_copy_the_same_checkpoint(many, tmp_path, monkeypatch):
    monkeypatch.setattr(_unpack, "BATCH_BYTES", 1000)  # a few shards a batch: many batches
    calls = []
    lc.export_zarr(many, tmp_path / "plain", progress=lambda done, total: calls.append(done))
    assert len(calls) > 100
    assert_same_checkpoint(tmp_path / "plain", many)


def test_batches_hold_about_the_limit():
    sizes = {f"k{i}": 3000 for i in range(10)} | {"big": 50_000}  # a document counts 4096
    keys = ["k0", "k1", "k2", "big", "k3", "doc/zarr.json", "k4"]
    got = list(_unpack.batches(keys, sizes, limit=10_000))
    assert got == [["k0", "k1", "k2"], ["big"], ["k3", "doc/zarr.json"], ["k4"]]
    assert [k for b in got for k in b] == keys


def test_multi_rank_mixed_dtypes_export_with_the_api(mixed, tmp_path):
    dst = tmp_path / "plain"
    lc.export_zarr(mixed, dst)
    assert lc.open(dst).meta.packing == "files"
    assert lc.open(mixed).meta.writers and not lc.open(dst).meta.writers  # the databases stay behind
    assert_same_checkpoint(dst, mixed)
    got, want = lc.load(dst), lc.load(mixed)
    assert got["cfg"] == want["cfg"] == JSON_LEAVES
    for name in ARRAYS:
        part, leaf = name.split(".")
        assert got[part][leaf].dtype == want[part][leaf].dtype
        assert bits(to_numpy(got[part][leaf])) == bits(to_numpy(want[part][leaf])), name
    assert repr(lc.open(dst).rank_states()) == repr([rank_state_of(0), rank_state_of(1)])
    files = files_of(dst)
    assert {".rank_state/zarr.json", ".rank_state/00000/zarr.json", ".rank_state/00001/zarr.json"} <= set(files)
    assert not any(f.startswith(("packs/", "d/")) or f == "manifest.ocdbt" for f in files)
    shards = [f for f in files if os.path.basename(f) != "zarr.json"]
    assert len(shards) == shard_count(lc.open(dst).meta)


def test_multi_rank_export_with_the_cli_reads_in_plain_zarr_and_verifies(mixed, tmp_path, capsys):
    dst = tmp_path / "plain"
    code, out, err = run(capsys, "export", mixed, dst, "--to", "zarr", "--progress")
    assert code == 0, err
    assert str(dst) in out and "plain zarr" in out and "export" in err  # the bar, on request
    root = zarr.open_group(str(dst), mode="r")
    assert "packing" not in root.attrs["layoutckpt"]
    for i, (name, (shape, dtype, _)) in enumerate(ARRAYS.items()):
        arr = root[name.replace(".", "/")]
        assert isinstance(arr, zarr.Array) and arr.shape == shape
        assert bits(arr[...]) == bits(to_numpy(full(i, shape, dtype))), name
    code, out, err = run(capsys, "verify", dst)
    assert code == 0 and "OK" in out and "2 per-rank documents" in out, (out, err)
    assert_same_checkpoint(dst, mixed)


def test_golden_packed_unpacks_to_the_golden_parallel_checkpoint_file_for_file(tmp_path):
    """The golden ``packed`` is ``parallel``'s save with packing="ocdbt" (four ranks' packs):
    unpacked, it is ``parallel`` byte for byte, its root document included."""
    dst = tmp_path / "unpacked"
    lc.export_zarr(GOLDEN / "v5" / "packed", dst)
    parallel = GOLDEN / "v5" / "parallel"
    assert files_of(dst) == files_of(parallel)
    for f in files_of(parallel):
        assert (dst / f).read_bytes() == (parallel / f).read_bytes(), f


# --- commits as a save does ----------------------------------------------------------------


def test_an_existing_checkpoint_is_refused_without_overwrite(many, tmp_path, capsys):
    dst = tmp_path / "plain"
    lc.export_zarr(many, dst)
    with pytest.raises(lc.CheckpointExistsError, match="already exists"):
        lc.export_zarr(many, dst)
    code, _, err = run(capsys, "export", many, dst, "--to", "zarr")
    assert code == 1 and "already exists" in err
    code, _, err = run(capsys, "export", many, dst, "--to", "zarr", "--overwrite", "--no-progress")
    assert code == 0, err
    assert_same_checkpoint(dst, many)
    assert files_of(tmp_path) == ["plain/" + f for f in files_of(dst)]  # nothing left beside it


def test_a_failure_before_the_commit_leaves_no_checkpoint(many, tmp_path):
    def boom(**_):
        raise RuntimeError("crash at the commit")

    dst = tmp_path / "plain"
    with _faults.hooks({"commit.marker": boom}), pytest.raises(RuntimeError, match="crash at the commit"):
        lc.export_zarr(many, dst)
    assert list(tmp_path.iterdir()) == []  # neither the checkpoint nor its staging directory

    url = f"memory://lc-{uuid.uuid4().hex[:8]}/plain"
    with _faults.hooks({"commit.marker": boom}), pytest.raises(RuntimeError):
        lc.export_zarr(many, url)
    assert not locate(url).exists()
    lc.export_zarr(many, url)  # and the destination takes the next export
    assert_same_checkpoint(url, many)


def test_a_plain_source_is_refused_with_a_value_error(tmp_path, capsys):
    src = tmp_path / "plain"
    lc.save(src, {"a": np.arange(3)}, packing="files")
    with pytest.raises(ValueError, match="already plain"):
        lc.export_zarr(src, tmp_path / "out")
    code, _, err = run(capsys, "export", src, tmp_path / "out", "--to", "zarr")
    assert code == 1 and "already plain" in err
    assert not (tmp_path / "out").exists()


def test_the_source_itself_and_a_missing_source_are_refused(many, tmp_path):
    with pytest.raises(ValueError, match="the source itself"):
        lc.export_zarr(many, many, overwrite=True)
    assert lc.open(many).meta.packing == "ocdbt"
    with pytest.raises(lc.CheckpointNotFoundError):
        lc.export_zarr(tmp_path / "none", tmp_path / "out")


def test_cli_options_of_the_other_format_are_usage_errors(many, tmp_path, capsys):
    code, _, err = run(capsys, "export", many, tmp_path / "o", "--to", "zarr", "--select", "layer0")
    assert code == 2 and "--select" in err
    code, _, err = run(capsys, "export", many, tmp_path / "o", "--overwrite")
    assert code == 2 and "--overwrite" in err
    assert not (tmp_path / "o").exists()


# --- any location at either end ------------------------------------------------------------


def test_memory_to_memory_and_back_to_a_local_directory(tmp_path):
    src = f"memory://lc-{uuid.uuid4().hex[:8]}/packed"
    lc.save(src, many_state(), packing="ocdbt")
    dst = f"memory://lc-{uuid.uuid4().hex[:8]}/plain"
    lc.export_zarr(src, dst)
    assert_same_checkpoint(dst, src)
    lc.export_zarr(src, tmp_path / "local")
    assert_same_checkpoint(tmp_path / "local", src)
    assert len(files_of(tmp_path / "local")) == 2 * MANY + 1


def test_local_to_s3(mixed):
    with running("export") as _:
        dst = f"s3://export/run-{uuid.uuid4().hex[:8]}/ck"
        lc.export_zarr(mixed, dst)
        assert_same_checkpoint(dst, mixed)
        keys = locate(dst).keys()
        assert ".layoutckpt-pending" not in keys and not any(k.startswith("packs/") for k in keys)
        with pytest.raises(lc.CheckpointExistsError):
            lc.export_zarr(mixed, dst)


def test_a_destination_inside_the_source_or_around_it_is_refused(many, tmp_path):
    before = files_of(many)
    with pytest.raises(ValueError, match="one inside the other"):
        lc.export_zarr(many, many / "plain")
    with pytest.raises(ValueError, match="one inside the other"):
        lc.export_zarr(many, many.parent, overwrite=True)
    assert files_of(many) == before


def test_a_destination_through_dot_dot_is_the_path_it_names(many, tmp_path):
    (tmp_path / "x").mkdir()
    lc.export_zarr(many, tmp_path / "x" / ".." / "plain")
    assert_same_checkpoint(tmp_path / "plain", many)


def test_a_missing_data_file_fails_the_export_and_verify_names_it(many, tmp_path):
    """TensorStore reads a value whose data file is gone as empty: the export must not commit
    those empty values as shards, and ``verify`` names the file rather than a missing chunk."""
    src = tmp_path / "ck"
    shutil.copytree(many, src)
    lost = next((src / "packs").glob("*/d/*"))
    lost.unlink()
    with pytest.raises(lc.IntegrityError, match="reads as empty: the data file under packs/"):
        lc.export_zarr(src, tmp_path / "plain")
    assert not (tmp_path / "plain").exists()
    found = [p.text for p in verify(lc.open(src)).problems]
    assert any(f"its data file {lost.relative_to(src)} is missing" in t for t in found), found
    assert not any("inner chunk is missing" in t for t in found), found
