"""Save under one layout on k ranks, load under another on m ranks: bit-exact, every dtype,
plain or packed, into new tensors or in place; and any NumPy index of each array in one process.

Every rank rebuilds the full tensors from a seed, cuts its own shard with ``torch.chunk`` (the
expectation is computed here, never by the library), saves or loads, and compares raw bytes, so
NaN payloads, signed zeros and float8 specials must survive unchanged.
"""

from __future__ import annotations

import itertools
import math

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import layoutckpt as lc
from tests.support.oracle import local_shard

AXIS_NAMES = ("dp", "tp", "pp")
DTYPES = (
    "float32",
    "float64",
    "float16",
    "bfloat16",
    "float8_e4m3fn",
    "float8_e5m2",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "bool",
)
_paths = itertools.count()


# ----------------------------------------------------------------------------- model


def full_tensor(seed: int, index: int, shape: tuple[int, ...], dtype_name: str) -> torch.Tensor:
    """Deterministic random bits of ``dtype`` (NaNs, infinities and subnormals included)."""
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(seed * 64 + index)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g, dtype=torch.uint8).bool()
    width = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (math.prod(shape) * width,), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def bits(t: torch.Tensor) -> torch.Tensor:
    if t.numel() == 0:  # empty arrays may carry zero strides, which .view(dtype) refuses
        return torch.empty(0, dtype=torch.uint8)
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_bit_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert isinstance(got, torch.Tensor), (what, type(got))
    assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
    assert tuple(got.shape) == tuple(want.shape), (what, tuple(got.shape), tuple(want.shape))
    assert torch.equal(bits(got), bits(want)), what


def layout_for(axes: dict[str, int], arrays, specs) -> lc.Layout:
    rules = [(rf"^p\.a{i}$", lc.P(*spec)) for i, spec in enumerate(specs)]
    return lc.Layout(lc.Mesh(axes), rules)


# ----------------------------------------------------------------------------- rank functions


def _save(rank, group, path, seed, arrays, axes, specs, inner, compression, packing):
    state = {
        "p": {
            f"a{i}": local_shard(full_tensor(seed, i, shape, dtype), spec, axes, rank)
            for i, ((shape, dtype), spec) in enumerate(zip(arrays, specs))
        },
        "step": 7,
    }
    layout = layout_for(axes, arrays, specs)
    result = lc.save(
        path, state, layout, group=group, inner_chunk_bytes=inner, compression=compression, packing=packing
    )
    return result.bytes_written


def _load(rank, group, path, seed, arrays, axes, specs, inplace):
    wants = {
        f"a{i}": local_shard(full_tensor(seed, i, shape, dtype), spec, axes, rank)
        for i, ((shape, dtype), spec) in enumerate(zip(arrays, specs))
    }
    like = {"p": {k: torch.zeros(w.shape, dtype=w.dtype) for k, w in wants.items()}, "step": 0} if inplace else None
    out = lc.load(path, layout_for(axes, arrays, specs), group=group, like=like, inplace=inplace)
    assert set(out) == {"p", "step"} and out["step"] == 7
    assert set(out["p"]) == set(wants)
    for (name, want), (shape, dtype), spec in zip(wants.items(), arrays, specs):
        assert_bit_equal(out["p"][name], want, f"rank {rank}: {name} {shape} {dtype} {spec} inplace={inplace}")
    return True


# ----------------------------------------------------------------------------- strategies


def factorizations(k: int) -> list[tuple[int, ...]]:
    sizes = range(1, k + 1)
    return [f for n in (1, 2, 3) for f in itertools.product(sizes, repeat=n) if math.prod(f) == k]


@st.composite
def mesh_of(draw, k: int) -> dict[str, int]:
    sizes = draw(st.sampled_from(factorizations(k)))
    names = draw(st.permutations(AXIS_NAMES))[: len(sizes)]
    return dict(zip(names, sizes))


@st.composite
def spec_for(draw, axes: dict[str, int], ndim: int):
    """Each mesh axis splits one dim or none (then it holds replicas); several axes on one dim
    are listed major to minor in a random order."""
    target = {a: draw(st.sampled_from([None, *range(ndim)])) for a in axes}
    order = draw(st.permutations(list(axes)))
    entries = [tuple(a for a in order if target[a] == d) for d in range(ndim)]
    used = [d for d in range(ndim) if entries[d]]
    length = draw(st.integers(used[-1] + 1 if used else 0, ndim))
    return [None if not e else e[0] if len(e) == 1 else e for e in entries[:length]]


@st.composite
def index_for(draw, shape: tuple[int, ...]):
    """A NumPy index of ``shape``: per dimension everything, a slice (out-of-range and
    negative bounds, a step) or an integer."""
    index = []
    for n in shape:
        kind = draw(st.sampled_from(["all", "slice", "int"] if n else ["all", "slice"]))
        if kind == "all":
            index.append(slice(None))
        elif kind == "int":
            index.append(draw(st.integers(-n, n - 1)))
        else:
            bound = st.integers(-n - 2, n + 2)
            index.append(slice(draw(bound), draw(bound), draw(st.sampled_from([None, 1, 2, 3]))))
    return tuple(index)


@st.composite
def scenarios(draw):
    k, m = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    axes_a, axes_b = draw(mesh_of(k)), draw(mesh_of(m))
    arrays, specs_a, specs_b, indexes = [], [], [], []
    for _ in range(draw(st.integers(1, 4))):
        shape = draw(st.integers(0, 3).flatmap(lambda nd: st.tuples(*[st.integers(0, 13)] * nd)))
        arrays.append((shape, draw(st.sampled_from(DTYPES))))
        specs_a.append(draw(spec_for(axes_a, len(shape))))
        specs_b.append(draw(spec_for(axes_b, len(shape))))
        indexes.append(draw(index_for(shape)))
    return {
        "k": k,
        "m": m,
        "axes_a": axes_a,
        "axes_b": axes_b,
        "arrays": arrays,
        "specs_a": specs_a,
        "specs_b": specs_b,
        "seed": draw(st.integers(0, 2**20)),
        "inner": draw(st.sampled_from([8, 64, 512, 1 << 20])),
        "compression": draw(st.sampled_from([None, None, "zstd", "blosc"])),
        "packing": draw(st.sampled_from(["files", "ocdbt"])),
        "inplace": draw(st.booleans()),
        "indexes": indexes,
    }


# ----------------------------------------------------------------------------- tests


@given(s=scenarios())
def test_reshard_roundtrip_is_bit_exact(ranks, tmp_path, s):
    path = str(tmp_path / f"ck{next(_paths)}")
    written = ranks.run(
        _save,
        s["k"],
        path,
        s["seed"],
        s["arrays"],
        s["axes_a"],
        s["specs_a"],
        s["inner"],
        s["compression"],
        s["packing"],
    )
    # Every element is written exactly once across ranks, by one replica.
    itemsizes = [torch.empty((), dtype=getattr(torch, d)).element_size() for _, d in s["arrays"]]
    assert sum(written) == sum(math.prod(shape) * w for (shape, _), w in zip(s["arrays"], itemsizes))

    loaded = ranks.run(_load, s["m"], path, s["seed"], s["arrays"], s["axes_b"], s["specs_b"], s["inplace"])
    assert loaded == [True] * s["m"]

    # A single process with no process group reads every whole array back, too.
    rd = lc.open(path)
    assert rd.keys() == [f"p.a{i}" for i in range(len(s["arrays"]))]
    for i, (shape, dtype) in enumerate(s["arrays"]):
        got = torch.from_numpy(np.ascontiguousarray(rd.read(f"p.a{i}")).view(np.uint8))
        want = full_tensor(s["seed"], i, shape, dtype)
        assert torch.equal(got.reshape(-1), bits(want)), (i, shape, dtype)
        # A partial read gives what NumPy's indexing of the whole array gives.
        index = s["indexes"][i]
        whole = np.asarray(rd.read(f"p.a{i}"))
        part = np.ascontiguousarray(rd.read(f"p.a{i}", index))
        expect = np.ascontiguousarray(whole[index])
        assert part.shape == expect.shape, (i, shape, index)
        assert part.reshape(-1).view(np.uint8).tobytes() == expect.reshape(-1).view(np.uint8).tobytes(), (i, index)


# ----------------------------------------------------------------------------- plain tests


JSON_LEAVES = {
    "lr": 3e-4,
    "name": "run-1",
    "flag": True,
    "off": False,
    "nothing": None,
    "count": 12,
    "big": 2**62,
    "neg_inf": float("-inf"),
    "nan": float("nan"),
    "history": [1, "two", 3.5, None, [True]],
    "pair": (4, "x"),
}


def _np_state(rank: int, world: int) -> dict:
    full = np.arange(6 * 5, dtype=np.float64).reshape(6, 5) - 7.5
    return {
        "np": {
            "rows": full[3 * rank : 3 * rank + 3] if world == 2 else full,
            "bf16": np.linspace(-2, 2, 12).astype(ml_dtypes.bfloat16).reshape(3, 4),
            "u8": np.arange(9, dtype=np.uint8),
            "scalar": np.float32(2.5),
            "iscalar": np.int64(-3),
        },
        "t": torch.arange(4, dtype=torch.int32),
        "cfg": dict(JSON_LEAVES),
    }


def _save_np(rank, group, path):
    layout = lc.Layout(lc.Mesh({"dp": 2}), [(r"^np\.rows$", lc.P("dp")), (r".*", lc.P())])
    lc.save(path, _np_state(rank, 2), layout, group=group, step=3)
    return True


def np_bits(a) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def assert_same_json(got, want) -> None:
    assert type(got) is type(want), (got, want)
    if isinstance(want, list | tuple):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert_same_json(g, w)
    elif isinstance(want, float) and math.isnan(want):
        assert math.isnan(got)
    else:
        assert got == want


def test_numpy_and_json_leaves_keep_their_types(ranks, tmp_path):
    path = str(tmp_path / "np")
    assert ranks.run(_save_np, 2, path) == [True, True]
    want = _np_state(0, 1)
    out = lc.load(path)  # one process, no process group
    assert set(out) == {"np", "t", "cfg"}
    for key, w in want["np"].items():
        g = out["np"][key]
        assert type(g) is type(w), (key, type(g), type(w))
        assert g.dtype == w.dtype, key
        assert np.shape(g) == np.shape(w), key
        assert np.array_equal(np_bits(g), np_bits(w)), key
    assert isinstance(out["t"], torch.Tensor) and torch.equal(out["t"], want["t"])
    assert set(out["cfg"]) == set(JSON_LEAVES)
    for key, w in JSON_LEAVES.items():
        assert_same_json(out["cfg"][key], w)
    rd = lc.open(path)
    assert rd.step == 3
    assert rd.read("cfg.name") == "run-1"
    assert rd.read("cfg.history.2") == 3.5
    assert "cfg.pair.1" in rd.value_keys()


@pytest.mark.parametrize(
    ("select", "kept"),
    [
        (r"^np\.", {"np": {"rows", "bf16", "u8", "scalar", "iscalar"}}),
        (["np.u8", "cfg.lr", "t"], {"np": {"u8"}, "cfg": {"lr"}, "t": None}),
        (lambda name: name.endswith("scalar") or name == "cfg.name", {"np": {"scalar", "iscalar"}, "cfg": {"name"}}),
    ],
)
def test_select_loads_only_the_chosen_leaves(ranks, tmp_path, select, kept):
    path = str(tmp_path / "sel")
    ranks.run(_save_np, 2, path)
    want = _np_state(0, 1)
    out = lc.load(path, select=select)
    assert set(out) == set(kept)
    for top, leaves in kept.items():
        if leaves is None:
            assert torch.equal(out[top], want[top])
            continue
        assert set(out[top]) == leaves
        for leaf in leaves:
            w = want[top][leaf]
            if isinstance(w, np.ndarray | np.generic):
                assert np.array_equal(np_bits(out[top][leaf]), np_bits(w))
            else:
                assert out[top][leaf] == w


def _save_w(rank, group, path):
    mesh = lc.Mesh({"tp": 2})
    full = torch.arange(7 * 6, dtype=torch.float32).reshape(7, 6)
    state = {"w": full.chunk(2)[rank], "b": torch.ones(3, dtype=torch.bfloat16), "n": np.arange(5)}
    lc.save(path, state, lc.Layout(mesh, [(r"^w$", lc.P("tp")), (r".*", lc.P())]), group=group)
    return True


def _load_like(rank, group, path):
    mesh = lc.Mesh({"dp": 1, "tp": 3})
    layout = lc.Layout(mesh, [(r"^w$", lc.P(None, "tp")), (r".*", lc.P())])
    full = torch.arange(7 * 6, dtype=torch.float32).reshape(7, 6)
    want = full.chunk(3, dim=1)[rank]
    # A template of 'meta' tensors names what to load (and where): no memory for the template.
    template = {
        "w": torch.empty(want.shape, dtype=torch.float32, device="meta"),
        "b": torch.empty(3, dtype=torch.bfloat16, device="meta"),
        "n": np.zeros(5, dtype=np.int64),
    }
    out = lc.load(path, layout, like=template, group=group)
    assert set(out) == {"w", "b", "n"}
    assert out["w"].device.type == "cpu" and torch.equal(out["w"], want)
    assert out["b"].dtype == torch.bfloat16 and torch.equal(out["b"], torch.ones(3, dtype=torch.bfloat16))
    assert isinstance(out["n"], np.ndarray) and np.array_equal(out["n"], np.arange(5))
    # A partial template with strict=False loads only what it names, in the template's tree.
    part = lc.load(path, layout, like={"w": torch.empty_like(want)}, strict=False, group=group)
    assert list(part) == ["w"] and torch.equal(part["w"], want)
    # A stored numpy leaf loads as a tensor when the template holds a tensor there.
    as_tensor = lc.load(path, layout, like={"n": torch.empty(5, dtype=torch.int64)}, strict=False, group=group)
    assert isinstance(as_tensor["n"], torch.Tensor) and torch.equal(as_tensor["n"], torch.arange(5))
    return True


def test_like_template_reshards_and_chooses_types(ranks, tmp_path):
    path = str(tmp_path / "like")
    assert ranks.run(_save_w, 2, path) == [True, True]
    assert ranks.run(_load_like, 3, path) == [True, True, True]


def _load_whole_by_default(rank, group, path):
    out = lc.load(path, group=group)
    return out["w"].tolist()


def test_load_without_layout_gives_every_rank_everything(ranks, tmp_path):
    path = str(tmp_path / "ck")
    w = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    lc.save(path, {"w": w}, lc.Layout.replicated())
    assert ranks.run(_load_whole_by_default, 3, path) == [w.tolist()] * 3
