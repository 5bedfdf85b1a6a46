"""Shards bound to their place (format version 6, ``docs/format.md`` 5.4 and 8).

Every shard a save writes carries a binding block naming the save (``save_id`` of the root
document), the array's path and the shard's cell; readers check it, so a valid shard moved to
another cell or array, or copied from another checkpoint of the same geometry, is an
``IntegrityError`` naming the array, on every read path: layoutckpt's own shard reader (local
files), TensorStore (``memory://``, object stores), packed checkpoints (OCDBT), ``verify``, and
an ``export_zarr`` copy. Plain zarr-python and TensorStore read bound checkpoints as before, and
checkpoints without a ``save_id`` (versions up to 5) read as before.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import struct
from pathlib import Path

import attrs
import numpy as np
import pytest
import tensorstore as ts
import zarr

import layoutckpt as lc
from layoutckpt import _unpack
from layoutckpt._verify import verify
from layoutckpt.format._format import ArrayMeta, CheckpointMeta, parse_root_document, root_document
from layoutckpt.format._shard import BINDING_BYTES, BINDING_MAGIC, binding, index_bytes
from layoutckpt.storage import _shardfile, _shardread
from layoutckpt.storage._location import locate
from layoutckpt.storage._packs import database
from tests.support.paths import GOLDEN

MISPLACED = "belongs to another place"
ROWS = 64


def state(base: float = 0.0) -> dict:
    """Two arrays of one geometry (so a shard of one fits the other) and two scalars."""
    a = np.arange(ROWS * 8, dtype=np.float32).reshape(ROWS, 8) + base
    return {"a": a, "b": a * -1, "s": np.float32(base + 1), "t": np.float32(base + 2)}


def save(path: str | Path, base: float = 0.0, **options) -> str:
    """``state`` saved by one process: one shard per array, several inner chunks each."""
    lc.save(path, state(base), lc.Layout.replicated(), inner_chunk_bytes=8 * 8 * 4, **options)
    return str(path)


def imported(path: Path, base: float = 0.0) -> str:
    """``state`` imported from a safetensors file with a layout of four ranks: ``a`` and ``b``
    stored as four row shards each (``c.0.0`` to ``c.3.0``), bound as a save's are."""
    tensors, offset, blobs = {}, 0, []
    for name, value in state(base).items():
        data = np.array(value, dtype=np.float32)  # 0-d stays 0-d
        tensors[name] = {"dtype": "F32", "shape": list(data.shape), "data_offsets": [offset, offset + data.nbytes]}
        offset += data.nbytes
        blobs.append(data.tobytes())
    header = json.dumps(tensors).encode()
    source = path.parent / f"{path.name}.safetensors"
    source.write_bytes(struct.pack("<Q", len(header)) + header + b"".join(blobs))
    layout = lc.Layout(lc.Mesh({"tp": 4}), [(r"^(a|b)$", lc.P("tp", None)), (r".*", lc.P())])
    lc.import_safetensors(source, path, layout, inner_chunk_bytes=8 * 8 * 4)
    return str(path)


def in_memory(tmp: Path, name: str, base: float = 0.0) -> str:
    """``imported``'s checkpoint, every object copied to ``memory://``: read through TensorStore."""
    local = Path(imported(tmp / f"{name}-local", base))
    url = f"memory://binding/{tmp.name}/{name}"
    kv = locate(url)._kv
    for file in sorted(local.rglob("*"), key=lambda f: f.name == "zarr.json" and f.parent == local):
        if file.is_file():
            kv.write(str(file.relative_to(local)), file.read_bytes()).result()
    return url


def swap(read, write, x: str, y: str) -> None:
    first, second = read(x), read(y)
    write(x, second)
    write(y, first)


def _files(path: Path):
    return (lambda key: (path / key).read_bytes()), (lambda key, value: (path / key).write_bytes(value))


def _memory(url: str):
    kv = locate(url)._kv
    return (lambda key: bytes(kv.read(key).result().value)), (lambda key, value: kv.write(key, value).result())


def _packed(path: Path):
    kv = ts.KvStore.open(database(locate(str(path)))).result()
    return (lambda key: bytes(kv.read(key).result().value)), (lambda key, value: kv.write(key, value).result())


def _place(tmp: Path, where: str, name: str = "ckpt", base: float = 0.0) -> tuple[str, tuple]:
    """A checkpoint of four-shard arrays read by layoutckpt's shard reader (``files``) or through
    TensorStore (``memory``), or a packed one of one-shard arrays (``packed``, read through
    TensorStore's OCDBT driver), and how to read and write its objects."""
    if where == "packed":
        url = save(tmp / name, base, packing="ocdbt")
        return url, _packed(Path(url))
    if where == "memory":
        url = in_memory(tmp, name, base)
        return url, _memory(url)
    url = imported(tmp / name, base)
    return url, _files(Path(url))


# ------------------------------------------------------------------------------ what is written


def test_a_save_binds_every_shard_to_its_own_id(tmp_path):
    first, second = save(tmp_path / "one"), save(tmp_path / "two")  # the second reuses the plan
    ids = []
    for path in (first, second):
        meta = lc.open(path).meta
        assert re.fullmatch("[0-9a-f]{24}", meta.save_id or "")
        assert {a.bound_to for a in meta.arrays.values()} == {meta.save_id}
        ids.append(meta.save_id)
        for name in ("a", "s"):
            a = meta.arrays[name]
            raw = (Path(path) / a.path / a.chunk_key((0,) * len(a.shape))).read_bytes()
            at = len(raw) - index_bytes(a.shard_shape, a.inner_chunk_shape) - BINDING_BYTES
            # Computed here from the spec, not by the library.
            cell = ".".join("0" * len(a.shape))
            digest = hashlib.blake2b(f"{meta.save_id}\0{a.path}\0{cell}".encode(), digest_size=24).digest()
            assert raw[at : at + BINDING_BYTES] == b"LCBIND1\0" + digest
    assert ids[0] != ids[1]


def test_bound_checkpoints_read_in_plain_zarr_and_tensorstore(tmp_path):
    path = Path(imported(tmp_path / "ckpt"))
    want = state()
    for name in ("a", "b", "s"):
        assert zarr.open_array(path / name, mode="r")[...].tobytes() == np.asarray(want[name]).tobytes(), name
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path / name)}}
        assert ts.open(spec, read=True).result().read().result().tobytes() == np.asarray(want[name]).tobytes()
    assert zarr.open_array(path / "a", mode="r")[5:9, 2].tolist() == want["a"][5:9, 2].tolist()


def test_a_bound_packed_checkpoint_reads_in_plain_tensorstore(tmp_path):
    path = Path(save(tmp_path / "ckpt", packing="ocdbt"))
    base = {"driver": "ocdbt", "base": {"driver": "file", "path": str(path) + "/"}}
    for name in ("a", "s"):
        spec = {"driver": "zarr3", "kvstore": {**base, "path": f"{name}/"}}
        assert ts.open(spec, read=True).result().read().result().tobytes() == np.asarray(state()[name]).tobytes()


# ---------------------------------------------------------------------- what readers refuse


def _refused(url: str, name: str) -> None:
    with pytest.raises(lc.IntegrityError, match=rf"array '{name}'.*{MISPLACED}"):
        lc.load(url)
    with lc.open(url) as rd:
        found = verify(rd)
    assert found.damaged_arrays == [name] and all(MISPLACED in p.text for p in found.problems), found.problems


@pytest.mark.parametrize("where", ["files", "memory"])
def test_shards_swapped_between_cells_are_refused(tmp_path, where):
    url, kv = _place(tmp_path, where)
    assert lc.open(url).meta.arrays["a"].shard_shape == (ROWS // 4, 8)
    swap(*kv, "a/c.0.0", "a/c.2.0")
    _refused(url, "a")


@pytest.mark.parametrize("where", ["files", "memory", "packed"])
def test_a_shard_moved_to_another_array_is_refused(tmp_path, where):
    url, (read, write) = _place(tmp_path, where)
    write("b/c.0.0", read("a/c.0.0"))
    _refused(url, "b")


@pytest.mark.parametrize("where", ["files", "memory", "packed"])
def test_a_scalar_copied_from_another_scalar_is_refused(tmp_path, where):
    url, (read, write) = _place(tmp_path, where)
    write("t/c", read("s/c"))
    _refused(url, "t")


@pytest.mark.parametrize("where", ["files", "memory"])
def test_a_shard_of_another_checkpoint_of_the_same_geometry_is_refused(tmp_path, where):
    url, (_, write) = _place(tmp_path, where)
    _, (read, _) = _place(tmp_path, where, "other", 5.0)
    write("a/c.1.0", read("a/c.1.0"))
    _refused(url, "a")
    assert lc.load(url, select=["b", "s", "t"])["s"] == np.float32(1)  # the other arrays read


@pytest.mark.parametrize("where", ["files", "memory"])
def test_a_shard_too_short_for_its_block_is_refused(tmp_path, where):
    url, (read, write) = _place(tmp_path, where)
    a = lc.open(url).meta.arrays["s"]
    raw, table = read("s/c"), index_bytes(a.shard_shape, a.inner_chunk_shape)
    write("s/c", raw[:8] + raw[-table:])  # its one chunk (4 bytes and crc32c) and index, valid
    with pytest.raises(lc.IntegrityError, match=rf"array 's'.*{MISPLACED}.*too short to hold its binding block"):
        lc.load(url)


@pytest.mark.parametrize("where", ["files", "memory", "packed"])
def test_a_shard_cut_short_is_damaged_not_misplaced(tmp_path, where):
    """A shard that lost its last bytes (an interrupted copy) ends in no binding block, but it
    was not moved: its index, read from the wrong place, fails its checksum, and the error says so."""
    url, (read, write) = _place(tmp_path, where)
    key = "a/c.0.0" if where == "packed" else "a/c.1.0"
    write(key, read(key)[:-3])
    with pytest.raises(lc.IntegrityError, match=r"array 'a'.*(cut short|crc32c)") as raised:
        lc.load(url)
    assert MISPLACED not in str(raised.value)


def test_an_export_keeps_the_binding(tmp_path):
    packed = save(tmp_path / "packed", packing="ocdbt")
    plain = tmp_path / "plain"
    _unpack.export_zarr(packed, plain)
    assert lc.open(plain).meta.save_id == lc.open(packed).meta.save_id
    assert lc.load(plain)["a"].tobytes() == state()["a"].tobytes()
    swap(*_files(plain), "a/c.0.0", "b/c.0.0")
    with pytest.raises(lc.IntegrityError, match=MISPLACED):
        lc.load(plain)


def test_imports_bind_their_shards(tmp_path):
    meta = lc.open(imported(tmp_path / "ckpt")).meta
    assert re.fullmatch("[0-9a-f]{32}", meta.save_id or "")
    assert {a.bound_to for a in meta.arrays.values()} == {meta.save_id}
    assert lc.load(str(tmp_path / "ckpt"))["a"].numpy().tobytes() == state()["a"].tobytes()


# ------------------------------------------------------------------------- unbound checkpoints


def test_older_goldens_read_unbound_and_a_swap_there_goes_unseen(tmp_path):
    """Versions up to 5 bind nothing: read as before (the limit docs/format.md section 8 names)."""
    path = tmp_path / "v5"
    shutil.copytree(GOLDEN / "v5" / "basic", path)
    meta = lc.open(path).meta
    assert meta.save_id is None and all(a.bound_to is None for a in meta.arrays.values())
    swap(*_files(path), "model/layers/0/proj/weight/c.0.0", "model/layers/0/proj/weight/c.0.1")
    lc.load(path)  # silently wrong: nothing to check it by


def test_an_unbound_shard_reads_without_a_block(tmp_path):
    meta = ArrayMeta("w", (8, 4), "float32", (8, 4), (2, 4), lc.P())
    data = np.arange(32, dtype=np.float32).reshape(8, 4)
    _shardfile.write_shard(tmp_path, meta, (0, 0), data.dtype, data)
    raw = (tmp_path / "w/c.0.0").read_bytes()
    assert len(raw) == 4 * (2 * 4 * 4 + 4) + index_bytes((8, 4), (2, 4)) and BINDING_MAGIC not in raw
    out = np.empty_like(data)
    _shardread.read_box(tmp_path, meta, ((0, 8), (0, 4)), out)
    assert np.array_equal(out, data)
    # Read as bound, it is refused: it holds no block.
    with pytest.raises(_shardread.Damaged, match="holds no binding block"):
        _shardread.read_box(tmp_path, attrs.evolve(meta, bound_to="ab" * 8), ((0, 8), (0, 4)), out)


# ------------------------------------------------------------------------------- the metadata


def _root(path: Path) -> dict:
    return json.loads((path / "zarr.json").read_bytes())["attributes"]["layoutckpt"]


@pytest.mark.parametrize(
    ("version", "save_id"),
    [(6, "XYZ" * 4), (6, "ab" * 5), (6, "ab" * 17), (6, 1234567890123), (5, "ab" * 8)],
    ids=["not-hex", "short", "long", "number", "version-5"],
)
def test_a_bad_save_id_is_a_format_error(tmp_path, version, save_id):
    meta = lc.open(save(tmp_path / "ckpt")).meta
    doc = json.loads(root_document(attrs.evolve(meta, format_version=version, save_id=None)))
    body = doc["attributes"]["layoutckpt"]
    body["save_id"] = save_id
    body["sha256"] = hashlib.sha256(
        json.dumps({k: v for k, v in body.items() if k != "sha256"}, separators=(",", ":")).encode()
    ).hexdigest()
    with pytest.raises(lc.FormatError, match="save_id"):
        parse_root_document(json.dumps(doc).encode(), "ckpt")


def test_the_binding_is_left_out_of_array_equality_and_hashing():
    a = ArrayMeta("w", (8,), "float32", (8,), (8,), lc.P())
    b = attrs.evolve(a, bound_to="0" * 24)
    assert a == b and hash(a) == hash(b) and b.bound_to == "0" * 24


def test_bound_sets_every_array_and_refuses_a_bad_id():
    a = ArrayMeta("w", (8,), "float32", (8,), (8,), lc.P())
    meta = CheckpointMeta({"w": a}, {"dict": [["w", {"array": "w"}]]}, lc.Mesh({}), ())
    bound = meta.bound("0123456789abcdef")
    assert bound.save_id == "0123456789abcdef" and bound.arrays["w"].bound_to == "0123456789abcdef"
    assert parse_root_document(root_document(bound), "x").arrays["w"].bound_to == "0123456789abcdef"
    with pytest.raises(ValueError, match="save id"):
        meta.bound("not hex")
    assert binding("0123456789abcdef", "w", (0,)) != binding("0123456789abcdef", "w", (1,))


def test_a_reader_of_a_checkpoint_replaced_since_it_opened_says_so(tmp_path):
    path = tmp_path / "ck"
    lc.save(path, {"w": np.ones(4)})
    with lc.open(path) as rd:
        lc.save(path, {"w": np.full(4, 2.0)}, overwrite=True)
        with pytest.raises(lc.IntegrityError, match="replaced or deleted while it was read"):
            rd.read("w")
    assert lc.open(path).read("w").tolist() == [2.0] * 4


def test_a_load_of_a_checkpoint_replaced_after_its_plan_says_so(tmp_path, monkeypatch):
    # An overwrite (or a manager's retention) between a load's plan and its reads: the shards are
    # another save's, which the binding blocks tell, but the checkpoint is not damaged.
    from layoutckpt import _load

    path = tmp_path / "ck"
    lc.save(path, {"w": np.ones(4)})
    planned = _load._plan_on_every_rank

    def plan_then_overwrite(*args, **kwargs):
        out = planned(*args, **kwargs)
        lc.save(path, {"w": np.full(4, 2.0)}, overwrite=True)
        return out

    monkeypatch.setattr(_load, "_plan_on_every_rank", plan_then_overwrite)
    with pytest.raises(lc.IntegrityError, match="replaced or deleted while it was read"):
        lc.load(path)
    monkeypatch.undo()
    assert lc.load(path)["w"].tolist() == [2.0] * 4
