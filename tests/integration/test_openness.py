"""A checkpoint is plain Zarr v3: zarr-python and TensorStore open it without layoutckpt's code.

The only help from layoutckpt is ``import layoutckpt`` registering bfloat16/float8 with
zarr-python; every read below goes through ``zarr.open_*`` or ``tensorstore.open`` on paths.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import tensorstore as ts
import torch
import zarr

import layoutckpt as lc
from tests.support.oracle import local_shard as oracle_shard

MESH = {"dp": 2, "tp": 2}
# name -> (global shape, torch dtype name, spec entries)
ARRAYS = {
    "model.layers.0.attn.w": ((10, 6), "float32", ("tp", None)),
    "model.layers.0.attn.bf": ((6, 9), "bfloat16", (None, "tp")),
    "model.layers.1.f8a": ((9, 4), "float8_e4m3fn", (("dp", "tp"),)),
    "model.layers.1.f8b": ((5,), "float8_e5m2", ("tp",)),
    "model.emb": ((7, 3), "float16", ()),
    "model.mask": ((4, 5), "bool", ("tp",)),
    "opt.m": ((13,), "int8", (("dp", "tp"),)),
    "opt.v": ((3, 2, 5), "float64", (None, "dp", "tp")),
    "opt.count": ((), "int64", ()),
    "opt.u8": ((11,), "uint8", ("dp",)),
    "opt.big": ((64, 128), "float32", ("tp", "dp")),
}
JSON_LEAVES = {"lr": 0.001, "name": "llama", "warm": True}


def full_tensor(index: int, shape: tuple[int, ...], dtype_name: str) -> torch.Tensor:
    """Random bits of the dtype (NaNs and all), deterministic per array."""
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(1234 + index)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g, dtype=torch.uint8).bool()
    width = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (math.prod(shape) * width,), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def compressible_tensor(index: int, shape: tuple[int, ...], dtype_name: str) -> torch.Tensor:
    """Long runs of equal values, so compression has something to remove."""
    n = math.prod(shape)
    return (torch.arange(n) // 64 % 3).to(getattr(torch, dtype_name)).reshape(shape)


MAKERS = {"random": full_tensor, "compressible": compressible_tensor}


def local_shard(full: torch.Tensor, spec: tuple, rank: int) -> torch.Tensor:
    return oracle_shard(full, spec, MESH, rank)


def nest(flat: dict[str, object]) -> dict:
    root: dict = {}
    for name, value in flat.items():
        *parents, last = name.split(".")
        node = root
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return root


def _save(rank, group, path, maker, compression, inner):
    make = MAKERS[maker]
    leaves = {
        name: local_shard(make(i, shape, dtype), spec, rank)
        for i, (name, (shape, dtype, spec)) in enumerate(ARRAYS.items())
    }
    leaves.update({f"cfg.{k}": v for k, v in JSON_LEAVES.items()})
    rules = [(f"^{name.replace('.', r'[.]')}$", lc.P(*spec)) for name, (_, _, spec) in ARRAYS.items()]
    rules.append((r".*", lc.P()))
    lc.save(
        path,
        nest(leaves),
        lc.Layout(lc.Mesh(MESH), rules),
        group=group,
        step=42,
        metadata={"run": "openness"},
        compression=compression,
        inner_chunk_bytes=inner,
    )
    return True


def expected(maker: str) -> dict[str, np.ndarray]:
    """Every array as NumPy (bf16/fp8 as their ml_dtypes types), from torch, bit for bit."""
    out = {}
    for i, (name, (shape, dtype, _)) in enumerate(ARRAYS.items()):
        t = MAKERS[maker](i, shape, dtype)
        out[name] = to_numpy(t)
    return out


def to_numpy(t: torch.Tensor) -> np.ndarray:
    import ml_dtypes

    carriers = {
        torch.bfloat16: (torch.int16, ml_dtypes.bfloat16),
        torch.float8_e4m3fn: (torch.uint8, ml_dtypes.float8_e4m3fn),
        torch.float8_e5m2: (torch.uint8, ml_dtypes.float8_e5m2),
    }
    if t.dtype in carriers:
        carrier, np_type = carriers[t.dtype]
        return t.view(carrier).numpy().view(np_type)
    return t.numpy()


def bit_equal(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and np.array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8))
    )


@pytest.fixture(scope="module")
def saved(ranks, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("open") / "ck")
    assert ranks.run(_save, 4, path, "random", None, 64) == [True] * 4
    return path


def test_plain_zarr_group_holds_the_layoutckpt_metadata(saved):
    root = zarr.open_group(saved, mode="r")
    meta = root.attrs["layoutckpt"]
    assert meta["format_version"] == lc.FORMAT_VERSION
    assert meta["step"] == 42
    assert meta["user_metadata"] == {"run": "openness"}
    assert meta["mesh"] == [["dp", 2], ["tp", 2]]
    assert set(meta["arrays"]) == set(ARRAYS)
    for name, (shape, _, spec) in ARRAYS.items():
        stored = meta["arrays"][name]
        assert stored["shape"] == list(shape)
        assert stored["path"] == name.replace(".", "/")
        assert lc.P.from_json(stored["spec"]) == lc.P(*spec)
    # The JSON leaves are in the group attributes too, as JSON (never pickle).
    text = json.dumps(meta["tree"])
    for value in JSON_LEAVES.values():
        assert json.dumps(value) in text
    # Walking the hierarchy finds exactly the arrays, at the paths of their global names.
    arrays = {path for path, node in root.members(max_depth=None) if isinstance(node, zarr.Array)}
    assert arrays == {name.replace(".", "/") for name in ARRAYS}


def test_plain_zarr_reads_every_array(saved):
    want = expected("random")
    root = zarr.open_group(saved, mode="r")
    for name, (shape, _, spec) in ARRAYS.items():
        path = name.replace(".", "/")
        arr = zarr.open_array(os.path.join(saved, path), mode="r")
        assert arr.shape == shape
        assert bit_equal(arr[...], want[name]), name
        assert bit_equal(root[path][...], want[name]), name
        assert arr.attrs["layoutckpt"]["spec"] == lc.P(*spec).to_json()
        if shape and shape[0] > 2:
            assert bit_equal(arr[1:-1], want[name][1:-1]), name


def test_plain_tensorstore_reads_every_array(saved):
    want = expected("random")
    for name, (shape, _, _) in ARRAYS.items():
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": os.path.join(saved, name.replace(".", "/"))}}
        store = ts.open(spec, read=True).result()
        assert tuple(store.shape) == shape
        assert bit_equal(store.read().result(), want[name]), name
        if shape and shape[-1] > 2:
            inner = np.s_[..., 1 : shape[-1] - 1]  # TensorStore indices are absolute: no negatives
            assert bit_equal(store[inner].read().result(), want[name][inner]), name


@pytest.mark.parametrize("compression", ["zstd", "blosc"])
def test_compressed_checkpoints_round_trip_and_open_in_plain_zarr(ranks, tmp_path, compression):
    for maker in ("random", "compressible"):
        path = str(tmp_path / f"{maker}-{compression}")
        assert ranks.run(_save, 4, path, maker, compression, 64 if maker == "random" else 4096) == [True] * 4
        want = expected(maker)
        out = lc.load(path)
        for name in ARRAYS:
            node = out
            for part in name.split("."):
                node = node[part]
            assert bit_equal(to_numpy(node), want[name]), (maker, compression, name)

            path_of = os.path.join(path, name.replace(".", "/"))
            with open(os.path.join(path_of, "zarr.json")) as f:
                codecs = json.load(f)["codecs"][0]["configuration"]["codecs"]
            assert compression in [c["name"] for c in codecs]
            assert bit_equal(zarr.open_array(path_of, mode="r")[...], want[name]), (maker, compression, name)
            spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": path_of}}
            assert bit_equal(ts.open(spec, read=True).result().read().result(), want[name])

        if maker == "compressible":
            data = os.path.join(path, "opt", "big")  # 32 KiB of float32 in runs of 64 equal values
            stored = sum(
                os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(data) for f in fs if f != "zarr.json"
            )
            assert stored < want["opt.big"].nbytes / 4, (stored, want["opt.big"].nbytes)


# ----------------------------------------------------------------------------- fused and padded

# Two tensor-parallel ranks hold a grouped fused qkv (2 query groups: per group 4 q rows, 2 k
# rows, 2 v rows), a fused [gate; up] and a vocabulary of 7 rows padded to 5 per rank (not 4).
FUSED_GROUPS, VIEW_H, VIEW_FFN, VIEW_VOCAB, VIEW_PAD = 2, 16, 10, 7, 5
VIEW_RULES = [
    (r"qkv\.weight$", lc.Fused(lc.P("tp", None), [("q", 4), ("k", 2), ("v", 2)], groups=FUSED_GROUPS)),
    (r"fc1\.weight$", lc.Fused(lc.P("tp", None), [("gate", VIEW_FFN), ("up", VIEW_FFN)])),
    (r"^embed\.weight$", lc.Padded(lc.P("tp", None), VIEW_VOCAB)),
    (r".*", lc.P()),
]


def view_arrays() -> dict[str, torch.Tensor]:
    """The stored (logical) arrays, random bits of their dtypes."""
    shapes = {
        "attn.qkv.q.weight": ((FUSED_GROUPS * 4, VIEW_H), "float32"),
        "attn.qkv.k.weight": ((FUSED_GROUPS * 2, VIEW_H), "float32"),
        "attn.qkv.v.weight": ((FUSED_GROUPS * 2, VIEW_H), "float32"),
        "mlp.fc1.gate.weight": ((VIEW_FFN, VIEW_H), "bfloat16"),
        "mlp.fc1.up.weight": ((VIEW_FFN, VIEW_H), "bfloat16"),
        "embed.weight": ((VIEW_VOCAB, VIEW_H), "float16"),
    }
    return {name: full_tensor(100 + i, shape, dtype) for i, (name, (shape, dtype)) in enumerate(shapes.items())}


def _save_views(rank, group, path):
    full = view_arrays()
    q, k, v = (full[f"attn.qkv.{p}.weight"].reshape(FUSED_GROUPS, -1, VIEW_H) for p in "qkv")
    qkv = torch.cat([q, k, v], dim=1)[rank : rank + 1].reshape(-1, VIEW_H)  # one group per rank
    gate, up = full["mlp.fc1.gate.weight"].chunk(2)[rank], full["mlp.fc1.up.weight"].chunk(2)[rank]
    embed = torch.zeros(2 * VIEW_PAD, VIEW_H, dtype=torch.float16)
    embed[:VIEW_VOCAB] = full["embed.weight"]
    state = {
        "attn": {"qkv": {"weight": qkv.clone()}},
        "mlp": {"fc1": {"weight": torch.cat([gate, up])}},
        "embed": {"weight": embed[rank * VIEW_PAD : (rank + 1) * VIEW_PAD].clone()},
    }
    lc.save(path, state, lc.Layout(lc.Mesh({"tp": 2}), VIEW_RULES), group=group, inner_chunk_bytes=32)
    return True


def test_fused_parts_and_padded_arrays_are_plain_zarr_arrays(ranks, tmp_path):
    path = str(tmp_path / "views")
    assert ranks.run(_save_views, 2, path) == [True] * 2
    want = {name: to_numpy(t) for name, t in view_arrays().items()}
    root = zarr.open_group(path, mode="r")
    arrays = {p for p, node in root.members(max_depth=None) if isinstance(node, zarr.Array)}
    assert arrays == {name.replace(".", "/") for name in want}  # no fused tensor, no padding
    for name, array in want.items():
        where = os.path.join(path, name.replace(".", "/"))
        z = zarr.open_array(where, mode="r")
        assert z.shape == array.shape and bit_equal(z[...], array), name
        assert bit_equal(z[1:-1], array[1:-1]), name
        store = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": where}}, read=True).result()
        assert tuple(store.shape) == array.shape and bit_equal(store.read().result(), array), name
        assert bit_equal(store[3 : array.shape[0]].read().result(), array[3:]), name
    # The padded vocabulary: logical rows only (7), in shards of the 5 rows each rank held.
    embed = zarr.open_array(os.path.join(path, "embed", "weight"), mode="r")
    assert embed.shape == (VIEW_VOCAB, VIEW_H) and embed.shards == (VIEW_PAD, VIEW_H)
    assert math.prod(embed.chunks) < math.prod(embed.shards)  # several inner chunks per shard
