"""Hugging Face safetensors interop: export and import, checked bit for bit against the
``safetensors`` package (an independent reader and writer) and plain zarr-python."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch
import zarr

import layoutckpt as lc
from layoutckpt import _safetensors
from layoutckpt._safetensors import chunk_pieces, export_safetensors, import_safetensors, row_blocks
from layoutckpt.base import _faults
from layoutckpt.format._dtypes import ZARR_TO_NUMPY
from layoutckpt.format._safetensors_format import SAFETENSORS_TO_ZARR, ZARR_TO_SAFETENSORS
from tests.support.paths import REPO


def sample_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed.weight": torch.randn(7, 5, generator=g),
        "model.layers.0.attn.q_proj.weight": torch.randn(6, 4, generator=g).bfloat16(),
        "model.layers.0.norm.weight": torch.randn(4, generator=g).half(),
        "model.head.bias": torch.randn(3, generator=g).double(),
        "special": torch.tensor([float("nan"), -0.0, float("inf"), -float("inf")]),
        "ids": torch.arange(-5, 7, dtype=torch.int64).reshape(3, 4),
        "mask": torch.rand(9, generator=g) > 0.5,
        "fp8.e4m3": torch.randn(2, 8, generator=g).to(torch.float8_e4m3fn),
        "fp8.e5m2": torch.randn(8, generator=g).to(torch.float8_e5m2),
        "int.i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "int.i16": torch.tensor([-(2**15), 7], dtype=torch.int16),
        "int.i32": torch.tensor([[-(2**31), 2**31 - 1]], dtype=torch.int32),
        "int.u8": torch.tensor([0, 255], dtype=torch.uint8),
        "int.u16": torch.tensor([0, 2**16 - 1], dtype=torch.uint16),
        "int.u32": torch.tensor([0, 2**32 - 1], dtype=torch.uint32),
        "int.u64": torch.tensor([0, 2**63 + 5], dtype=torch.uint64),
        "scale": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
    }


def raw(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, name: str = "") -> None:
    """Same dtype, shape and bytes (NaN payloads and -0.0 included)."""
    assert got.dtype == want.dtype and got.shape == want.shape, name
    assert raw(got) == raw(want), name


def assert_state_equal(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert_bits_equal(got[name], want[name], name)


def load_hf(files: list[str]) -> dict[str, torch.Tensor]:
    """Load an export as Hugging Face does: one file whole, or the files the index names."""
    if len(files) == 1:
        return safetensors.torch.load_file(files[0])
    index_path = Path(files[-1])
    weight_map = json.loads(index_path.read_text())["weight_map"]
    out: dict[str, torch.Tensor] = {}
    for file in sorted(set(weight_map.values())):
        part = safetensors.torch.load_file(index_path.parent / file)
        assert {n for n, f in weight_map.items() if f == file} == set(part)
        out.update(part)
    return out


def file_header(path: str | Path) -> tuple[int, dict]:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return 8 + n, json.loads(f.read(n))


def craft(path: Path, header: dict, data: bytes) -> Path:
    """A safetensors file with exactly this header and data, however wrong."""
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)
    return path


# --- Export ---


def test_export_round_trip_every_dtype(tmp_path):
    state = sample_state()
    lc.save(tmp_path / "ck", {**state, "note": "json leaves are not exported"}, lc.Layout.replicated())
    files = export_safetensors(tmp_path / "ck", tmp_path / "hf")
    assert [Path(f).name for f in files] == ["model.safetensors"]  # one file: no index, as save_pretrained
    assert_state_equal(load_hf(files), state)
    start, header = file_header(files[0])
    assert header.pop("__metadata__") == {"format": "pt"}  # transformers refuses files without it
    # Wider types first, after a header padded to 8 bytes: every tensor is aligned to its type.
    assert start % 8 == 0
    for entry in header.values():
        itemsize = ZARR_TO_NUMPY[SAFETENSORS_TO_ZARR[entry["dtype"]]].itemsize
        assert (start + entry["data_offsets"][0]) % itemsize == 0


def test_export_numpy_loader_reads_native_types(tmp_path):
    state = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.array([True, False]), "c": np.int64(7)}
    lc.save(tmp_path / "ck", state, lc.Layout.replicated())
    got = safetensors.numpy.load_file(export_safetensors(tmp_path / "ck", tmp_path / "hf")[0])
    for name, want in state.items():
        assert got[name].dtype == np.asarray(want).dtype and np.array_equal(got[name], want), name


def test_export_shards_and_index(tmp_path):
    state = {f"layers.{i}.weight": torch.full((10, 10), float(i)) for i in range(7)}  # 400 bytes each
    state["big"] = torch.arange(300.0)  # 1200 bytes: more than a file holds, so a file of its own
    lc.save(tmp_path / "ck", state, lc.Layout.replicated())
    files = export_safetensors(tmp_path / "ck", tmp_path / "hf", max_shard_bytes=1000, prefix="pytorch_model")
    names = [Path(f).name for f in files]
    assert names[-1] == "pytorch_model.safetensors.index.json"
    assert names[:-1] == [f"pytorch_model-{i:05d}-of-00005.safetensors" for i in range(1, 6)]
    index = json.loads(Path(files[-1]).read_text())
    assert sorted(index["weight_map"]) == sorted(state)  # every name, once
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())
    for f in files[:-1]:
        tensors = safetensors.torch.load_file(f)
        assert sum(t.numel() * t.element_size() for t in tensors.values()) <= 1000 or len(tensors) == 1
    assert_state_equal(load_hf(files), state)
    assert not [p for p in (tmp_path / "hf").iterdir() if p.name.startswith(".")], "temporary files left"


def _layers(value: float) -> dict:
    return {f"layers.{i}.weight": torch.full((10, 10), value) for i in range(3)}  # 400 bytes each


def test_a_new_export_replaces_an_earlier_one_as_a_whole(tmp_path):
    """Three files and an index, then one file: the earlier set and its index go, so a folder
    import reads the new weights, not the old ones through the stale index."""
    lc.save(tmp_path / "a", _layers(1.0), lc.Layout.replicated())
    lc.save(tmp_path / "b", {"w": torch.full((4,), 2.0)}, lc.Layout.replicated())
    export_safetensors(tmp_path / "a", tmp_path / "hf", max_shard_bytes=400)
    assert len(os.listdir(tmp_path / "hf")) == 4
    assert export_safetensors(tmp_path / "b", tmp_path / "hf") == [os.fspath(tmp_path / "hf" / "model.safetensors")]
    assert sorted(os.listdir(tmp_path / "hf")) == ["model.safetensors"]
    import_safetensors(tmp_path / "hf", tmp_path / "back")
    assert lc.load(tmp_path / "back")["w"].tolist() == [2.0] * 4


def test_a_failed_export_leaves_the_earlier_one_and_nothing_of_its_own(tmp_path):
    lc.save(tmp_path / "old", _layers(1.0), lc.Layout.replicated())
    export_safetensors(tmp_path / "old", tmp_path / "hf", max_shard_bytes=400)
    before = {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()}
    lc.save(tmp_path / "new", _layers(2.0), lc.Layout.replicated())
    shard = tmp_path / "new" / "layers" / "2" / "weight" / "c.0.0"
    raw = bytearray(shard.read_bytes())
    raw[0] ^= 0xFF  # the last file's array fails its checksum after two files are written
    shard.write_bytes(bytes(raw))
    with pytest.raises(lc.IntegrityError, match=r"layers\.2\.weight"):
        export_safetensors(tmp_path / "new", tmp_path / "hf", max_shard_bytes=400)
    assert {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()} == before
    with pytest.raises(lc.IntegrityError):
        export_safetensors(tmp_path / "new", tmp_path / "fresh", max_shard_bytes=400)
    assert not (tmp_path / "fresh").exists()


def test_export_large_array_in_many_blocks(tmp_path, monkeypatch):
    # Small blocks, so one array is written in many reads, including rows split into pieces.
    monkeypatch.setattr(_safetensors, "BLOCK_BYTES", 100)
    state = {"w": torch.randn(37, 29), "v": torch.randn(3, 5, 41).bfloat16(), "u": torch.arange(1000)}
    lc.save(tmp_path / "ck", state, lc.Layout.replicated(), inner_chunk_bytes=64)
    assert_state_equal(load_hf(export_safetensors(tmp_path / "ck", tmp_path / "hf")), state)


def test_export_select_and_rename(tmp_path):
    state = sample_state()
    lc.save(tmp_path / "ck", {**state, "step": 3}, lc.Layout.replicated())
    files = export_safetensors(tmp_path / "ck", tmp_path / "a", select=r"^model\.layers\.")
    assert sorted(load_hf(files)) == ["model.layers.0.attn.q_proj.weight", "model.layers.0.norm.weight"]
    files = export_safetensors(tmp_path / "ck", tmp_path / "b", select=["ids", "scale"])
    assert_state_equal(load_hf(files), {"ids": state["ids"], "scale": state["scale"]})
    strip = len("model.")
    files = export_safetensors(
        tmp_path / "ck", tmp_path / "c", select=lambda n: n.startswith("model."), rename=lambda n: n[strip:]
    )
    assert_bits_equal(load_hf(files)["embed.weight"], state["model.embed.weight"])
    with pytest.raises(KeyError, match="'step'"):  # a JSON leaf, not an array
        export_safetensors(tmp_path / "ck", tmp_path / "d", select=["ids", "step"])
    with pytest.raises(ValueError, match="nothing to export"):
        export_safetensors(tmp_path / "ck", tmp_path / "d", select="^nothing$")
    with pytest.raises(ValueError, match="the same name 'x'"):
        export_safetensors(tmp_path / "ck", tmp_path / "d", rename=lambda n: "x")
    assert not (tmp_path / "d").exists()  # refused before anything was written


def test_every_stored_dtype_has_a_safetensors_code():
    # The TypeError for an array safetensors cannot hold is then reached only by future dtypes.
    assert set(ZARR_TO_SAFETENSORS) == set(ZARR_TO_NUMPY)


@pytest.mark.parametrize(
    ("shape", "inner", "max_bytes"),
    [((7, 5), (2, 5), 40), ((3, 4, 5), (1, 2, 5), 24), ((2, 3, 50), (2, 3, 8), 64), ((9,), (4,), 4), ((), (), 4)],
)
def test_row_blocks_and_chunk_pieces_tile_the_array_in_order(shape, inner, max_bytes):
    a = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    out = []
    for block in row_blocks(shape, 4, inner, max_bytes):
        part = a[block]
        assert part.nbytes <= 2 * max_bytes or part.size == 1
        if shape:
            filled = np.full_like(part, -1)
            for source, target in chunk_pieces(block, shape, inner):
                filled[target] = a[source]
                first = [s.start if isinstance(s, slice) else s for s in source]
                last = [s.stop - 1 if isinstance(s, slice) else s for s in source]
                # Each piece lies in one inner chunk: one read decodes one chunk.
                assert [x // c for x, c in zip(first, inner)] == [x // c for x, c in zip(last, inner)]
            assert np.array_equal(filled, part)
        out.append(part.reshape(-1))
    assert np.array_equal(np.concatenate(out), a.reshape(-1))


# --- Import ---


def test_import_single_file_every_dtype(tmp_path):
    state = sample_state()
    safetensors.torch.save_file(state, tmp_path / "model.safetensors")
    import_safetensors(tmp_path / "model.safetensors", tmp_path / "ck", step=7, metadata={"source": "hf"})
    got = lc.load(tmp_path / "ck")
    assert isinstance(got, dict) and all(isinstance(v, torch.Tensor) for v in got.values())
    assert_state_equal(got, state)
    rd = lc.open(tmp_path / "ck")
    assert rd.step == 7 and rd.metadata == {"source": "hf"}
    assert all(rd.info(n).shard_shape == tuple(max(1, d) for d in state[n].shape) for n in state)
    # And back out: the same tensors again.
    assert_state_equal(load_hf(export_safetensors(tmp_path / "ck", tmp_path / "hf")), state)


def write_hf_sharded(folder: Path, state: dict[str, torch.Tensor], parts: int) -> None:
    """Shards and an index as transformers' save_pretrained writes them."""
    folder.mkdir()
    names = sorted(state)
    weight_map = {}
    for i in range(parts):
        file = f"model-{i + 1:05d}-of-{parts:05d}.safetensors"
        part = names[i::parts]
        safetensors.torch.save_file({n: state[n] for n in part}, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))


def test_import_sharded_with_index_follows_layout(tmp_path):
    state = sample_state()
    write_hf_sharded(tmp_path / "hf", state, 3)
    mesh = lc.Mesh({"dp": 2, "tp": 2})
    rules = [(r"q_proj\.weight$", lc.P("tp")), (r"embed", lc.P(None, ("dp", "tp"))), (".*", lc.P())]
    import_safetensors(tmp_path / "hf", tmp_path / "ck", lc.Layout(mesh, rules), inner_chunk_bytes=8)
    assert_state_equal(lc.load(tmp_path / "ck"), state)
    rd = lc.open(tmp_path / "ck")
    q = rd.info("model.layers.0.attn.q_proj.weight")
    assert (q.shard_shape, q.spec) == ((3, 4), lc.P("tp"))  # 6 rows cut 2 ways
    embed = rd.info("model.embed.weight")
    assert (embed.shard_shape, embed.spec) == ((7, 2), lc.P(None, ("dp", "tp")))  # 5 columns: 2, 2, 1, none
    assert math.prod(embed.inner_chunk_shape) * 4 <= 8
    assert (rd.info("ids").shard_shape, rd.info("ids").spec) == ((3, 4), lc.P())
    assert rd.meta.mesh == mesh and [p for p, _ in rd.meta.rules] == [p for p, _ in rules]
    # One shard file per non-empty piece, as a save under the layout writes them.
    assert sorted(p.name for p in (tmp_path / "ck/model/embed/weight").glob("c.*")) == ["c.0.0", "c.0.1", "c.0.2"]
    # Plain zarr-python decodes the shard files on its own.
    for name, want in state.items():
        z = zarr.open_array(tmp_path / "ck" / name.replace(".", "/"), mode="r")
        assert np.asarray(z[...]).tobytes() == raw(want), name


@pytest.mark.parametrize("compression", ["zstd", "blosc"])
def test_import_compressed(tmp_path, compression):
    state = {"w": torch.randn(9, 7), "b": torch.randn(5).bfloat16(), "m": torch.rand(11) > 0.5}
    safetensors.torch.save_file(state, tmp_path / "x.safetensors")
    import_safetensors([tmp_path / "x.safetensors"], tmp_path / "ck", compression=compression, inner_chunk_bytes=16)
    assert lc.open(tmp_path / "ck").info("w").compression == compression
    assert_state_equal(lc.load(tmp_path / "ck"), state)
    assert np.asarray(zarr.open_array(tmp_path / "ck/w", mode="r")[...]).tobytes() == raw(state["w"])


def test_import_refuses_an_existing_checkpoint(tmp_path):
    safetensors.torch.save_file({"a": torch.ones(2)}, tmp_path / "one.safetensors")
    safetensors.torch.save_file({"a": torch.zeros(2)}, tmp_path / "two.safetensors")
    import_safetensors(tmp_path / "one.safetensors", tmp_path / "ck")
    with pytest.raises(lc.CheckpointExistsError, match="overwrite=True"):
        import_safetensors(tmp_path / "two.safetensors", tmp_path / "ck")
    assert lc.load(tmp_path / "ck")["a"].tolist() == [1.0, 1.0]
    import_safetensors(tmp_path / "two.safetensors", tmp_path / "ck", overwrite=True)
    assert lc.load(tmp_path / "ck")["a"].tolist() == [0.0, 0.0]
    (tmp_path / "other").mkdir()
    with pytest.raises(lc.CheckpointExistsError, match="not a committed"):
        import_safetensors(tmp_path / "two.safetensors", tmp_path / "other", overwrite=True)


def test_import_failure_leaves_nothing(tmp_path):
    safetensors.torch.save_file({"a": torch.ones(2), "b": torch.ones(3)}, tmp_path / "x.safetensors")
    calls = []

    def failing(**_):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full")

    with _faults.hooks({"save.box_written": failing}), pytest.raises(OSError, match="disk full"):
        import_safetensors(tmp_path / "x.safetensors", tmp_path / "ck")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.safetensors"]  # no checkpoint, no temp folder


def test_import_names_must_be_valid(tmp_path):
    craft(tmp_path / "bad.safetensors", {"a..b": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, b"\0")
    with pytest.raises(lc.InvalidNameError, match=r"bad\.safetensors.*'a\.\.b'"):
        import_safetensors(tmp_path / "bad.safetensors", tmp_path / "ck")
    safetensors.torch.save_file({"a": torch.ones(1), "a.b": torch.ones(1)}, tmp_path / "clash.safetensors")
    with pytest.raises(lc.InvalidNameError, match="also the parent"):
        import_safetensors(tmp_path / "clash.safetensors", tmp_path / "ck")
    safetensors.torch.save_file({"a": torch.ones(1)}, tmp_path / "1.safetensors")
    with pytest.raises(lc.FormatError, match="'a' is in both"):
        import_safetensors([tmp_path / "1.safetensors", tmp_path / "1.safetensors"], tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


F32x2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize(
    ("header", "data", "match"),
    [
        ({"t": F32x2, "u": {"dtype": "C64", "shape": [1], "data_offsets": [8, 16]}}, bytes(16), "'u' has dtype 'C64'"),
        ({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8), "'t': a F32 tensor of shape"),
        ({"t": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, bytes(8), "'t': shape must be"),
        ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12), "'t' starts at byte 4"),
        ({"t": F32x2, "u": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12), "'u' starts at"),
        ({"t": F32x2}, bytes(12), "4 bytes follow the last tensor"),
        ({"t": F32x2}, bytes(5), "'t' ends at byte 8 .* the file is truncated"),
        ({"__metadata__": {"n": 1}, "t": F32x2}, bytes(8), "'__metadata__' must be an object of strings"),
        ({"t": [1, 2]}, bytes(8), "'t': its entry must be an object"),
    ],
)
def test_import_bad_header_raises_format_error(tmp_path, header, data, match):
    bad = craft(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(lc.FormatError, match=match) as err:
        import_safetensors(bad, tmp_path / "ck")
    assert str(bad) in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.safetensors"]


@pytest.mark.parametrize(
    ("text", "match"),
    [(b"[" * 100_000 + b"]" * 100_000, "RecursionError"), (b'{"n": ' + b"9" * 5000 + b"}", "ValueError")],
)
def test_import_header_too_deep_or_too_long_a_number(tmp_path, text, match):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(len(text).to_bytes(8, "little") + text)
    with pytest.raises(lc.FormatError, match=rf"bad\.safetensors: the header is not valid JSON \({match}"):
        import_safetensors(bad, tmp_path / "ck")


def test_import_refuses_a_shape_no_reader_opens(tmp_path):
    """0 bytes, but 2**62 columns: more inner chunks than a reader opens."""
    bad = craft(tmp_path / "bad.safetensors", {"t": {"dtype": "F32", "shape": [0, 2**62], "data_offsets": [0, 0]}}, b"")
    with pytest.raises(lc.LayoutError, match=r"'t'.*above the reader's limit"):
        import_safetensors(bad, tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


def test_import_corrupt_and_truncated_files(tmp_path):
    safetensors.torch.save_file({"w": torch.randn(64, 8), "v": torch.randn(5)}, tmp_path / "good.safetensors")
    good = (tmp_path / "good.safetensors").read_bytes()
    (tmp_path / "garbage.safetensors").write_bytes(good[:8] + b"#" * (len(good) - 8))
    (tmp_path / "cut.safetensors").write_bytes(good[:-100])
    (tmp_path / "tiny.safetensors").write_bytes(good[:5])
    (tmp_path / "huge.safetensors").write_bytes((2**40).to_bytes(8, "little") + good[8:])
    (tmp_path / "dup.safetensors").write_bytes(good[:8] + good[8:].replace(b'"v"', b'"w"', 1))
    cases = {
        "garbage": "not valid JSON",
        "cut": "'w' ends at byte 2068 .* the file holds only 1968 bytes .* truncated",
        "tiny": "header length \\(missing\\)",
        "huge": "header length 1099511627776 does not fit",
        "dup": "names 'w' twice",
    }
    for name, match in cases.items():
        with pytest.raises(lc.FormatError, match=match) as err:
            import_safetensors(tmp_path / f"{name}.safetensors", tmp_path / "ck")
        assert f"{name}.safetensors" in str(err.value)
    with pytest.raises(FileNotFoundError):
        import_safetensors(tmp_path / "missing.safetensors", tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


def test_import_index_must_match_its_files(tmp_path):
    write_hf_sharded(tmp_path / "hf", {"a": torch.ones(2), "b": torch.ones(3)}, 2)
    index = json.loads((tmp_path / "hf/model.safetensors.index.json").read_text())
    index["weight_map"]["a"] = "model-00002-of-00002.safetensors"
    (tmp_path / "hf/model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(lc.FormatError, match=r"puts tensor 'a' in model-00002-of-00002\.safetensors"):
        import_safetensors(tmp_path / "hf", tmp_path / "ck")
    index["weight_map"]["a"] = "../elsewhere.safetensors"
    (tmp_path / "hf/model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(lc.FormatError, match="expected a file name in the same folder"):
        import_safetensors(tmp_path / "hf/model.safetensors.index.json", tmp_path / "ck")


# --- Streaming: memory stays far below the size of the tensor ---

# The peak is this process's own high-water mark (VmHWM). ``ru_maxrss`` would not do: exec
# carries the parent's peak into it, so under pytest (far larger than the work measured) it
# would show no growth at all.
_MEASURE = textwrap.dedent(
    """
    import resource, sys
    from layoutckpt._safetensors import export_safetensors, import_safetensors

    def peak():
        try:
            with open("/proc/self/status") as f:
                return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:")) * 1024
        except OSError:
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    before = peak()
    verb, src, dst = sys.argv[1:]
    if verb == "import":
        import_safetensors(src, dst)
    else:
        export_safetensors(src, dst)
    print(before, peak() - before)
    """
)
ROWS, COLS = 6400, 8192  # 200 MiB of float32


def _peak_growth(*args: str) -> int:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", _MEASURE, *args], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    before, growth = map(int, done.stdout.split()[-2:])
    # Export and import need no torch (import layoutckpt leaves it unimported): the baseline
    # holds NumPy, TensorStore and zarr, already loaded.
    assert before > 40 * 2**20, "the baseline should include TensorStore and zarr, already loaded"
    return growth


def _stream_pattern(f, rows: int, cols: int) -> None:
    """Pseudo-random float32 bit patterns (NaNs included), written a few MiB at a time."""
    step = 256
    for r in range(0, rows, step):
        n = min(step, rows - r) * cols
        bits = (np.arange(r * cols, r * cols + n, dtype=np.uint64) * 2654435761 % 2**32).astype(np.uint32)
        f.write(bits.tobytes())


def test_streaming_memory_stays_bounded(tmp_path):
    size = ROWS * COLS * 4
    header = {"big": {"dtype": "F32", "shape": [ROWS, COLS], "data_offsets": [0, size]}}
    text = json.dumps(header).encode()
    src = tmp_path / "big.safetensors"
    with open(src, "wb") as f:  # written in pieces: this process never holds the tensor either
        f.write(len(text).to_bytes(8, "little") + text)
        _stream_pattern(f, ROWS, COLS)

    grew_import = _peak_growth("import", str(src), str(tmp_path / "ck"))
    grew_export = _peak_growth("export", str(tmp_path / "ck"), str(tmp_path / "hf"))
    print(f"peak RSS growth: import {grew_import / 2**20:.0f} MiB, export {grew_export / 2**20:.0f} MiB")
    assert grew_import < 100 * 2**20, grew_import
    assert grew_export < 100 * 2**20, grew_export

    # The data made the trip intact: the exported bytes equal the source's, piece by piece.
    out = tmp_path / "hf/model.safetensors"
    start_src = 8 + len(text)
    start_out, out_header = file_header(out)
    assert out_header["big"] == header["big"]
    with open(src, "rb") as a, open(out, "rb") as b:
        a.seek(start_src)
        b.seek(start_out)
        while chunk := a.read(16 << 20):
            assert chunk == b.read(len(chunk))
        assert b.read() == b""
    assert lc.open(tmp_path / "ck").info("big").shard_shape == (ROWS, COLS)
    for big in (src, tmp_path / "ck", tmp_path / "hf"):  # 600 MiB that pytest would keep around
        shutil.rmtree(big) if big.is_dir() else big.unlink()
