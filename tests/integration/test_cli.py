"""The ``layoutckpt`` command line: every command on real checkpoints, checked against what was
saved (bit for bit), against the tests' own account of chunks and bytes, and against the bytes
a real load fetches; damage is found and named; errors are one line with the right exit code;
progress bars appear on a terminal (or when asked) and never in a pipe; and the commands run
with torch absent.
"""

from __future__ import annotations

import io
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.numpy import save_file
from safetensors.torch import load_file

import layoutckpt as lc
from layoutckpt.cli import _main as _cli
from layoutckpt.cli._read import parse_index
from layoutckpt.engine import _readplan
from layoutckpt.storage._location import PENDING
from tests.support.counters import bytes_read
from tests.support.paths import GOLDEN as GOLDENS

BIN = Path(sys.executable).parent
GOLDEN = GOLDENS / "v1" / "basic"

# The sharded checkpoint: saved as tp=4 would save it (import_safetensors chunks by a layout
# from one process), in inner chunks of at most 4 KiB.
SHARDED_RULES = [(r"^w$", lc.P("tp", None)), (r"^c$", lc.P(None, "tp")), (r".*", lc.P())]
SHARDED_TOML = """
[[rules]]
match = '^w$'
spec = "P('tp', None)"

[[rules]]
match = '^c$'
spec = "P(None, 'tp')"

[[rules]]
match = '.*'
spec = "P()"
"""


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = _cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def sharded_arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "w": rng.standard_normal((256, 128)).astype(np.float32),
        "c": rng.standard_normal((64, 96)).astype(np.float32),
        "v": np.arange(100, dtype=np.float32),
    }


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> tuple[str, dict]:
    """One process, torch and NumPy leaves, a tied weight, JSON values, metadata, rank state."""
    path = str(tmp_path_factory.mktemp("cli") / "small")
    emb = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32) / 7
    state = {
        "model": {"embed": {"weight": emb}, "head": {"weight": emb}, "norm": torch.linspace(-2, 2, 32).bfloat16()},
        "opt": {"m": np.linspace(0, 1, 16 * 8).reshape(16, 8)},
        "step": 7,
        "name": "demo",
        "lr": float("nan"),
    }
    lc.save(path, state, lc.Layout.replicated(), step=7, metadata={"run": "demo", "n": [1, 2]},
            rank_state={"pos": 5}, inner_chunk_bytes=1024)  # fmt: skip
    return path, state


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> tuple[str, dict[str, np.ndarray]]:
    folder = tmp_path_factory.mktemp("cli")
    arrays = sharded_arrays()
    save_file(arrays, str(folder / "m.safetensors"))
    path = str(folder / "sharded")
    layout = lc.Layout(lc.Mesh({"tp": 4}), SHARDED_RULES)
    lc.import_safetensors(folder / "m.safetensors", path, layout, step=3, inner_chunk_bytes=4096)
    (folder / "tp.toml").write_text(SHARDED_TOML)
    return path, arrays


# --- ls ----------------------------------------------------------------------------------------


def test_ls_json_is_what_was_saved(capsys, small, sharded):
    path, _ = small
    code, out, err = run(capsys, "ls", path, "--json")
    assert code == 0 and err == ""
    doc = json.loads(out)
    assert doc["step"] == 7 and doc["format_version"] == lc.FORMAT_VERSION
    assert doc["user_metadata"] == {"run": "demo", "n": [1, 2]}
    assert doc["values"] == {"step": 7, "name": "demo", "lr": "nan"}
    assert doc["aliases"] == {"model.head.weight": "model.embed.weight"}
    assert doc["rank_state_world"] == 1 and doc["all_chunks_stored"] is True
    assert list(doc["arrays"]) == ["model.embed.weight", "model.norm", "opt.m"]
    want = {"model.embed.weight": ((64, 32), "float32", 4), "model.norm": ((32,), "bfloat16", 2),
            "opt.m": ((16, 8), "float64", 8)}  # fmt: skip
    for name, (shape, dtype, itemsize) in want.items():
        a = doc["arrays"][name]
        assert (tuple(a["shape"]), a["dtype"], a["nbytes"]) == (shape, dtype, math.prod(shape) * itemsize)
        assert a["spec"] == [] and a["spec_repr"] == "P()" and a["mesh"] == {}
    assert doc["arrays"]["opt.m"]["kind"] == "numpy" and doc["arrays"]["model.norm"]["kind"] == "torch"
    assert doc["nbytes"] == 64 * 32 * 4 + 32 * 2 + 16 * 8 * 8

    path, _ = sharded
    doc = json.loads(run(capsys, "ls", path, "--json")[1])
    assert doc["mesh"] == {"tp": 4} and doc["step"] == 3
    assert doc["rules"] == [["^w$", ["tp", None]], ["^c$", [None, "tp"]], [".*", []]]
    assert doc["arrays"]["w"]["spec"] == ["tp", None] and doc["arrays"]["w"]["shard_shape"] == [64, 128]
    assert doc["arrays"]["c"]["spec_repr"] == "P(None, 'tp')" and doc["arrays"]["c"]["shard_shape"] == [64, 24]
    info = lc.open(path).info("w")
    assert tuple(doc["arrays"]["w"]["inner_chunk_shape"]) == info.inner_chunk_shape


def test_ls_text_shows_the_tree(capsys, small):
    path, _ = small
    code, out, _ = run(capsys, "ls", path)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith(f"{path}: step 7, 3 arrays")
    row = next(line for line in lines if line.strip().startswith("weight") and "float32" in line)
    assert row.split()[:7] == ["weight", "(64,", "32)", "float32", "8.0", "KiB", "P()"]
    assert any("-> model.embed.weight (tied" in line for line in lines)
    assert any(line.split() == ["lr", "=", '"nan"'] for line in lines)
    assert 'metadata: {"run": "demo", "n": [1, 2]}' in out
    # --flat: the global names alone, one a line (arrays, tied names and values), for grep.
    code, flat, _ = run(capsys, "ls", path, "--flat")
    assert code == 0
    assert flat.splitlines() == ["model.embed.weight", "model.head.weight", "model.norm", "opt.m", "step", "name", "lr"]


def test_ls_prints_rules_as_written(capsys):
    code, out, _ = run(capsys, "ls", GOLDEN)
    assert code == 0
    rules = [line.split() for line in out.splitlines() if "->" in line]
    assert ["^model\\.embed\\.weight$", "->", "P('tp',", "None)"] in rules, out
    assert "\\\\" not in out  # no doubled backslashes


def test_ls_of_a_manager_root_lists_its_steps(capsys, tmp_path):
    root = tmp_path / "run"
    with lc.CheckpointManager(root, async_save=False) as mgr:
        for step in (10, 20):
            mgr.save(step, {"w": np.full((8, 8), step, dtype=np.float32)})
    (root / "step_00000030" / "w").mkdir(parents=True)
    (root / "step_00000030" / PENDING).write_bytes(b"")  # a save under way, never committed
    (root / ".step_00000040.tmp-0123456789ab").mkdir()
    code, out, _ = run(capsys, "ls", root, "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["latest"] == 20
    assert [(s["step"], s["committed"]) for s in doc["steps"]] == [(10, True), (20, True), (30, False)]
    for s in doc["steps"]:
        files = [p for p in (root / s["name"]).rglob("*") if p.is_file()]
        assert s["nbytes"] == sum(p.stat().st_size for p in files)
    assert {(x["name"], x["action"]) for x in doc["leftovers"]} == {
        (".step_00000040.tmp-0123456789ab", "remove"),
        ("step_00000030", "remove"),
    }
    text = run(capsys, "ls", root)[1]
    assert "2 committed steps, latest 20" in text and "uncommitted" in text


def test_gc_of_a_folder_no_manager_ran_in_touches_nothing(capsys, tmp_path):
    """Names like a manager's own (a step folder, a staging folder) in a folder of someone
    else's: gc refuses it, deletes nothing and takes no lock."""
    home = tmp_path / "home"
    for name in (".cache.tmp-abc123", "step_7"):
        (home / name).mkdir(parents=True)
        (home / name / "results.txt").write_text("mine")
    code, _, err = run(capsys, "gc", home, "--keep-last", "1")
    assert code == 1 and "no CheckpointManager root" in err, err
    assert sorted(p.name for p in home.iterdir()) == [".cache.tmp-abc123", "step_7"]


# --- read --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "index", ["", "1:5,::2", "-1", "...,-2", "::-1,1:4", "::-3, 3", "10:20", "2:2", ":,-5", "5:1:-2,...", "-3:"]
)
def test_slices_select_what_numpy_selects(index):
    a = np.arange(35).reshape(7, 5)
    box, post = parse_index(index, a.shape, "a")
    got = a[tuple(slice(lo, hi) for lo, hi in box)][post]
    want = eval(f"a[{index}]") if index else a
    assert got.shape == want.shape and np.array_equal(got, want)


def test_read_out_never_writes_into_a_checkpoint(capsys, tmp_path):
    ck = tmp_path / "ck"
    lc.save(ck, {"w": np.arange(64, dtype=np.float32).reshape(8, 8)})
    for inside in (ck / "zarr.json", ck / "w" / "c.0.0", ck / "new.npy"):
        before = {p: p.read_bytes() for p in ck.rglob("*") if p.is_file()}
        code, _, err = run(capsys, "read", ck, "w", "--out", inside)
        assert code == 2 and "lies inside the checkpoint" in err, err
        assert {p: p.read_bytes() for p in ck.rglob("*") if p.is_file()} == before
    assert run(capsys, "verify", ck)[0] == 0


def test_read_saves_and_prints_bit_for_bit(capsys, tmp_path, small):
    path, state = small
    emb = state["model"]["embed"]["weight"].numpy()
    out = tmp_path / "x.npy"
    code, stdout, _ = run(capsys, "read", path, "model.head.weight", "--slice", "3:40:3, -8:", "--out", out)
    assert code == 0 and stdout.startswith(f"wrote {out}")
    got = np.load(out)
    assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), emb[3:40:3, -8:].view(np.uint32))

    # bfloat16 has no .npy type: its bits are saved, and a note says how to view them.
    code, _, err = run(capsys, "read", path, "model.norm", "--out", out)
    norm = state["model"]["norm"].float().numpy().astype(ml_dtypes.bfloat16)
    assert code == 0 and "np.load(f).view(ml_dtypes.bfloat16)" in err
    assert np.array_equal(np.load(out), norm.view(np.uint16))
    code, _, err = run(capsys, "read", path, "model.norm", "--out", out, "--astype", "float32")
    assert code == 0 and err == "" and np.array_equal(np.load(out), norm.astype(np.float32))

    code, stdout, _ = run(capsys, "read", path, "opt.m", "--slice", "2,:")
    header, body = stdout.split("\n", 1)
    assert header == "opt.m[2,:]: float64 (8,) of (16, 8)"
    assert body == repr(state["opt"]["m"][2]) + "\n"
    assert run(capsys, "read", path, "name")[1] == '"demo"\n'
    assert run(capsys, "read", path, "lr")[1] == '"nan"\n'


@pytest.mark.parametrize("packing", ["files", "ocdbt"])
def test_read_of_a_0d_array_prints_and_saves_it(capsys, tmp_path, packing):
    path = tmp_path / "ck"
    lc.save(path, {"z": np.int16(4), "w": np.ones(3, np.float32)}, packing=packing)
    code, stdout, _ = run(capsys, "read", path, "z")
    assert code == 0 and stdout == "z: int16 ()\n" + repr(np.array(4, np.int16)) + "\n"
    code, _, _ = run(capsys, "read", path, "z", "--out", tmp_path / "z.npy")
    assert code == 0 and np.load(tmp_path / "z.npy") == np.int16(4)


def test_read_of_a_sharded_array_crosses_shards(capsys, tmp_path, sharded):
    path, arrays = sharded
    out = tmp_path / "c.npy"
    assert run(capsys, "read", path, "c", "--slice", "5:60, 20:50", "--out", out)[0] == 0
    assert np.array_equal(np.load(out), arrays["c"][5:60, 20:50])


# --- verify ------------------------------------------------------------------------------------


def expected_counts(path: str) -> tuple[int, int, int]:
    """(shards, inner chunks, bytes) of a checkpoint, from its metadata, by the tests' own count."""
    rd = lc.open(path)
    shards = chunks = nbytes = 0
    for name in rd.keys():
        info = rd.info(name)
        for cell in itertools.product(*(range(-(-n // s)) for n, s in zip(info.shape, info.shard_shape))):
            extent = [min(s, n - i * s) for n, s, i in zip(info.shape, info.shard_shape, cell)]
            shards += 1
            chunks += math.prod(-(-e // c) for e, c in zip(extent, info.inner_chunk_shape))
            nbytes += math.prod(extent) * info.dtype.itemsize
    return shards, chunks, nbytes


def test_verify_counts_what_it_checked(capsys, small, sharded):
    for path, arrays in ((small[0], 3), (sharded[0], 3)):
        code, out, _ = run(capsys, "verify", path, "--json")
        doc = json.loads(out)
        assert code == 0 and doc["ok"] and doc["problems"] == [] and doc["warnings"] == []
        assert (doc["arrays"], doc["shards"], doc["chunks"], doc["bytes"]) == (arrays, *expected_counts(path))
    assert json.loads(run(capsys, "verify", small[0], "--json")[1])["rank_states"] == 1
    code, out, _ = run(capsys, "verify", sharded[0])
    assert code == 0 and out.startswith(f"{sharded[0]}: OK (3 arrays, 9 shards")


def test_verify_finds_every_damaged_array(capsys, tmp_path, sharded):
    path = tmp_path / "damaged"
    shutil.copytree(sharded[0], path)
    # One flipped byte in a shard of w (inside an inner chunk), one shard of c deleted, one
    # array document removed: three arrays, each named.
    shard = path / "w" / "c.2.0"
    data = bytearray(shard.read_bytes())
    data[10] ^= 0x40
    shard.write_bytes(bytes(data))
    (path / "c" / "c.0.3").unlink()
    (path / "v" / "zarr.json").unlink()
    code, out, _ = run(capsys, "verify", path, "--json")
    doc = json.loads(out)
    assert code == 1 and not doc["ok"]
    assert doc["damaged_arrays"] == ["c", "v", "w"]
    found = {(p["array"], p["shard"]): p["text"] for p in doc["problems"]}
    assert "fails its checksum" in found[("w", "c.2.0")] and "inner chunk {0, 0}" in found[("w", "c.2.0")]
    assert found[("c", "c.0.3")] == "the shard file is missing"
    assert "zarr.json is missing" in found[("v", None)]
    code, out, _ = run(capsys, "verify", path)
    assert code == 1
    assert "DAMAGED w shard c.2.0: fails its checksum" in out and "DAMAGED c shard c.0.3" in out
    assert out.splitlines()[-1].startswith(f"{path}: 3 damaged arrays, 3 problems")


def test_verify_checks_the_per_rank_documents(capsys, tmp_path, small):
    path = tmp_path / "rs"
    shutil.copytree(small[0], path)
    (path / ".rank_state" / "00000" / "zarr.json").write_text("{not json")
    code, out, _ = run(capsys, "verify", path, "--json")
    doc = json.loads(out)
    assert code == 1 and doc["damaged_arrays"] == []
    assert doc["problems"][0]["array"] is None and "per-rank state" in doc["problems"][0]["text"]


def test_verify_of_a_golden_allows_absent_zero_shards(capsys):
    # Version-1 goldens predate all_chunks_stored: their all-zero shards were left out.
    code, out, _ = run(capsys, "verify", GOLDEN, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["ok"]
    assert [(w["array"], w["shard"]) for w in doc["warnings"]] == [("mask", "c/1/0")]


# --- plan --------------------------------------------------------------------------------------


def piece(n: int, k: int, i: int) -> tuple[int, int]:
    """torch.chunk's i-th of k pieces of range(n)."""
    size = -(-n // k)
    return min(i * size, n), min((i + 1) * size, n)


def fetched(info: lc.ArrayInfo, box) -> tuple[int, int]:
    """(chunk bytes, index+crc bytes) a read of ``box`` fetches, counted shard by shard."""
    shard, inner, item = info.shard_shape, info.inner_chunk_shape, info.dtype.itemsize
    data = overhead = 0
    for cell in itertools.product(*(range(a // s, -(-b // s)) for (a, b), s in zip(box, shard))):
        sub = [(max(a, i * s), min(b, (i + 1) * s)) for (a, b), i, s in zip(box, cell, shard)]
        chunks = math.prod((hi - 1) // c - lo // c + 1 for (lo, hi), c in zip(sub, inner))
        data += chunks * item * math.prod(inner)
        # The index with its crc32c, and the binding block read with it (format 5.4).
        overhead += chunks * 4 + 16 * math.prod(s // c for s, c in zip(shard, inner)) + 4 + 32
    return data, overhead


def test_plan_of_the_saved_layout_reads_exactly_what_it_needs(capsys, sharded):
    path, arrays = sharded
    spec = Path(path).parent / "tp.toml"
    code, out, _ = run(capsys, "plan", path, "--spec", spec, "--mesh", "dp=2,tp=4", "--json")
    assert code == 0
    doc = json.loads(out)
    assert len(doc["ranks"]) == 8
    # Each tp piece of w and c is needed by its 2 dp replicas, v by all 8 ranks.
    total = 2 * (arrays["w"].nbytes + arrays["c"].nbytes) + 8 * arrays["v"].nbytes
    assert doc["total"]["bytes_needed"] == total == sum(r["bytes_needed"] for r in doc["ranks"])
    assert doc["total"]["amplification"] == 1.0 and doc["total"]["bytes_read"] == total
    rank5 = doc["ranks"][5]  # dp=1, tp=1
    # In tree order: import_safetensors stores the tensors by name.
    assert [(r["array"], r["box"]) for r in rank5["reads"]] == [
        ("c", [[0, 64], [24, 48]]),
        ("v", [[0, 100]]),
        ("w", [[64, 128], [0, 128]]),
    ]
    assert {r["shards"] for r in rank5["reads"]} == {1}


def test_plan_of_another_layout_counts_the_whole_chunks_it_reads(capsys, tmp_path, sharded):
    path, arrays = sharded
    rd = lc.open(path)
    # Rows in 3 pieces of 86 rows: their edges cut through inner chunks (and shards).
    toml = tmp_path / "rows3.toml"
    toml.write_text("[mesh]\ntp = 3\n\n[[rules]]\nmatch = '.*'\nspec = \"P('tp')\"\n")
    code, out, _ = run(capsys, "plan", path, "--spec", toml, "--json")
    assert code == 0
    doc = json.loads(out)
    for rank, r in enumerate(doc["ranks"]):
        for read in r["reads"]:
            info = rd.info(read["array"])
            n = info.shape[0]
            box = (piece(n, 3, rank), *((0, m) for m in info.shape[1:]))
            assert [tuple(b) for b in read["box"]] == list(box)
            data, overhead = fetched(info, box)
            assert read["bytes_needed"] == math.prod(b - a for a, b in box) * info.dtype.itemsize
            assert (read["bytes_read"], read["overhead_bytes"]) == (data, overhead)
    assert doc["total"]["bytes_needed"] == sum(a.nbytes for a in arrays.values())
    assert doc["total"]["amplification"] > 1.0

    # The text form: one row per rank and a total, and one rank array by array.
    code, out, _ = run(capsys, "plan", path, "--spec", toml)
    rows = [line.split() for line in out.splitlines()[2:]]
    assert [r[0] for r in rows] == ["0", "1", "2", "all"]
    assert rows[-1][-1] == f"{doc['total']['amplification']:.2f}x"
    code, out, _ = run(capsys, "plan", path, "--spec", toml, "--rank", "1")
    assert code == 0 and "rank 1 {'tp': 1}:" in out and "[86:172, 0:128]" in out


def test_plan_equals_the_bytes_a_real_load_fetches(tmp_path, sharded):
    path, arrays = sharded
    meta = lc.open(path).meta
    # A whole load in this process (one rank): every read the loader makes, measured.
    layout = lc.Layout(lc.Mesh({"tp": 1}), SHARDED_RULES)
    (plan,) = _readplan.plan_reads(meta, layout)
    before = bytes_read()
    out = lc.load(path, layout)
    assert bytes_read() - before == plan.bytes_read + plan.overhead_bytes
    assert all(np.array_equal(out[k].numpy(), v) for k, v in arrays.items())
    # The boxes of every rank of a columns layout, read as the loader reads them (one read each).
    layout = lc.Layout(lc.Mesh({"tp": 2}), [(r"^v$", lc.P()), (r".*", lc.P(None, "tp"))])
    rd = lc.open(path)
    for p in _readplan.plan_reads(meta, layout):
        for r in p.reads:
            before = bytes_read()
            rd.read(r.array, tuple(slice(a, b) for a, b in r.box))
            assert bytes_read() - before == r.bytes_read + r.overhead_bytes, (p.rank, r)


def test_plan_of_a_box_read_in_pieces(tmp_path):
    """A box over ``IOConfig.piece_bytes`` is read in pieces, in flight together, which share one
    read of the shard index; a piece that TensorStore sees late may read it again."""
    folder = tmp_path
    big = np.arange(4608 * 1024, dtype=np.float32).reshape(4608, 1024)  # 18 MiB: two pieces
    save_file({"big": big}, str(folder / "b.safetensors"))
    path = str(folder / "big")
    lc.import_safetensors(folder / "b.safetensors", path, inner_chunk_bytes=1 << 20)
    meta = lc.open(path).meta
    (plan,) = _readplan.plan_reads(meta, lc.Layout.replicated())
    (read,) = plan.reads
    assert len(_readplan.read_pieces(meta.arrays["big"], read.box)) == 2
    assert read.shards == 1 and read.bytes_read == big.nbytes
    info = lc.open(path).info("big")
    index_bytes = 16 * math.prod(s // c for s, c in zip(info.shard_shape, info.inner_chunk_shape)) + 4 + 32
    assert read.overhead_bytes == read.chunks * 4 + index_bytes
    before = bytes_read()
    out = lc.load(path)
    assert 0 <= bytes_read() - before - (plan.bytes_read + plan.overhead_bytes) <= index_bytes
    assert np.array_equal(out["big"].numpy(), big)


# --- export ------------------------------------------------------------------------------------


def test_export_writes_safetensors_that_load_equal(capsys, tmp_path, small, sharded):
    path, state = small
    out = tmp_path / "st"
    code, stdout, _ = run(capsys, "export", path, "--to", "safetensors", out)
    # One file: named as Hugging Face names it, with no index.
    assert code == 0 and stdout.split() == [str(out / "model.safetensors"), *stdout.split()[1:3]]
    assert sorted(os.listdir(out)) == ["model.safetensors"]
    got = load_file(str(out / "model.safetensors"))
    assert set(got) == {"model.embed.weight", "model.norm", "opt.m"}
    assert torch.equal(got["model.embed.weight"], state["model"]["embed"]["weight"])
    assert torch.equal(got["model.norm"].view(torch.int16), state["model"]["norm"].view(torch.int16))
    assert np.array_equal(got["opt.m"].numpy(), state["opt"]["m"])

    path, arrays = sharded
    out = tmp_path / "st2"
    code, _, _ = run(capsys, "export", path, "--to", "safetensors", out, "--select", "^(w|c)$",
                     "--max-shard-bytes", "100KiB")  # fmt: skip
    assert code == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    # c (24 KiB) comes first; w (128 KiB, over the limit) gets a file of its own.
    assert index["weight_map"] == {"c": "model-00001-of-00002.safetensors", "w": "model-00002-of-00002.safetensors"}
    for name, file in index["weight_map"].items():
        assert np.array_equal(load_file(str(out / file))[name].numpy(), arrays[name])


def test_export_needs_no_to_where_safetensors_is_the_one_format(capsys, tmp_path, sharded):
    path, arrays = sharded
    code, stdout, _ = run(capsys, "export", path, tmp_path / "st")
    assert code == 0
    written = [Path(line.split()[0]) for line in stdout.splitlines()]
    tensors = {k: v for f in written if f.suffix == ".safetensors" for k, v in load_file(str(f)).items()}
    assert set(tensors) == set(arrays) and all(np.array_equal(tensors[k].numpy(), a) for k, a in arrays.items())


# --- gc ----------------------------------------------------------------------------------------


def test_gc_keeps_the_steps_the_rules_keep(capsys, tmp_path):
    root = tmp_path / "run"
    with lc.CheckpointManager(root, async_save=False) as mgr:
        for step in range(1, 7):
            mgr.save(step, {"w": np.full((4,), step, dtype=np.float32)})
        # A second gc while the manager holds the root is refused.
        code, _, err = run(capsys, "gc", root, "--keep-last", "1")
        assert code == 1 and "another CheckpointManager" in err
    (root / ".step_00000007.tmp-0123456789ab").mkdir()
    (root / "step_00000008").mkdir()
    before = sorted(os.listdir(root))

    code, out, _ = run(capsys, "gc", root, "--keep-last", "2", "--keep-every", "3", "--dry-run", "--json")
    assert code == 0 and sorted(os.listdir(root)) == before
    doc = json.loads(out)
    # Newest 2: 5, 6; multiples of 3: 3, 6.
    assert doc["deleted"] == [1, 2, 4] and doc["kept"] == [3, 5, 6]

    code, out, _ = run(capsys, "gc", root, "--keep-last", "2", "--keep-every", "3")
    assert code == 0 and "deleted step 1 (step_00000001)" in out
    assert sorted(n for n in os.listdir(root) if n != ".layoutckpt.lock") == [
        "step_00000003",
        "step_00000005",
        "step_00000006",
    ]
    with lc.CheckpointManager(root) as mgr:
        assert mgr.steps() == [3, 5, 6]
        assert mgr.load()["w"].tolist() == [6.0] * 4
    # The newest committed step always stays.
    assert run(capsys, "gc", root, "--keep-last", "1")[0] == 0
    assert lc.CheckpointManager(root).steps() == [6]


def test_ls_and_gc_of_an_object_store_root(capsys):
    root = "memory://cli-run"  # this process's memory: the object-store code path, no server
    with lc.CheckpointManager(root, async_save=False) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": np.full((4,), step, dtype=np.float32)})
    code, out, _ = run(capsys, "ls", root, "--json")
    assert code == 0
    assert [(s["step"], s["committed"]) for s in json.loads(out)["steps"]] == [(1, True), (2, True), (3, True)]
    code, out, _ = run(capsys, "gc", root, "--keep-last", "1", "--json")
    assert code == 0 and json.loads(out)["deleted"] == [1, 2] and json.loads(out)["kept"] == [3]
    with lc.CheckpointManager(root) as mgr:
        assert mgr.steps() == [3]
    code, out, _ = run(capsys, "read", f"{root}/step_00000003", "w")
    assert code == 0 and out == "w: float32 (4,)\n" + repr(np.full((4,), 3, dtype=np.float32)) + "\n"


# --- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "code", "words"),
    [
        (["ls", "{missing}"], 1, ["no committed layoutckpt checkpoint", "{missing}"]),
        (["verify", "{missing}"], 1, ["no committed layoutckpt checkpoint"]),
        (["read", "{small}", "model.embed.wieght"], 1, ["'model.embed.wieght'", "did you mean 'model.embed.weight'"]),
        (["read", "{small}", "model.embed.weight", "--slice", "0:2,x"], 2, ["'x' is not an integer", "--slice"]),
        (["read", "{small}", "model.embed.weight", "--slice", "64,:"], 2, ["index 64 is out of range", "size 64"]),
        (["read", "{small}", "step", "--slice", "0"], 2, ["'step' is a JSON value"]),
        (["plan", "{small}", "--mesh", "dp=two"], 2, ["bad --mesh 'dp=two'", "--mesh dp=2,tp=4"]),
        (["plan", "{small}", "--spec", "nope.toml"], 2, ["no spec file 'nope.toml'"]),
        (["plan", "{small}", "--mesh", "dp=2", "--rank", "2"], 2, ["--rank 2 is outside"]),
        (["plan", "{small}", "--spec", "{spec}", "--mesh", "dp=2"], 2, ["names axis 'tp'", "does not have", "--mesh"]),
        (["export", "{small}", "--to", "safetensors", "{tmp}/x", "--select", "zzz"], 1, ["nothing to export"]),
        (["gc", "{missing}", "--keep-last", "1"], 1, ["no CheckpointManager root"]),
        (["gc", "{small}", "--keep-last", "1"], 2, ["'{small}' is a checkpoint, not a CheckpointManager root"]),
        (["ls", "{tmp}"], 1, ["'{tmp}' (the directory is not a checkpoint", "nor is it a CheckpointManager root"]),
        (["read", "{missing}", "x"], 1, ["no committed layoutckpt checkpoint at '{missing}'; check the path"]),
    ],
)
def test_errors_are_one_line_with_the_right_exit_code(capsys, tmp_path, small, sharded, argv, code, words):
    where = {"missing": str(tmp_path / "missing"), "small": small[0], "tmp": str(tmp_path),
             "spec": str(Path(sharded[0]).parent / "tp.toml")}  # fmt: skip
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    got, out, err = run(capsys, *(a.format(**where) for a in argv))
    assert got == code and out == ""
    assert err.count("\n") == 1 and err.startswith(f"layoutckpt {argv[0]}: error: "), err
    assert "Errno" not in err and "never finished" not in err, err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    for w in words:
        assert w.format(**where) in err, err


def test_usage_errors_exit_2(capsys, small):
    assert run(capsys, "gc", small[0])[0] == 2  # --keep-last is required
    assert run(capsys, "export", small[0], "--to", "safetensors", "x", "--max-shard-bytes", "5XB")[0] == 2
    assert run(capsys, "frobnicate")[0] == 2
    assert run(capsys, "--version")[1] == f"layoutckpt {lc.__version__}\n"


# --- processes: the installed script, pipes, progress, no torch ---------------------------------


def cli(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "layoutckpt"), *map(str, argv)], capture_output=True, text=True, timeout=120, env=env, check=False
    )


def test_the_installed_script_is_quiet_in_a_pipe_and_shows_progress_when_asked(small):
    path = small[0]
    piped = cli("verify", path)
    assert piped.returncode == 0 and piped.stdout.startswith(f"{path}: OK") and piped.stderr == ""
    forced = cli("verify", path, "--progress")
    assert forced.returncode == 0 and forced.stdout == piped.stdout
    assert "verify:" in forced.stderr and "%|" in forced.stderr and "/9.06k" in forced.stderr
    missing = subprocess.run([sys.executable, "-m", "layoutckpt", "ls", path + "-nope"], capture_output=True,
                             text=True, timeout=120, check=False)  # fmt: skip
    assert missing.returncode == 1 and missing.stdout == "" and "Traceback" not in missing.stderr
    assert missing.stderr.count("\n") == 1


NO_TORCH = """
import contextlib, io, sys
sys.modules["torch"] = None  # as if torch were not installed
from layoutckpt.cli._main import main
results = []
for argv in {argvs!r}:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    results.append([code, out.getvalue()])
assert sys.modules["torch"] is None
print(__import__("json").dumps(results))
"""


def test_the_commands_run_without_torch(tmp_path, small, sharded):
    path = small[0]
    argvs = [
        ["ls", path, "--json"],
        ["read", path, "opt.m", "--out", str(tmp_path / "m.npy")],
        ["verify", path],
        ["plan", sharded[0], "--spec", str(Path(sharded[0]).parent / "tp.toml"), "--mesh", "tp=4", "--json"],
        ["export", sharded[0], "--to", "safetensors", str(tmp_path / "st")],
    ]
    proc = subprocess.run([sys.executable, "-c", NO_TORCH.format(argvs=argvs)], capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout.splitlines()[-1])
    assert [code for code, _ in results] == [0] * len(argvs), results
    assert json.loads(results[0][1])["arrays"]["opt.m"]["shape"] == [16, 8]
    assert np.array_equal(np.load(tmp_path / "m.npy"), small[1]["opt"]["m"])
    assert results[2][1].startswith(f"{path}: OK")
    assert json.loads(results[3][1])["total"]["amplification"] == 1.0
    assert (tmp_path / "st" / "model.safetensors").is_file()


def test_npy_of_a_float8_array_keeps_its_bits(capsys, tmp_path):
    path = str(tmp_path / "f8")
    x = np.linspace(-4, 4, 24).astype(ml_dtypes.float8_e4m3fn).reshape(4, 6)
    lc.save(path, {"x": x}, lc.Layout.replicated())
    out = tmp_path / "x.npy"
    code, _, err = run(capsys, "read", path, "x", "--out", out)
    assert code == 0 and "uint8" in err
    assert np.array_equal(np.load(out).view(ml_dtypes.float8_e4m3fn).view(np.uint8), x.view(np.uint8))
    buf = io.StringIO()
    print(repr(x), file=buf)
    assert run(capsys, "read", path, "x")[1] == "x: float8_e4m3fn (4, 6)\n" + buf.getvalue()


# --- plan of a layout with stages, local names, fused and padded tensors -----------------------

# Two pipeline stages of two layers, each numbering its layers from 0; a QKV fused with its 4
# query groups interleaved, a fused [gate; up], and a vocabulary of 13 rows padded to 16.
STAGED_TOML = r"""
stages = ["pp"]

[mesh]
pp = 2
tp = 2

[[names]]
renumber = '^layers\.(\d+)\.'
axis = "pp"
per = 2

[[replicas]]
match = '^embedding\.'
policy = "mean"

[[rules]]
match = 'qkv\.weight$'
spec = "Fused(P('tp', None), [('q', 4), ('k', 2), ('v', 2)], groups=4)"

[[rules]]
match = 'fc1\.weight$'
spec = "Fused(P('tp', None), [('gate', 8), ('up', 8)])"

[[rules]]
match = '^embedding\.weight$'
spec = "Padded(P('tp', None), 13)"

[[rules]]
match = '.*'
spec = "P()"
"""


@pytest.fixture(scope="module")
def staged(tmp_path_factory) -> tuple[str, Path, dict]:
    """Saved by one process holding every stage (pp=1, tp=1: local names are the global ones)."""
    import tomllib

    folder = tmp_path_factory.mktemp("cli")
    g = torch.Generator().manual_seed(0)
    state: dict = {"embedding": {"weight": torch.randn(16, 8, generator=g)}, "layers": {}}
    for i in range(4):
        state["layers"][str(i)] = {
            "qkv": {"weight": torch.randn(32, 8, generator=g)},
            "fc1": {"weight": torch.randn(16, 8, generator=g)},
            "norm": {"weight": torch.randn(8, generator=g)},
        }
    doc = tomllib.loads(STAGED_TOML)
    doc["names"][0]["per"] = 4
    layout = lc.Layout.from_toml_dict(doc, lc.Mesh({"pp": 1, "tp": 1}))
    path = str(folder / "staged")
    lc.save(path, state, layout)
    (folder / "staged.toml").write_text(STAGED_TOML)
    return path, folder / "staged.toml", state


def test_plan_of_stages_names_fused_and_padded_reads_what_each_stage_holds(capsys, staged):
    path, toml, _ = staged
    code, out, _ = run(capsys, "plan", path, "--spec", toml, "--json")
    assert code == 0
    doc = json.loads(out)
    views = doc["views"]
    assert views["stage_axes"] == ["pp"] and views["replicas"] == [["^embedding\\.", "mean"]]
    assert views["names"] == [repr(lc.Renumber(r"^layers\.(\d+)\.", "pp", per=2))]
    arrays = {a["array"]: a for a in views["arrays"]}
    assert len(arrays) == 1 + 4 * 6  # the embedding; per layer q, k, v, gate, up, norm
    assert arrays["layers.3.qkv.k.weight"] == {
        "array": "layers.3.qkv.k.weight",
        "rule": r"qkv\.weight$",
        "spec": "Fused(P('tp', None), [('q', 4), ('k', 2), ('v', 2)], groups=4)",
        "read_spec": ["tp", None],
        "fused": "layers.3.qkv.weight",
        "part": "k",
        "stage": {"pp": 1},
        "local": "layers.1.qkv.weight",
    }
    assert arrays["layers.0.fc1.up.weight"]["fused"] == "layers.0.fc1.weight"
    assert arrays["layers.0.fc1.up.weight"]["stage"] == {"pp": 0}
    assert arrays["embedding.weight"]["spec"] == "Padded(P('tp', None), 13)"
    assert arrays["embedding.weight"]["read_spec"] == ["tp", None] and arrays["embedding.weight"]["stage"] is None
    assert (
        arrays["layers.2.norm.weight"]["read_spec"] == []
        and arrays["layers.2.norm.weight"]["local"] == "layers.0.norm.weight"
    )

    # Each rank reads its stage's layers (and the embedding, which no rule places): its
    # tensor-parallel piece of every fused part and of the logical rows, every norm whole.
    rd = lc.open(path)
    for r in doc["ranks"]:
        pp, tp = divmod(r["rank"], 2)
        held = {"embedding.weight"} | {
            n for n in arrays if n.startswith((f"layers.{2 * pp}.", f"layers.{2 * pp + 1}."))
        }
        assert {read["array"] for read in r["reads"]} == held
        for read in r["reads"]:
            shape = rd.info(read["array"]).shape
            rows = [list(piece(shape[0], 2, tp))] if len(shape) == 2 else [[0, shape[0]]]
            assert read["box"] == rows + [[0, n] for n in shape[1:]], read
    nbytes = {n: math.prod(rd.info(n).shape) * 4 for n in arrays}
    # Every split array once per stage holding it (the embedding: both), every norm twice (tp).
    expected = sum(nbytes.values()) + nbytes["embedding.weight"] + sum(v for n, v in nbytes.items() if "norm" in n)
    assert doc["total"]["bytes_needed"] == expected

    # The text form names the rules, the parts' stored names, and each array's stage and local name.
    code, out, _ = run(capsys, "plan", path, "--spec", toml)
    assert code == 0
    for words in [
        "stage axes: pp (2 coordinates)",
        r"Renumber('^layers\\.(\\d+)\\.', 'pp', per=2)  pp=0: 0-1, pp=1: 2-3",
        r"'^embedding\\.' -> mean",
        "Fused(P('tp', None), [('q', 4), ('k', 2), ('v', 2)], groups=4)",
        "stored as its parts <name>.q, <name>.k, <name>.v (4 groups interleaved along dimension 0)",
        "Padded(P('tp', None), 13)",
        "1 array that no Renumber rule places on a stage (e.g. 'embedding.weight')",
    ]:
        assert words in out, words
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith("  layers.")}
    assert rows["layers.3.qkv.k.weight"] == [
        r"'qkv\\.weight$'",
        "part",
        "k",
        "of",
        "layers.3.qkv.weight",
        "P('tp',",
        "None)",
        "pp=1",
        "layers.1.qkv.weight",
    ]
    assert rows["layers.0.norm.weight"] == ["'.*'", "P()", "pp=0"]
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["rank", "reads"])
    assert [line.split()[0] for line in lines[header + 1 :]] == ["0", "1", "2", "3", "all"]

    # A mesh with fewer stages than the numbers need: those layers are read by no rank.
    code, out, _ = run(capsys, "plan", path, "--spec", toml, "--mesh", "pp=1,tp=2")
    assert code == 0 and "12 arrays numbered past the last stage coordinate (e.g. 'layers.2.qkv.q.weight')" in out


def test_plan_of_fused_and_padded_parts_equals_the_bytes_a_load_with_like_fetches(capsys, tmp_path, staged):
    path, _, state = staged
    """One process holding every stage: what ``plan`` counts for its rank is what the load reads."""
    toml = tmp_path / "one.toml"
    toml.write_text(STAGED_TOML.replace("pp = 2", "pp = 1").replace("tp = 2", "tp = 1").replace("per = 2", "per = 4"))
    code, printed, _ = run(capsys, "plan", path, "--spec", toml, "--json")
    assert code == 0
    (plan,) = json.loads(printed)["ranks"]
    assert len(plan["reads"]) == 25
    before = bytes_read()
    out = lc.load(path, lc.Layout.from_file(toml), like=state)
    assert bytes_read() - before == plan["bytes_read"] + plan["overhead_bytes"]
    assert torch.equal(out["layers"]["2"]["qkv"]["weight"], state["layers"]["2"]["qkv"]["weight"])
    assert torch.equal(out["embedding"]["weight"][:13], state["embedding"]["weight"][:13])


def test_options_that_cannot_work_are_usage_errors_in_the_commands_terms(capsys, tmp_path):
    ck = tmp_path / "ck"
    lc.save(ck, {"w": np.arange(6, dtype=np.float32)})
    for args in (("--max-shard-bytes", "0"), ("--max-shard-bytes", "0.5"), ("--prefix", "a/b"), ("--prefix", "")):
        code, _, err = run(capsys, "export", ck, tmp_path / "hf", *args)
        assert code == 2 and args[0] in err, (args, err)
    assert not (tmp_path / "hf").exists()
    # A value starting with '-' is the slice's, not an option.
    code, out, _ = run(capsys, "read", ck, "w", "--slice", "-2:")
    assert code == 0 and out.endswith(repr(np.arange(4, 6, dtype=np.float32)) + "\n")
    # A missing DCP folder is missing, whatever --trust says; a fix names the command's option.
    code, _, err = run(capsys, "import", tmp_path / "nowhere", tmp_path / "out", "--from", "dcp")
    assert code == 1 and "no DCP checkpoint" in err and "--trust" not in err, err
    save_file({"w": np.ones(3, np.float32)}, tmp_path / "w.safetensors")
    code, _, err = run(capsys, "import", tmp_path / "w.safetensors", ck)
    assert code == 1 and "pass --overwrite to replace it" in err and "overwrite=True" not in err, err
