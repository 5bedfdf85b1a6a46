"""The golden checkpoints of every format version stay readable, byte for byte as ``docs/format.md`` says.

The goldens under ``tests/golden/v<N>/`` were written once each by ``tests/golden/make_golden.py``
and are never regenerated here. Every expectation below is computed in this file, so a change in
the library that would read them differently fails, rather than being hidden by a re-cut golden.
Each test that reads ``basic`` runs on every version; they differ only where the spec says:

- version 1 nests a chunk key's parts as directories (``c/0/1``), version 2 joins them with dots
  in one file name (``c.0.1``);
- the version 1 goldens were written before ``all_chunks_stored``, so their all-zero chunks are
  absent; version 2's are all stored;
- version 3's root documents carry a SHA-256 of their metadata (``sha256``), which readers check;
- version 4 adds ``parallel``: a checkpoint saved under stages, local names, fused and padded
  tensors and a ZeRO buffer over tensor-parallel pieces, stored as global names and logical arrays
  (its tests are at the end);
- version 5 adds ``packed``: ``parallel`` in OCDBT databases;
- version 6's root documents carry a ``save_id``, and every shard a binding block naming that id,
  its array's path and its cell, between its last inner chunk and its index; readers check it.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
from pathlib import Path
from typing import Any

import attrs
import crc32c
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
import torch
import zarr

import layoutckpt as lc
from tests.support.paths import GOLDEN as GOLDENS

VERSIONS = (1, 2, 3, 4, 5, 6)
MISSING = 2**64 - 1


@attrs.frozen
class Golden:
    """The ``basic`` golden of one format version, and what that version changes."""

    version: int

    @property
    def root(self) -> Path:
        return GOLDENS / f"v{self.version}"

    @property
    def path(self) -> Path:
        return self.root / "basic"

    @property
    def separator(self) -> str:
        return "/" if self.version == 1 else "."

    @property
    def all_chunks_stored(self) -> bool:
        return self.version >= 2

    @property
    def sealed(self) -> bool:
        return self.version >= 3

    @property
    def bound(self) -> bool:
        return self.version >= 6

    def shard(self, name: str, *cell: int) -> Path:
        """The shard file of ``name`` at grid ``cell``, by the spec's chunk key rule."""
        return self.path / name.replace(".", "/") / self.separator.join(["c", *map(str, cell)])


@pytest.fixture(params=VERSIONS, ids=[f"v{v}" for v in VERSIONS])
def golden(request) -> Golden:
    return Golden(request.param)


SEALED = [v for v in VERSIONS if Golden(v).sealed]
BOUND = [v for v in VERSIONS if Golden(v).bound]


@pytest.fixture(params=SEALED, ids=[f"v{v}" for v in SEALED])
def sealed(request) -> Golden:
    """The goldens of the versions whose root document carries a checksum (3 on)."""
    return Golden(request.param)


def test_every_format_version_has_goldens():
    assert lc.FORMAT_VERSION == max(VERSIONS)
    assert sorted(p.name for p in GOLDENS.iterdir() if p.is_dir()) == [f"v{v}" for v in VERSIONS]


# ---------------------------------------------------------------------------------------------
# Expectations, computed here (not read from the generator).


def expected_arrays() -> dict[str, Any]:
    """Every stored array of ``basic``, whole, by global name, in tree order."""
    proj = [torch.tensor([[(k - 9) / 4 + i for k in range(r * 6, r * 6 + 6)] for r in range(3)]) for i in range(2)]
    return {
        "model.embed.weight": torch.tensor([[4.0 * r + c for c in range(4)] for r in range(5)]),
        "model.layers.0.proj.weight": proj[0].to(torch.bfloat16),
        "model.layers.0.norm.scale": torch.tensor([1.0, 1.125, 1.25, 1.375]),
        "model.layers.1.proj.weight": proj[1].to(torch.bfloat16),
        "model.layers.1.norm.scale": torch.tensor([2.0, 2.125, 2.25, 2.375]),
        "model.head.fp8": torch.tensor([[0.0, 0.5], [1.0, 1.5], [2.0, 2.5], [3.0, 3.5]]).to(torch.float8_e4m3fn),
        "counts": torch.tensor([k * 10**12 for k in range(-3, 4)], dtype=torch.int64),
        "mask": torch.tensor([[True, False], [False, True], [False, False]]),
        "tiny": torch.tensor([42], dtype=torch.int64),
        "temperature": torch.tensor(0.5, dtype=torch.float32),
        "optim.step": torch.tensor(3, dtype=torch.int64),
        "optim.state.0.exp_avg": torch.tensor([0.0, 0.5, 1.0, 1.5]),
        "table": np.array([[0 / 3, 1 / 3, 2 / 3], [3 / 3, 4 / 3, 5 / 3]], dtype=np.float64),
        "np_scalar": np.int32(-7),
    }


# name: (shape, dtype, shard_shape, inner_chunk_shape, spec as stored, kind)
EXPECTED_META = {
    "model.embed.weight": ([5, 4], "float32", [3, 4], [1, 4], ["tp", None], "torch"),
    "model.layers.0.proj.weight": ([3, 6], "bfloat16", [3, 3], [1, 3], [None, "tp"], "torch"),
    "model.layers.0.norm.scale": ([4], "float32", [4], [4], [], "torch"),
    "model.layers.1.proj.weight": ([3, 6], "bfloat16", [3, 3], [1, 3], [None, "tp"], "torch"),
    "model.layers.1.norm.scale": ([4], "float32", [4], [4], [], "torch"),
    "model.head.fp8": ([4, 2], "float8_e4m3fn", [2, 2], [2, 2], ["tp", None], "torch"),
    "counts": ([7], "int64", [4], [2], ["tp"], "torch"),
    "mask": ([3, 2], "bool", [2, 2], [2, 2], ["tp", None], "torch"),
    "tiny": ([1], "int64", [1], [1], ["tp"], "torch"),
    "temperature": ([], "float32", [], [], [], "torch"),
    "optim.step": ([], "int64", [], [], [], "torch"),
    "optim.state.0.exp_avg": ([4], "float32", [4], [4], [], "torch"),
    "table": ([2, 3], "float64", [2, 3], [1, 1], [], "numpy"),
    "np_scalar": ([], "int32", [], [], [], "numpy_scalar"),
}

# The inner chunk shape is the writer's choice (any block that divides the shard, format 5.2);
# the layoutckpt that wrote v2 keeps rows of at least MIN_RUN_BYTES where it can, so with the
# goldens' 16-byte target it cut these three arrays less finely than version 1's writer did.
INNER_SINCE_V2 = {"model.layers.0.proj.weight": [3, 3], "model.layers.1.proj.weight": [3, 3], "table": [1, 3]}


def expected_meta(version: int) -> dict[str, Any]:
    if version == 1:
        return EXPECTED_META
    return {
        name: (shape, dtype, shard, INNER_SINCE_V2.get(name, inner), spec, kind)
        for name, (shape, dtype, shard, inner, spec, kind) in EXPECTED_META.items()
    }


EXPECTED_RULES = [
    ["^model\\.embed\\.weight$", ["tp", None]],
    ["\\.proj\\.weight$", [None, "tp"]],
    ["\\.fp8$", ["tp", None]],
    ["^(counts|tiny)$", ["tp"]],
    ["^mask$", ["tp", None]],
    [".*", []],
]


def expected_user_metadata(version: int) -> dict[str, Any]:
    return {"run": f"golden-v{version}", "config": {"layers": 2, "tags": ["a", "b"]}}


def _d(*items: tuple[Any, Any]) -> dict[str, Any]:
    return {"dict": [[k, v] for k, v in items]}


def _a(name: str) -> dict[str, str]:
    return {"array": name}


def _layer(i: int) -> dict[str, Any]:
    return _d(
        ("proj", _d(("weight", _a(f"model.layers.{i}.proj.weight")))),
        ("norm", _d(("scale", _a(f"model.layers.{i}.norm.scale")))),
    )


EXPECTED_TREE = _d(
    (
        "model",
        _d(
            ("embed", _d(("weight", _a("model.embed.weight")))),
            ("layers", {"list": [_layer(0), _layer(1)]}),
            ("head", _d(("fp8", _a("model.head.fp8")))),
        ),
    ),
    ("counts", _a("counts")),
    ("mask", _a("mask")),
    ("tiny", _a("tiny")),
    ("temperature", _a("temperature")),
    ("optim", _d(("step", _a("optim.step")), ("state", _d((0, _d(("exp_avg", _a("optim.state.0.exp_avg")))))))),
    ("table", _a("table")),
    ("np_scalar", _a("np_scalar")),
    (
        "extra",
        _d(
            ("epoch", {"value": 3}),
            ("name", {"value": "golden"}),
            ("nothing", {"value": None}),
            ("flag", {"value": True}),
            ("lr", {"value": 0.001}),
            ("big", {"value": 2**62}),
            ("nan", {"float": "nan"}),
            ("inf", {"float": "inf"}),
            ("ninf", {"float": "-inf"}),
        ),
    ),
    ("pair", {"tuple": [{"value": "tuple"}, {"list": [{"value": 1}, {"value": 2.5}]}]}),
    ("empty", _d(("d", {"dict": []}), ("l", {"list": []}))),
)


def assert_bits_equal(got: Any, want: Any) -> None:
    """Same type, dtype, shape and bytes (so -0.0 vs 0.0 or a NaN payload would show)."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), type(got)
        assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
        width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[want.element_size()]
        if want.dtype == torch.bool:
            assert torch.equal(got, want)
        else:
            assert torch.equal(got.contiguous().view(width), want.contiguous().view(width)), (got, want)
    else:
        assert type(got) is type(want), (type(got), type(want))
        assert got.dtype == want.dtype and got.shape == want.shape
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes(), (got, want)


def _as_numpy(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        if x.dtype == torch.bfloat16:
            return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        if x.dtype == torch.float8_e4m3fn:
            return x.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
        return x.numpy()
    return np.asarray(x)


# ---------------------------------------------------------------------------------------------
# The documents, as docs/format.md specifies them.


def test_root_document_fields(golden):
    doc = json.loads((golden.path / "zarr.json").read_bytes())
    assert doc["zarr_format"] == 3 and doc["node_type"] == "group"
    meta = doc["attributes"]["layoutckpt"]
    assert ("sha256" in meta) is golden.sealed
    assert ("save_id" in meta) is golden.bound
    assert not golden.bound or re.fullmatch("[0-9a-f]{12,32}", meta["save_id"])
    assert set(meta) - {"all_chunks_stored", "sha256", "save_id"} == {
        "format_version",
        "library_version",
        "arrays",
        "tree",
        "mesh",
        "rules",
        "step",
        "user_metadata",
    }
    assert meta.get("all_chunks_stored", False) is golden.all_chunks_stored
    assert meta["format_version"] == golden.version
    assert isinstance(meta["library_version"], str) and meta["library_version"]
    assert meta["mesh"] == [["tp", 2]]
    assert meta["rules"] == EXPECTED_RULES
    assert meta["step"] == 12
    assert meta["user_metadata"] == expected_user_metadata(golden.version)
    assert meta["tree"] == EXPECTED_TREE
    assert list(meta["arrays"]) == list(EXPECTED_META)
    for name, (shape, dtype, shard, inner, spec, kind) in expected_meta(golden.version).items():
        assert meta["arrays"][name] == {
            "path": name.replace(".", "/"),
            "shape": shape,
            "dtype": dtype,
            "shard_shape": shard,
            "inner_chunk_shape": inner,
            "spec": spec,
            "kind": kind,
            "compression": None,
        }, name


def _array_document(separator, shape, dtype, shard, inner, spec, compression_codecs=()):
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": shape,
        "data_type": dtype,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": shard}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": separator}},
        "fill_value": False if dtype == "bool" else 0,
        "codecs": [
            {
                "name": "sharding_indexed",
                "configuration": {
                    "chunk_shape": inner,
                    "codecs": [
                        {"name": "bytes", "configuration": {"endian": "little"}},
                        *compression_codecs,
                        {"name": "crc32c"},
                    ],
                    "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
                    "index_location": "end",
                },
            }
        ],
        "attributes": {"layoutckpt": {"spec": spec}},
    }


def test_array_and_group_documents(golden):
    groups = set()
    for name, (shape, dtype, shard, inner, spec, _) in expected_meta(golden.version).items():
        path = name.replace(".", "/")
        doc = json.loads((golden.path / path / "zarr.json").read_bytes())
        assert doc == _array_document(golden.separator, shape, dtype, shard, inner, spec), name
        parts = path.split("/")
        groups.update("/".join(parts[:i]) for i in range(1, len(parts)))
    assert groups == {"model", "model/embed", "model/layers", "model/layers/0", "model/layers/0/proj"} | {
        "model/layers/0/norm",
        "model/layers/1",
        "model/layers/1/proj",
        "model/layers/1/norm",
        "model/head",
        "optim",
        "optim/state",
        "optim/state/0",
    }
    for g in groups:
        assert json.loads((golden.path / g / "zarr.json").read_bytes()) == {
            "zarr_format": 3,
            "node_type": "group",
            "attributes": {},
        }


def _decode_shards(golden: Golden, name: str) -> np.ndarray:
    """Rebuild an uncompressed array from its shard files using only docs/format.md.

    Each shard ``c.i.j`` (``c/i/j`` in version 1) is the grid cell of shard_shape; its end holds the index: one
    little-endian (offset, nbytes) uint64 pair per inner chunk in C order, then the index's
    crc32c. Each inner chunk is its little-endian bytes followed by their crc32c. A missing shard
    or an index entry of all ones stands for the fill value.
    """
    shape, dtype, shard, inner, _, _ = expected_meta(golden.version)[name]
    np_dtype = _np_dtype(dtype)
    out = np.zeros(shape, dtype=np_dtype)
    grid = [max(1, -(-n // s)) for n, s in zip(shape, shard)]
    per_shard = [s // c for s, c in zip(shard, inner)]
    n_inner = math.prod(per_shard)
    for cell in np.ndindex(*grid):
        key = golden.shard(name, *cell)
        if not key.exists():
            assert not golden.all_chunks_stored, key
            continue
        raw = key.read_bytes()
        index_bytes = raw[-(16 * n_inner + 4) : -4]
        assert int.from_bytes(raw[-4:], "little") == crc32c.crc32c(index_bytes), key
        index = np.frombuffer(index_bytes, "<u8").reshape(n_inner, 2)
        for k, sub in enumerate(np.ndindex(*per_shard)):
            offset, nbytes = (int(v) for v in index[k])
            if offset == MISSING:
                assert nbytes == MISSING
                # Only chunks wholly past the array's edge may be absent where all are stored.
                inside = all(c * s + j * i < n for c, s, j, i, n in zip(cell, shard, sub, inner, shape))
                assert not (golden.all_chunks_stored and inside), (key, k)
                continue
            chunk = raw[offset : offset + nbytes]
            assert int.from_bytes(chunk[-4:], "little") == crc32c.crc32c(chunk[:-4]), (key, k)
            block = np.frombuffer(chunk[:-4], dtype=np_dtype.newbyteorder("<")).reshape(inner)
            start = [c * s + j * i for c, s, j, i in zip(cell, shard, sub, inner)]
            region = tuple(slice(a, min(a + i, n)) for a, i, n in zip(start, inner, shape))
            out[region] = block[tuple(slice(0, r.stop - r.start) for r in region)]
    return out


def _np_dtype(name: str) -> np.dtype:
    return np.dtype({"bfloat16": ml_dtypes.bfloat16, "float8_e4m3fn": ml_dtypes.float8_e4m3fn}.get(name, name))


@pytest.mark.parametrize("name", list(EXPECTED_META))
def test_shards_decode_by_the_spec_alone(golden, name):
    want = _as_numpy(expected_arrays()[name])
    got = _decode_shards(golden, name)
    assert got.tobytes() == want.tobytes()


def _shard_files(golden: Golden, name: str) -> list[str]:
    """The chunk keys of the shard files stored for ``name``, as paths under the array."""
    array = golden.path / name.replace(".", "/")
    return sorted(str(p.relative_to(array)) for p in array.rglob("*") if p.is_file() and p.name != "zarr.json")


def test_shard_keys_follow_the_writer_boxes(golden):
    sep = golden.separator
    # Two writers (tp=2) saved model.embed.weight, rows 0:3 and 3:5: the grid cells (0, 0), (1, 0).
    assert _shard_files(golden, "model.embed.weight") == [f"c{sep}0{sep}0", f"c{sep}1{sep}0"]
    assert golden.shard("model.layers.0.proj.weight", 0, 1).is_file()
    # A 0-d array has the single chunk key "c".
    assert _shard_files(golden, "temperature") == ["c"]
    # tiny: rank 1's torch.chunk piece is empty, so only cell 0 exists.
    assert _shard_files(golden, "tiny") == [f"c{sep}0"]
    # mask rows 2:3 are all fill value (False): version 1 left that shard out; version 2 stores it.
    assert golden.shard("mask", 1, 0).exists() is golden.all_chunks_stored
    # The edge shard of embed holds rows 3, 4 and an out-of-bounds row 5 whose inner chunk is missing.
    raw = golden.shard("model.embed.weight", 1, 0).read_bytes()
    index = np.frombuffer(raw[-(3 * 16 + 4) : -4], "<u8").reshape(3, 2)
    assert index[2].tolist() == [MISSING, MISSING]


@pytest.fixture(params=BOUND, ids=[f"v{v}" for v in BOUND])
def bound(request) -> Golden:
    """The goldens of the versions whose shards are bound to their save (6 on)."""
    return Golden(request.param)


def _binding_block(save_id: str, path: str, cell: tuple[int, ...]) -> bytes:
    """Format section 5.4, computed here: the magic, then BLAKE2b-192 of the id, path and cell."""
    text = f"{save_id}\0{path}\0{'.'.join(map(str, cell))}".encode()
    return b"LCBIND1\0" + hashlib.blake2b(text, digest_size=24).digest()


def test_every_shard_carries_its_binding_block(bound):
    """Between the last inner chunk and the index: 32 bytes naming the save, array and cell;
    every stored chunk lies before them."""
    save_id = json.loads((bound.path / "zarr.json").read_bytes())["attributes"]["layoutckpt"]["save_id"]
    for name, (shape, _, shard, inner, _, _) in expected_meta(bound.version).items():
        n_inner = math.prod(s // c for s, c in zip(shard, inner))
        grid = [max(1, -(-n // s)) for n, s in zip(shape, shard)]
        for cell in np.ndindex(*grid):
            raw = bound.shard(name, *cell).read_bytes()
            tail = 16 * n_inner + 4
            block = raw[len(raw) - tail - 32 : len(raw) - tail]
            assert block == _binding_block(save_id, name.replace(".", "/"), cell), (name, cell)
            index = np.frombuffer(raw[-tail:-4], "<u8").reshape(n_inner, 2)
            ends = [int(o + n) for o, n in index.tolist() if o != MISSING]
            assert max(ends, default=0) <= len(raw) - tail - 32, (name, cell)


def test_a_shard_moved_to_another_cell_is_refused(tmp_path, bound):
    path = tmp_path / "basic"
    shutil.copytree(bound.path, path)
    a, b = bound.shard("model.embed.weight", 0, 0), bound.shard("model.embed.weight", 1, 0)
    (path / "model/embed/weight/c.0.0").write_bytes(b.read_bytes())
    (path / "model/embed/weight/c.1.0").write_bytes(a.read_bytes())
    with pytest.raises(lc.IntegrityError, match=r"'model\.embed\.weight'.*shard c\.0\.0 belongs to another place"):
        lc.load(path)
    assert lc.open(path).read("counts").tolist() == [k * 10**12 for k in range(-3, 4)]  # the others read


# ---------------------------------------------------------------------------------------------
# Reading through layoutckpt.


def test_load_whole_tree(golden):
    got = lc.load(golden.path)
    want = expected_arrays()
    top = ["model", "counts", "mask", "tiny", "temperature", "optim", "table", "np_scalar", "extra", "pair"]
    assert list(got) == [*top, "empty"]
    flat = {
        "model.embed.weight": got["model"]["embed"]["weight"],
        "model.layers.0.proj.weight": got["model"]["layers"][0]["proj"]["weight"],
        "model.layers.0.norm.scale": got["model"]["layers"][0]["norm"]["scale"],
        "model.layers.1.proj.weight": got["model"]["layers"][1]["proj"]["weight"],
        "model.layers.1.norm.scale": got["model"]["layers"][1]["norm"]["scale"],
        "model.head.fp8": got["model"]["head"]["fp8"],
        "counts": got["counts"],
        "mask": got["mask"],
        "tiny": got["tiny"],
        "temperature": got["temperature"],
        "optim.step": got["optim"]["step"],
        "optim.state.0.exp_avg": got["optim"]["state"][0]["exp_avg"],
        "table": got["table"],
        "np_scalar": got["np_scalar"],
    }
    for name, value in want.items():
        assert_bits_equal(flat[name], value)
    assert isinstance(got["model"]["layers"], list) and len(got["model"]["layers"]) == 2
    assert list(got["optim"]["state"]) == [0]  # an int key comes back as an int
    extra = got["extra"]
    assert {k: v for k, v in extra.items() if k not in ("nan", "inf", "ninf")} == {
        "epoch": 3,
        "name": "golden",
        "nothing": None,
        "flag": True,
        "lr": 0.001,
        "big": 2**62,
    }
    assert type(extra["epoch"]) is int and type(extra["flag"]) is bool and type(extra["big"]) is int
    assert math.isnan(extra["nan"]) and extra["inf"] == math.inf and extra["ninf"] == -math.inf
    assert got["pair"] == ("tuple", [1, 2.5]) and isinstance(got["pair"], tuple)
    assert got["empty"] == {"d": {}, "l": []}


def test_load_select_and_like(golden):
    got = lc.load(golden.path, select=r"^model\.embed\.|^extra\.name$")
    assert got["extra"] == {"name": "golden"} and got["model"].keys() == {"embed"}
    assert not {"counts", "optim", "table", "pair"} & got.keys()
    assert_bits_equal(got["model"]["embed"]["weight"], expected_arrays()["model.embed.weight"])
    like = {"counts": torch.empty(7, dtype=torch.int64, device="meta"), "table": np.empty((2, 3))}
    got = lc.load(golden.path, like=like, strict=False)
    assert set(got) == {"counts", "table"}
    assert_bits_equal(got["counts"], expected_arrays()["counts"])
    assert_bits_equal(got["table"], expected_arrays()["table"])


def test_open_reader(golden):
    rd = lc.open(golden.path)
    assert rd.step == 12
    assert rd.metadata == expected_user_metadata(golden.version)
    assert rd.keys() == list(EXPECTED_META)
    assert rd.value_keys() == [f"extra.{k}" for k in ("epoch", "name", "nothing", "flag", "lr", "big")] + [
        "extra.nan",
        "extra.inf",
        "extra.ninf",
        "pair.0",
        "pair.1.0",
        "pair.1.1",
    ]
    assert rd.read("extra.name") == "golden" and rd.read("pair.1.1") == 2.5 and rd.read("extra.nothing") is None
    assert math.isnan(rd.read("extra.nan"))
    assert "counts" in rd and "extra.lr" in rd and "model" not in rd
    mesh = lc.Mesh({"tp": 2})
    for name, (shape, dtype, shard, inner, spec, kind) in expected_meta(golden.version).items():
        info = rd.info(name)
        assert info == lc.ArrayInfo(
            name=name,
            shape=tuple(shape),
            dtype=_np_dtype(dtype),
            shard_shape=tuple(shard),
            inner_chunk_shape=tuple(inner),
            spec=lc.P(*spec),
            saved_mesh=mesh,
            kind=kind,
            compression=None,
        )
        assert rd.read(name).tobytes() == _as_numpy(expected_arrays()[name]).tobytes(), name
    want = expected_arrays()
    # Slices that cross the shard boundary written by two different ranks.
    assert np.array_equal(rd.read("model.embed.weight", np.s_[2:4, 1:3]), want["model.embed.weight"][2:4, 1:3].numpy())
    proj = rd.read("model.layers.1.proj.weight", np.s_[:, 2:5])
    assert proj.dtype == ml_dtypes.bfloat16
    assert proj.tobytes() == _as_numpy(want["model.layers.1.proj.weight"][:, 2:5].contiguous()).tobytes()
    assert rd.read("counts", np.s_[3:6]).tolist() == [0, 10**12, 2 * 10**12]
    assert rd.read("temperature").shape == () and float(rd.read("temperature")) == 0.5


def _load_resharded(rank, group, path):
    """Three ranks read the two-rank golden under a different layout."""
    layout = lc.Layout(
        lc.Mesh({"tp": 3}),
        [
            (r"^(temperature|optim\.step|np_scalar)$", lc.P()),
            (r"\.proj\.weight$", lc.P("tp", None)),
            (r".*", lc.P("tp")),
        ],
    )
    got = lc.load(path, layout, group=group)
    return {
        "proj": got["model"]["layers"][1]["proj"]["weight"],
        "embed": got["model"]["embed"]["weight"],
        "tiny": got["tiny"],
        "table": got["table"],
        "mask": got["mask"],
        "temperature": got["temperature"],
    }


def _piece(full: torch.Tensor, k: int, i: int, dim: int = 0) -> torch.Tensor:
    pieces = full.chunk(k, dim=dim)
    return pieces[i] if i < len(pieces) else full.narrow(dim, 0, 0)


def test_load_golden_on_another_mesh(ranks, golden):
    out = ranks.run(_load_resharded, 3, str(golden.path))
    want = expected_arrays()
    for r, got in enumerate(out):
        assert_bits_equal(got["proj"], _piece(want["model.layers.1.proj.weight"], 3, r))
        assert_bits_equal(got["embed"], _piece(want["model.embed.weight"], 3, r))
        assert_bits_equal(got["tiny"], _piece(want["tiny"], 3, r))
        assert_bits_equal(got["mask"], _piece(want["mask"], 3, r))
        assert_bits_equal(got["table"], _piece(torch.from_numpy(want["table"]), 3, r).numpy())
        assert_bits_equal(got["temperature"], want["temperature"])


# ---------------------------------------------------------------------------------------------
# Reading without layoutckpt's API: plain zarr and plain tensorstore.


def test_plain_zarr_reads_every_array(golden):
    # zarr-python only needs the bfloat16/float8 data types, which importing layoutckpt registers.
    group = zarr.open_group(golden.path, mode="r")
    assert group.attrs["layoutckpt"]["format_version"] == golden.version
    for name, want in expected_arrays().items():
        array = zarr.open_array(golden.path / name.replace(".", "/"), mode="r")
        assert array[...].tobytes() == _as_numpy(want).tobytes(), name
    assert zarr.open_array(golden.path / "counts", mode="r")[5:].tolist() == [2 * 10**12, 3 * 10**12]


def test_plain_tensorstore_reads_every_array(golden):
    for name, want in expected_arrays().items():
        path = str(golden.path / name.replace(".", "/"))
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": path}}
        store = ts.open(spec, read=True).result()
        assert store.read().result().tobytes() == _as_numpy(want).tobytes(), name


# ---------------------------------------------------------------------------------------------
# The compressed goldens.


@pytest.mark.parametrize(
    ("compression", "codec"),
    [
        ("zstd", lambda itemsize: {"name": "zstd", "configuration": {"level": 3, "checksum": False}}),
        (
            "blosc",
            lambda itemsize: {
                "name": "blosc",
                "configuration": {
                    "cname": "zstd",
                    "clevel": 3,
                    "shuffle": "shuffle",
                    "typesize": itemsize,
                    "blocksize": 0,
                },
            },
        ),
    ],
)
def test_compressed_goldens(golden, compression, codec):
    path = golden.root / compression
    meta = json.loads((path / "zarr.json").read_bytes())["attributes"]["layoutckpt"]
    assert meta["format_version"] == golden.version and meta["mesh"] == [["dp", 1]] and meta["step"] == 1
    assert json.loads((path / "w" / "zarr.json").read_bytes()) == _array_document(
        golden.separator, [4, 6], "float32", [4, 6], [2, 6], [], [codec(4)]
    )
    assert json.loads((path / "h" / "zarr.json").read_bytes()) == _array_document(
        golden.separator, [8], "bfloat16", [8], [8], [], [codec(2)]
    )
    got = lc.load(path)
    assert_bits_equal(got["w"], torch.tensor([[6.0 * r + c for c in range(6)] for r in range(4)]))
    assert_bits_equal(got["h"], torch.tensor([-4.0, -3, -2, -1, 0, 1, 2, 3]).to(torch.bfloat16))
    assert lc.open(path).info("w").compression == compression
    assert zarr.open_array(path / "w", mode="r")[1:3, 4].tolist() == [10.0, 16.0]


def test_root_checksum_covers_the_bytes_of_the_metadata(sealed):
    # Format section 4: a compact writer hashes exactly the bytes between '"layoutckpt":' and
    # ',"sha256"'; computed here from the file's bytes, not by the library.
    for path in (sealed.path, sealed.root / "zstd", sealed.root / "blosc"):
        raw = (path / "zarr.json").read_bytes()
        start = raw.index(b'"layoutckpt":') + len(b'"layoutckpt":')
        end = raw.rindex(b',"sha256":"')
        digest = raw[end + len(b',"sha256":"') : end + len(b',"sha256":"') + 64].decode()
        assert (
            raw[start:end] + b"}"
            == json.dumps(
                {k: v for k, v in json.loads(raw)["attributes"]["layoutckpt"].items() if k != "sha256"},
                separators=(",", ":"),
            ).encode()
        )
        assert hashlib.sha256(raw[start:end] + b"}").hexdigest() == digest


def test_an_edited_root_document_is_refused(tmp_path, sealed):
    basic_copy = tmp_path / "basic"
    shutil.copytree(sealed.path, basic_copy)
    text = (basic_copy / "zarr.json").read_text()
    (basic_copy / "zarr.json").write_text(text.replace('"step":12', '"step":13'))
    with pytest.raises(lc.FormatError, match="fails its checksum"):
        lc.open(basic_copy)


# ---------------------------------------------------------------------------------------------
# The guards the spec requires of readers, on copies of the golden.


@pytest.fixture
def basic_copy(tmp_path, golden):
    path = tmp_path / "basic"
    shutil.copytree(golden.path, path)
    return path


def test_newer_format_version_is_refused(basic_copy):
    doc = json.loads((basic_copy / "zarr.json").read_bytes())
    newer = lc.FORMAT_VERSION + 1
    doc["attributes"]["layoutckpt"]["format_version"] = newer
    (basic_copy / "zarr.json").write_text(json.dumps(doc))
    with pytest.raises(lc.NewerFormatError, match=f"format version {newer}"):
        lc.load(basic_copy)
    with pytest.raises(lc.NewerFormatError):
        lc.open(basic_copy)


def test_directory_without_marker_is_invisible(basic_copy):
    (basic_copy / "zarr.json").unlink()
    with pytest.raises(lc.CheckpointNotFoundError, match="no commit marker"):
        lc.load(basic_copy)
    with pytest.raises(lc.CheckpointNotFoundError):
        lc.open(basic_copy)


def test_checksums_catch_corruption_of_only_the_bytes_read(basic_copy, golden):
    key = golden.separator.join("c00")
    shard = basic_copy / "model/embed/weight" / key
    raw = bytearray(shard.read_bytes())
    raw[5] ^= 1  # inside inner chunk 0 (row 0)
    shard.write_bytes(bytes(raw))
    rd = lc.open(basic_copy)
    with pytest.raises(
        lc.IntegrityError,
        match=rf"'model\.embed\.weight'.*inner chunk .0, 0. of shard {re.escape(key)} fails its crc32c",
    ):
        rd.read("model.embed.weight")
    # Rows 1:3 live in other inner chunks of the same shard: still readable.
    assert rd.read("model.embed.weight", np.s_[1:3]).tolist() == [[4, 5, 6, 7], [8, 9, 10, 11]]
    raw[5] ^= 1
    raw[-3] ^= 1  # the index's crc32c
    shard.write_bytes(bytes(raw))
    with pytest.raises(lc.IntegrityError, match=rf"the index of shard {re.escape(key)} fails its crc32c"):
        lc.open(basic_copy).read("model.embed.weight", np.s_[1:3])


def test_array_path_is_derived_from_the_name(basic_copy):
    # A crafted root document must not point a reader outside the checkpoint directory.
    outside = basic_copy.parent / "outside"
    shutil.copytree(basic_copy / "counts", outside)
    doc = json.loads((basic_copy / "zarr.json").read_bytes())
    doc["attributes"]["layoutckpt"]["arrays"]["counts"]["path"] = str(outside)
    (basic_copy / "zarr.json").write_text(json.dumps(doc))
    with pytest.raises(lc.FormatError, match="path"):
        lc.open(basic_copy)
    with pytest.raises(lc.FormatError, match="path"):
        lc.load(basic_copy)


# ---------------------------------------------------------------------------------------------
# parallel (version 4 on): saved by four ranks of {"pp": 2, "dp": 1, "tp": 2} holding local
# names (layers renumbered per stage), a grouped fused qkv, a fused [gate; up], padded
# vocabularies and a ZeRO buffer over tensor-parallel pieces. Stored: global names, logical arrays.

PARALLEL_VERSIONS = (4, 6)


@pytest.fixture(params=PARALLEL_VERSIONS, ids=[f"v{v}" for v in PARALLEL_VERSIONS])
def parallel(request) -> tuple[int, Path]:
    """The ``parallel`` golden of a version that added it or changed how it is stored."""
    return request.param, GOLDENS / f"v{request.param}" / "parallel"


LAYERS, GROUPS, Q_ROWS, KV_ROWS, HIDDEN, FFN, VOCAB = 4, 2, 4, 2, 4, 6, 5  # rows per group for q, k, v


def _formula(shape: tuple[int, ...], base: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The golden's values: element k of n is ``base + (k - n // 2) / 8`` (then cast)."""
    n = math.prod(shape)
    return ((torch.arange(n, dtype=torch.float64) - n // 2) / 8 + base).to(dtype).reshape(shape)


def parallel_arrays() -> dict[str, torch.Tensor]:
    """Every stored array of ``parallel``: global name -> the whole logical array."""
    out = {
        "embedding.word_embeddings.weight": _formula((VOCAB, HIDDEN), 1),
        "output_layer.weight": _formula((VOCAB, HIDDEN), -1, torch.bfloat16),
    }
    for i in range(LAYERS):
        attn, mlp = f"decoder.layers.{i}.self_attention.linear_qkv", f"decoder.layers.{i}.mlp.linear_fc1"
        out[f"{attn}.q.weight"] = _formula((GROUPS * Q_ROWS, HIDDEN), 10 * i + 2)
        out[f"{attn}.k.weight"] = _formula((GROUPS * KV_ROWS, HIDDEN), 10 * i + 3)
        out[f"{attn}.v.weight"] = _formula((GROUPS * KV_ROWS, HIDDEN), 10 * i + 4)
        out[f"{mlp}.gate.weight"] = _formula((FFN, HIDDEN), 10 * i + 5, torch.bfloat16)
        out[f"{mlp}.up.weight"] = _formula((FFN, HIDDEN), 10 * i + 6, torch.bfloat16)
        out[f"decoder.layers.{i}.input_layernorm.weight"] = _formula((HIDDEN,), 10 * i + 7)
    out["optimizer.exp_avg.w1"] = _formula((4, 6), -10)
    out["optimizer.exp_avg.w2"] = _formula((6, 4), -11)
    out["optimizer.exp_avg.b"] = _formula((5,), -12)
    return out


# name -> (shard_shape, spec) as stored: tensor-parallel pieces of the logical arrays; the
# padded vocabularies in pieces of the 4 rows per rank that the saving ranks held.
PARALLEL_SHARDS = {
    "embedding.word_embeddings.weight": ((4, 4), ("tp", None)),
    "output_layer.weight": ((4, 4), ("tp", None)),
    "optimizer.exp_avg.w1": ((2, 6), ("tp", None)),
    "optimizer.exp_avg.w2": ((6, 2), (None, "tp")),
    "optimizer.exp_avg.b": ((5,), ()),
    **{
        f"decoder.layers.{i}.{name}": shard
        for i in range(LAYERS)
        for name, shard in {
            "self_attention.linear_qkv.q.weight": ((4, 4), ("tp", None)),
            "self_attention.linear_qkv.k.weight": ((2, 4), ("tp", None)),
            "self_attention.linear_qkv.v.weight": ((2, 4), ("tp", None)),
            "mlp.linear_fc1.gate.weight": ((3, 4), ("tp", None)),
            "mlp.linear_fc1.up.weight": ((3, 4), ("tp", None)),
            "input_layernorm.weight": ((4,), ()),
        }.items()
    },
}


def parallel_layout(pp: int, tp: int) -> lc.Layout:
    """The golden's layout on ``{"pp": pp, "dp": 1, "tp": tp}``: local layer numbers per stage."""
    return lc.Layout(
        lc.Mesh({"pp": pp, "dp": 1, "tp": tp}),
        [
            (r"linear_qkv\.weight$", lc.Fused(lc.P("tp", None), [("q", 4), ("k", 2), ("v", 2)], groups=GROUPS)),
            (r"linear_fc1\.weight$", lc.Fused(lc.P("tp", None), [("gate", FFN), ("up", FFN)])),
            (r"^(embedding\.word_embeddings|output_layer)\.weight$", lc.Padded(lc.P("tp", None), VOCAB)),
            (
                r"^optimizer\.exp_avg$",
                lc.Flat(
                    [("w1", (4, 6)), ("w2", (6, 4)), ("b", (5,))],
                    "dp",
                    specs={"w1": lc.P("tp", None), "w2": lc.P(None, "tp")},
                ),
            ),
            (r".*", lc.P()),
        ],
        stages="pp",
        names=[lc.Renumber(r"^decoder\.layers\.(\d+)\.", "pp", per=LAYERS // pp)],
    )


def parallel_rank_state(pp: int, tp: int, rank: int, pad_rows: int) -> dict[str, torch.Tensor]:
    """What rank ``rank`` of ``{"pp": pp, "dp": 1, "tp": tp}`` holds under local names, built
    from the logical arrays: its stage's layers, fused and padded tensors of ``pad_rows`` rows."""
    full = parallel_arrays()
    stage, t = divmod(rank, tp)
    per = LAYERS // pp

    def padded(x: torch.Tensor) -> torch.Tensor:
        whole = torch.zeros(pad_rows * tp, HIDDEN, dtype=x.dtype)
        whole[:VOCAB] = x
        return whole[t * pad_rows : (t + 1) * pad_rows].clone()

    out: dict[str, torch.Tensor] = {}
    if stage == 0:
        out["embedding.word_embeddings.weight"] = padded(full["embedding.word_embeddings.weight"])
    for local in range(per):
        i = stage * per + local
        attn = f"decoder.layers.{i}.self_attention.linear_qkv"
        # Megatron's linear_qkv: per query group, its q rows, then its k rows, then its v rows.
        by_group = torch.cat(
            [
                full[f"{attn}.q.weight"].reshape(GROUPS, Q_ROWS, HIDDEN),
                full[f"{attn}.k.weight"].reshape(GROUPS, KV_ROWS, HIDDEN),
                full[f"{attn}.v.weight"].reshape(GROUPS, KV_ROWS, HIDDEN),
            ],
            dim=1,
        )
        mine = GROUPS // tp
        out[f"decoder.layers.{local}.self_attention.linear_qkv.weight"] = (
            by_group[t * mine : (t + 1) * mine].reshape(-1, HIDDEN).clone()
        )
        rows = FFN // tp
        gate, up = (full[f"decoder.layers.{i}.mlp.linear_fc1.{p}.weight"] for p in ("gate", "up"))
        out[f"decoder.layers.{local}.mlp.linear_fc1.weight"] = torch.cat(
            [gate[t * rows : (t + 1) * rows], up[t * rows : (t + 1) * rows]]
        )
        out[f"decoder.layers.{local}.input_layernorm.weight"] = full[f"decoder.layers.{i}.input_layernorm.weight"]
    if stage == pp - 1:
        out["output_layer.weight"] = padded(full["output_layer.weight"])
    w1 = full["optimizer.exp_avg.w1"][t * 4 // tp : (t + 1) * 4 // tp]
    w2 = full["optimizer.exp_avg.w2"][:, t * 4 // tp : (t + 1) * 4 // tp]
    out["optimizer.exp_avg"] = torch.cat([w1.reshape(-1), w2.reshape(-1), full["optimizer.exp_avg.b"]])
    return out


def _nested(tree: dict[str, Any], name: str) -> Any:
    for part in name.split("."):
        tree = tree[part]
    return tree


def test_parallel_golden_stores_global_names_and_logical_arrays(parallel):
    version, root = parallel
    doc = json.loads((root / "zarr.json").read_bytes())["attributes"]["layoutckpt"]
    assert doc["format_version"] == version and doc["mesh"] == [["pp", 2], ["dp", 1], ["tp", 2]]
    want = parallel_arrays()
    assert sorted(doc["arrays"]) == sorted(want)

    # The tree: nested dicts of the global names (sorted), each leaf its array; fused parts are
    # arrays of their own, the fused and ZeRO tensors themselves are nowhere.
    def leaves(node: Any, prefix: str) -> dict[str, Any]:
        assert set(node) == {"dict"}, node
        keys = [k for k, _ in node["dict"]]
        assert keys == sorted(keys), keys
        out = {}
        for key, child in node["dict"]:
            name = f"{prefix}{key}"
            out.update({name: child["array"]} if "array" in child else leaves(child, f"{name}."))
        return out

    assert leaves(doc["tree"], "") == {name: name for name in want}
    assert not (root / "decoder/layers/0/self_attention/linear_qkv/weight").exists()
    assert json.loads((root / "optimizer/exp_avg/zarr.json").read_bytes())["node_type"] == "group"

    rd = lc.open(root)
    assert rd.step == 25 and rd.metadata == {"run": f"golden-v{version}-parallel"}
    assert sorted(rd.keys()) == sorted(want)
    for name, tensor in want.items():
        shard, spec = PARALLEL_SHARDS[name]
        info = rd.info(name)
        assert (info.shape, info.shard_shape, info.spec) == (tuple(tensor.shape), shard, lc.P(*spec)), name
        assert info.dtype == _as_numpy(tensor).dtype, name
        assert rd.read(name).tobytes() == _as_numpy(tensor).tobytes(), name
    # A padded vocabulary: two shards of the 4 rows each rank held, the second cut by the 5 rows.
    embedding = root / "embedding/word_embeddings/weight"
    assert sorted(p.name for p in embedding.iterdir()) == ["c.0.0", "c.1.0", "zarr.json"]
    assert rd.read("output_layer.weight", np.s_[3:5]).tobytes() == _as_numpy(want["output_layer.weight"][3:5]).tobytes()

    got = lc.load(root)
    assert sorted(got) == ["decoder", "embedding", "optimizer", "output_layer"]
    assert list(got["decoder"]["layers"]) == ["0", "1", "2", "3"]
    for name, tensor in want.items():
        assert_bits_equal(_nested(got, name), tensor)


@pytest.mark.parametrize("inplace", [False, True], ids=["new", "inplace"])
def test_parallel_golden_loads_into_one_process_under_local_names(parallel, inplace):
    """One plain process, {"pp": 1, "dp": 1, "tp": 1}: every layer under its (now global) local
    name, qkv and [gate; up] fused again, the vocabularies padded to 8 rows, the ZeRO buffer whole."""
    want = parallel_rank_state(1, 1, 0, pad_rows=8)
    assert want["decoder.layers.3.self_attention.linear_qkv.weight"].shape == (16, HIDDEN)
    if inplace:
        like = {name: torch.full_like(t, 7) for name, t in want.items()}  # the padding rows too
    else:
        like = {name: torch.empty_like(t, device="meta") for name, t in want.items()}
    got = lc.load(parallel[1], parallel_layout(1, 1), like=like, inplace=inplace)
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert_bits_equal(got[name], tensor)
        if inplace:
            assert got[name] is like[name], name


def _load_parallel(rank, group, path):
    want = parallel_rank_state(2, 1, rank, pad_rows=6)
    like = {name: torch.empty_like(t, device="meta") for name, t in want.items()}
    got = lc.load(path, parallel_layout(2, 1), like=like, group=group)
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert_bits_equal(got[name], tensor)
    return sorted(got)


def test_parallel_golden_loads_on_two_stages_without_tensor_parallelism(ranks, parallel):
    """Two ranks, {"pp": 2, "dp": 1, "tp": 1}: local layer numbers 0 and 1 on each stage, the
    fused tensors whole, another padding (6 rows)."""
    names = ranks.run(_load_parallel, 2, str(parallel[1]))
    assert "embedding.word_embeddings.weight" in names[0] and "output_layer.weight" in names[1]


def test_parallel_golden_opens_in_plain_zarr_and_tensorstore(parallel):
    want = parallel_arrays()
    for name in ("decoder.layers.2.self_attention.linear_qkv.k.weight", "output_layer.weight", "optimizer.exp_avg.w2"):
        path = parallel[1] / name.replace(".", "/")
        assert zarr.open_array(path, mode="r")[...].tobytes() == _as_numpy(want[name]).tobytes(), name
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}
        assert ts.open(spec, read=True).result().read().result().tobytes() == _as_numpy(want[name]).tobytes(), name


# packed (version 5 on): parallel's save with packing="ocdbt": the same objects, in the ranks'
# OCDBT databases merged into one at the root; only the root document is a plain file.
PACKED_VERSIONS = (5, 6)


@pytest.fixture(params=PACKED_VERSIONS, ids=[f"v{v}" for v in PACKED_VERSIONS])
def packed(request) -> tuple[int, Path]:
    return request.param, GOLDENS / f"v{request.param}" / "packed"


def test_packed_golden_reads_as_the_parallel_one(packed):
    version, root = packed
    doc = json.loads((root / "zarr.json").read_bytes())["attributes"]["layoutckpt"]
    assert doc["format_version"] == version and doc["packing"] == "ocdbt"
    assert not (root / "decoder").exists() and (root / "manifest.ocdbt").is_file()
    assert sorted(p.name for p in (root / "packs").iterdir()) == ["00000", "00001", "00002", "00003"]
    want = parallel_arrays()
    rd = lc.open(root)
    assert rd.meta.packing == "ocdbt" and sorted(rd.keys()) == sorted(want)
    for name, tensor in want.items():
        assert rd.read(name).tobytes() == _as_numpy(tensor).tobytes(), name
    assert rd.read("output_layer.weight", np.s_[3:5]).tobytes() == _as_numpy(want["output_layer.weight"][3:5]).tobytes()
    like = {n: torch.empty_like(t, device="meta") for n, t in parallel_rank_state(1, 1, 0, pad_rows=8).items()}
    got = lc.load(root, parallel_layout(1, 1), like=like)
    for name, tensor in parallel_rank_state(1, 1, 0, pad_rows=8).items():
        assert_bits_equal(got[name], tensor)


def test_packed_golden_loads_on_two_stages(ranks, packed):
    names = ranks.run(_load_parallel, 2, str(packed[1]))
    assert "embedding.word_embeddings.weight" in names[0] and "output_layer.weight" in names[1]


def test_packed_golden_opens_in_plain_tensorstore(packed):
    want = parallel_arrays()
    database = {"driver": "ocdbt", "base": {"driver": "file", "path": str(packed[1]) + "/"}}
    for name, tensor in want.items():
        spec = {"driver": "zarr3", "kvstore": {**database, "path": name.replace(".", "/") + "/"}}
        assert ts.open(spec, read=True).result().read().result().tobytes() == _as_numpy(tensor).tobytes(), name
