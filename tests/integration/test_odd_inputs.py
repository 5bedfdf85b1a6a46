"""Odd inputs end as a correct result or a typed error before anything is written: big-endian
NumPy arrays are stored as their values (item 1 of issue 29), over-long names and tensors that
cannot be stored are refused up front (item 11)."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch

import layoutckpt as lc
from layoutckpt._verify import verify


@pytest.mark.parametrize("dtype", [">f4", ">i8", ">u2", ">f8", ">f2", "<f4"])
def test_big_endian_numpy_arrays_keep_their_values(tmp_path, dtype):
    x = (np.arange(12) * 3 - 7).astype(np.dtype(dtype).newbyteorder("=")).reshape(3, 4).astype(dtype)
    lc.save(tmp_path / "c", {"x": x, "s": x[1, 2]}, lc.Layout.replicated())
    got = lc.load(tmp_path / "c")
    assert got["x"].dtype == np.dtype(dtype).newbyteorder("=") and np.array_equal(got["x"], x)
    assert got["s"] == x[1, 2]


def test_big_endian_numpy_arrays_keep_their_values_when_saved_asynchronously(tmp_path):
    x = np.arange(5, dtype=">f4")
    lc.save_async(tmp_path / "c", {"x": x}, lc.Layout.replicated()).result()
    assert lc.load(tmp_path / "c")["x"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_big_endian_rank_state_keeps_its_values(tmp_path):
    lc.save(tmp_path / "c", {"x": np.zeros(1)}, lc.Layout.replicated(), rank_state={"a": np.arange(3, dtype=">i4")})
    assert lc.open(tmp_path / "c").rank_states()[0]["a"].tolist() == [0, 1, 2]


@pytest.mark.parametrize(
    ("key", "match"),
    [("k" * 256, "part of 256 bytes"), ("é" * 128, "part of 256 bytes"), (".".join(["p" * 200] * 11), "2210 bytes")],
)
def test_overlong_names_are_refused_before_writing(tmp_path, key, match):
    with pytest.raises(lc.InvalidNameError, match=match):
        lc.save(tmp_path / "c", {key: np.zeros(2)}, lc.Layout.replicated())
    assert not (tmp_path / "c").exists() and not list(tmp_path.iterdir())


def test_a_name_at_the_limits_is_saved(tmp_path):
    key = ".".join(["p" * 255] * 8)  # 8 * 255 + 7 = 2047 bytes
    lc.save(tmp_path / "c", {key: np.arange(3)}, lc.Layout.replicated())
    assert lc.load(tmp_path / "c")[key].tolist() == [0, 1, 2]


def _csr(t: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():  # torch calls its CSR support beta
        warnings.simplefilter("ignore", UserWarning)
        return t.to_sparse_csr()


@pytest.mark.parametrize(
    ("tensor", "match"),
    [
        (lambda: torch.eye(3).to_sparse(), "sparse_coo tensor"),
        (lambda: _csr(torch.eye(3)), "sparse_csr tensor"),
        (lambda: torch.empty(3, 3, device="meta"), "meta device"),
    ],
)
def test_tensors_without_dense_data_are_refused_with_a_typed_error(tmp_path, tensor, match):
    with pytest.raises(TypeError, match=match) as info:
        lc.save(tmp_path / "c", {"model": {"w": tensor()}}, lc.Layout.replicated())
    assert "'model.w'" in str(info.value)
    assert not (tmp_path / "c").exists()


def test_a_path_through_dot_dot_and_a_link_names_what_the_kernel_resolves(tmp_path):
    (tmp_path / "real" / "inner").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real" / "inner")
    lc.save(tmp_path / "link" / ".." / "ck", {"a": np.arange(3)})
    assert (tmp_path / "real" / "ck").is_dir()  # link/.. is real/, as open() would have it
    assert np.array_equal(lc.open(os.fspath(tmp_path / "link") + "/../ck").read("a"), np.arange(3))


def test_a_save_or_export_inside_a_checkpoint_is_refused_and_leaves_it_unchanged(tmp_path):
    outer = tmp_path / "outer"
    lc.save(outer, {"a": np.arange(3)})
    (tmp_path / "link").symlink_to(outer)
    before = sorted(p.relative_to(outer) for p in outer.rglob("*"))
    for inside in (outer / "sub", tmp_path / "link" / "x" / "inner"):
        with pytest.raises(lc.CheckpointExistsError, match="lies inside the checkpoint"):
            lc.save(inside, {"b": np.arange(2)})
    with pytest.raises(lc.CheckpointExistsError, match="lies inside the checkpoint"):
        lc.export_safetensors(outer, outer)
    assert sorted(p.relative_to(outer) for p in outer.rglob("*")) == before
    assert verify(lc.open(outer)).ok


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"step": "100"}, TypeError, "step= takes an int"),
        ({"step": np.int64(3)}, TypeError, "pass int"),
        ({"step": True}, TypeError, "step= takes an int"),
        ({"step": -1}, ValueError, "from 0 to 2"),
        ({"inner_chunk_bytes": 0}, ValueError, "inner_chunk_bytes= must be a positive int"),
        ({"inner_chunk_bytes": "2MB"}, ValueError, "inner_chunk_bytes= must be a positive int"),
        ({"inner_chunk_bytes": 1}, lc.LayoutError, "inner chunks per shard.*pass a larger inner_chunk_bytes"),
    ],
)
def test_save_options_no_reader_opens_are_refused_before_anything_is_written(tmp_path, options, error, match):
    good = tmp_path / "ck"
    lc.save(good, {"w": np.arange(3)})
    with pytest.raises(error, match=match):
        lc.save(good, {"w": np.zeros((4 << 20) + 16, np.uint8)}, overwrite=True, **options)
    assert lc.load(good)["w"].tolist() == [0, 1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def _nested(levels: int) -> dict:
    state: dict = {"w": np.arange(2)}
    for _ in range(levels):
        state = {"x": state}
    return state


def test_a_state_nested_deeper_than_a_reader_opens_is_refused(tmp_path):
    lc.save(tmp_path / "deepest", _nested(255))  # its leaf is at depth 256, the limit
    assert lc.open(tmp_path / "deepest").keys() == ["x." * 255 + "w"]
    for levels in (256, 600):
        with pytest.raises(ValueError, match="nests deeper than 256 levels"):
            lc.save(tmp_path / f"deep{levels}", _nested(levels))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["deepest"]


def test_a_name_with_a_lone_surrogate_is_refused_before_writing(tmp_path):
    with pytest.raises(lc.InvalidNameError, match="not valid Unicode"):
        lc.save(tmp_path / "ck", {"w\udcff": np.arange(2)})
    assert list(tmp_path.iterdir()) == []


def test_a_file_kvstore_spec_names_the_directory_its_path_names(tmp_path, monkeypatch):
    spec = {"driver": "file", "path": os.fspath(tmp_path / "ck")}
    monkeypatch.chdir(tmp_path.parent)
    lc.save(spec, {"w": np.arange(3)})
    assert (tmp_path / "ck" / "zarr.json").is_file()
    monkeypatch.chdir("/")
    assert lc.load(spec)["w"].tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="takes a non-empty 'path' and nothing else"):
        lc.load({**spec, "file_io_sync": False})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_lazily_negated_tensor_saves_its_values(tmp_path, dtype):
    negated = torch._neg_view(torch.arange(4, dtype=dtype))
    assert negated.is_neg()
    lc.save(tmp_path / "ck", {"w": negated})
    assert torch.equal(lc.load(tmp_path / "ck")["w"], -torch.arange(4, dtype=dtype))


def test_malformed_arguments_get_typed_errors_that_name_them(tmp_path):
    lc.save(tmp_path / "ck", {"model": {"layers": {"0": {"weight": np.ones(2)}}}, "lr": 0.5})
    with pytest.raises(ValueError, match=r"select='\(' is not a valid regular expression"):
        lc.load(tmp_path / "ck", select="(")
    with pytest.raises(TypeError, match="select= takes a regex"):
        lc.load(tmp_path / "ck", select=3)
    for make in (lambda: lc.Mesh(None), lambda: lc.Layout(lc.Mesh({"pp": 2}), None)):
        with pytest.raises(lc.LayoutError, match=r"Mesh takes a mapping|Layout rules must be a list"):
            make()
    with pytest.raises(lc.LayoutError, match="stages must be a mesh axis name"):
        lc.Layout(lc.Mesh({"pp": 2}), [(".*", lc.P())], stages=3)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"takes a torch.nn.Module as model, got a torch SGD"):
        lc.get_state(opt)
    with pytest.raises(TypeError, match="takes the checkpoint's path first; got a torch Linear as path"):
        lc.load_state(model, tmp_path / "ck", opt)
    with lc.open(tmp_path / "ck") as rd:
        with pytest.raises(KeyError, match=r"similar names: \['model.layers.0.weight'\]"):
            rd.read("model.layers.0.wieght")
        with pytest.raises(KeyError, match="it is a JSON value, which read"):
            rd.info("lr")
        with pytest.raises(lc.TemplateMismatchError, match="without an index"):
            rd.read("lr", np.s_[0])


def test_a_missing_checkpoint_is_not_pointed_at_a_staging_directory(tmp_path):
    (tmp_path / "run" / ".ck.tmp-0123456789ab" / "w").mkdir(parents=True)
    (tmp_path / "run" / ".ck.tmp-0123456789ab" / "zarr.json").write_text(
        '{"node_type": "group", "attributes": {"layoutckpt": {}}}'
    )
    with pytest.raises(lc.CheckpointNotFoundError) as err:
        lc.open(tmp_path / "run")
    assert "tmp-" not in str(err.value), err.value


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"compression": "gzip"}, "compression= must be one of"),
        ({"packing": "zip"}, "packing= must be 'auto'"),
        ({"overwrite": "no"}, "overwrite= takes True or False, got str"),
    ],
)
def test_storage_options_are_checked_before_anything_is_written(tmp_path, options, match):
    with pytest.raises((ValueError, TypeError), match=match):
        lc.save(tmp_path / "ck", {"w": np.ones(2)}, **options)
    assert list(tmp_path.iterdir()) == []


def test_a_load_flag_given_a_string_is_refused(tmp_path):
    lc.save(tmp_path / "ck", {"w": np.ones(2)})
    with pytest.raises(TypeError, match="strict= takes True or False"):
        lc.load(tmp_path / "ck", strict="no")  # "no" is true: it would mean the opposite
