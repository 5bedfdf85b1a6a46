"""Reading OCDBT databases without TensorStore (``format/_ocdbt``, ``storage/_packindex``): every
key TensorStore wrote is found where TensorStore reads it, across interior nodes, inline and
out-of-line values and databases merged from others, and damage is named, never misread."""

from __future__ import annotations

import concurrent.futures
import os
import random
import time

import numpy as np
import pytest
import tensorstore as ts

import layoutckpt as lc
from layoutckpt.format import _ocdbt
from layoutckpt.format._format import ArrayMeta
from layoutckpt.storage import _packindex, _packs, _shardread
from layoutckpt.storage._location import locate


def _db(path, **config):
    spec = {"driver": "ocdbt", "base": f"file://{path}/"}
    return ts.KvStore.open({**spec, "config": config} if config else spec).result()


def _fill(kv, items, per_txn=300):
    items = list(items)
    for i in range(0, len(items), per_txn):
        txn = ts.Transaction(atomic=True)
        for key, value in items[i : i + per_txn]:
            kv.with_transaction(txn).write(key, value).result()
        txn.commit_async().result()


def _value_at(root, found):
    if found is None:
        return None
    with open(root / found.path, "rb") as f:
        f.seek(found.offset)
        return f.read(found.length)


def _items(n, seed, prefix="", sizes=(0, 3, 40, 300, 5000)):
    rng = random.Random(seed)
    return {f"{prefix}a{rng.randrange(10**6):06d}/c/{i}": os.urandom(rng.choice(sizes)) for i in range(n)}


def _check_all(root, items, index):
    for key, value in items.items():
        try:
            got = _value_at(root, index.locate(key))
        except _packindex.Inline:
            got = _db(root).read(key).result().value  # inline: only TensorStore's reader reads it
            assert len(got) <= 100
        assert got == value, key


def test_small_nodes_make_interior_levels_and_every_key_is_found(tmp_path):
    """Nodes of at most 1 KiB: a tree several levels deep, keys prefix-compressed at each."""
    items = _items(3000, seed=1)
    _fill(_db(tmp_path, max_decoded_node_bytes=1024, max_inline_value_bytes=16), sorted(items.items()))
    index = _packindex.PackIndex(tmp_path)
    assert index.tree().height >= 2
    _check_all(tmp_path, items, index)
    for absent in ["", "a", "zzz", "a000000/c/0x", next(iter(items)) + "0", next(iter(items))[:-1]]:
        if absent not in items:
            assert index.locate(absent) is None, absent


def test_a_merged_database_resolves_its_children_data_files(tmp_path):
    """The layout of a packed checkpoint: each rank's database under ``packs/r/``, their B-trees
    copied into the root's; their nodes and values stay in the ranks' data files, reached through
    the transitive paths of the data file tables."""
    everything = {}
    for r in range(3):
        items = _items(700, seed=10 + r, prefix=f"r{r}/", sizes=(3, 40, 300, 5000))  # an empty value is inline
        _fill(_db(tmp_path / _packs.rank_base(r), max_decoded_node_bytes=2048, max_inline_value_bytes=0), items.items())
        everything.update(items)
    _packs.merge(locate(str(tmp_path)), 3)
    index = _packindex.PackIndex(tmp_path)
    paths = set()
    for key, value in everything.items():
        found = index.locate(key)
        assert _value_at(tmp_path, found) == value
        paths.add(found.path.split("/d/")[0])
    assert paths == {f"packs/{r:05d}" for r in range(3)}


def test_a_database_emptied_again_has_no_keys(tmp_path):
    kv = _db(tmp_path, max_inline_value_bytes=0)
    kv.write("x", b"1").result()
    kv.delete_range(ts.KvStore.KeyRange()).result()
    index = _packindex.PackIndex(tmp_path)
    assert index.tree().node is None
    assert index.locate("x") is None


@pytest.mark.parametrize("where", ["manifest", "node"])
def test_a_flipped_byte_is_damage_never_a_wrong_answer(tmp_path, where):
    items = _items(200, seed=3)
    _fill(_db(tmp_path, max_inline_value_bytes=0), items.items())
    target = tmp_path / "manifest.ocdbt"
    at = 20
    if where == "node":
        ref = _packindex.PackIndex(tmp_path).tree().node
        target, at = tmp_path / ref.path, ref.offset + ref.length // 2
    raw = bytearray(target.read_bytes())
    raw[at] ^= 0x40
    target.write_bytes(bytes(raw))
    with pytest.raises(_shardread.Damaged, match=r"crc32c|damaged"):
        _packindex.PackIndex(tmp_path).locate(next(iter(items)))


def test_a_tree_naming_a_path_outside_the_checkpoint_is_refused(tmp_path):
    """A crafted data file table cannot make the reader open files beyond the checkpoint."""
    _fill(_db(tmp_path, max_inline_value_bytes=0), [("k", b"v" * 10)])
    index = _packindex.PackIndex(tmp_path)
    real = index.tree()
    index._tree = _ocdbt.Root(_ocdbt.Ref("../../etc/passwd", 0, 100), real.height)
    with pytest.raises(_shardread.Damaged, match="cannot be read"):
        index.locate("k")


def test_decoding_rejects_truncated_and_trailing_bytes(tmp_path):
    _fill(_db(tmp_path, max_inline_value_bytes=0), [("k", b"v")])
    raw = (tmp_path / "manifest.ocdbt").read_bytes()
    for bad in (raw[:10], raw[:-1], raw + b"\0"):
        with pytest.raises(_ocdbt.Malformed):
            _ocdbt.decode_manifest(bad)


def test_threads_that_look_up_keys_at_once_read_each_node_once(tmp_path, monkeypatch):
    """A load's reading threads all start with the root's lookups: one thread reads and decodes
    each node while the others wait for it, and a node that fails to decode fails them all."""
    items = _items(400, seed=4, sizes=(300,))
    _fill(_db(tmp_path, max_inline_value_bytes=0), items.items())
    decoded = []
    real = _ocdbt.decode_node

    def slow_decode(raw, transitive, height):
        decoded.append(height)
        time.sleep(0.05)  # a merged root's leaf takes this long: the other threads arrive meanwhile
        return real(raw, transitive, height)

    monkeypatch.setattr(_ocdbt, "decode_node", slow_decode)
    index = _packindex.PackIndex(tmp_path)
    keys = list(items)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        found = list(pool.map(index.locate, keys[:8]))
    assert [_value_at(tmp_path, f) for f in found] == [items[k] for k in keys[:8]]
    assert len(decoded) == index.tree().height + 1

    def broken(*_):
        time.sleep(0.05)
        raise _ocdbt.Malformed("it ends before its last field")

    monkeypatch.setattr(_ocdbt, "decode_node", broken)
    fresh = _packindex.PackIndex(tmp_path)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        failures = [pool.submit(fresh.locate, k) for k in keys[:4]]
        for failure in failures:
            with pytest.raises(_shardread.Damaged, match="B\\+tree node is damaged"):
                failure.result(timeout=10)


def test_a_column_of_varints_decodes_as_each_one_alone():
    """A node's columns are decoded with NumPy: the same values as one varint at a time, at
    every width up to 64 bits, and a column that ends early or holds an 11-byte varint is
    damage."""
    rng = random.Random(3)
    values = [0, 1, 127, 128, 2**63, 2**64 - 1] + [rng.randrange(2 ** rng.randrange(1, 65)) for _ in range(500)]
    raw = _ocdbt._column(values)
    assert _ocdbt._Cursor(raw).varints(len(values)) == values
    one_by_one = _ocdbt._Cursor(raw)
    assert [one_by_one.varint() for _ in values] == values
    with pytest.raises(_ocdbt.Malformed, match="ends before"):
        _ocdbt._Cursor(raw[:-1]).varints(len(values))
    with pytest.raises(_ocdbt.Malformed, match="longer than 64 bits"):
        _ocdbt._Cursor(b"\x80" * 10 + b"\x01" + raw).varints(len(values))


def test_a_packed_local_checkpoint_loads_through_the_own_reader(tmp_path, monkeypatch):
    """No array is opened through TensorStore: the shards are read as byte ranges of the data
    files, with the counts of bytes the plain files' reader keeps."""
    state = {f"w{i}": np.arange(i * 1000, (i + 1) * 1000, dtype=np.float32).reshape(10, 100) for i in range(20)}
    state["step"] = np.int64(7)
    lc.save(tmp_path / "ck", state, packing="ocdbt")
    from layoutckpt.storage import _store

    def refuse(*args, **kwargs):
        raise AssertionError("an array was opened through TensorStore")

    monkeypatch.setattr(_store, "open_array", refuse)
    before = _shardread.bytes_read()
    out = lc.load(tmp_path / "ck")
    assert all(np.asarray(out[k]).tobytes() == np.asarray(v).tobytes() for k, v in state.items())
    assert _shardread.bytes_read() - before >= sum(np.asarray(v).nbytes for v in state.values())


# --- encoding: layoutckpt's own writer of a rank's database ----------------------------------------


def _encoded_db(root, items, node_bytes, monkeypatch):
    """``items`` written as ``PackWriter`` writes a database: values spread over two data files,
    the B+tree after the values of the second, the manifest last."""
    monkeypatch.setattr(_ocdbt, "NODE_BYTES", node_bytes)
    paths, data = ["d/one", "d/two"], [bytearray(), bytearray()]
    entries = []
    for i, (key, value) in enumerate(items.items()):
        entries.append((key.encode(), _ocdbt.Placed(i % 2, len(data[i % 2]), len(value))))
        data[i % 2] += value
    tree = _ocdbt.encode_tree(paths, entries, 1, len(data[1]))
    data[1] += b"".join(tree.nodes)
    (root / "d").mkdir(parents=True)
    for path, raw in zip(paths, data):
        (root / path).write_bytes(raw)
    (root / "manifest.ocdbt").write_bytes(_ocdbt.encode_manifest(os.urandom(16), paths, tree, 1))
    return tree


@pytest.mark.parametrize(
    ("n", "node_bytes", "height"), [(1, 1 << 20, 0), (300, 1 << 20, 0), (3000, 1024, 2), (3000, 200, 4)]
)
def test_an_encoded_database_reads_in_tensorstore_and_the_own_reader(tmp_path, monkeypatch, n, node_bytes, height):
    """Every key of an encoded tree, one node or several levels, is read by TensorStore (and
    listed), by ``PackIndex``, and after TensorStore merges it into another database
    as a save's commit does."""
    items = _items(n, seed=n + node_bytes)
    db = tmp_path / _packs.rank_base(0)
    tree = _encoded_db(db, items, node_bytes, monkeypatch)
    assert tree.height == height and tree.keys == n
    assert tree.value_bytes == sum(len(v) for v in items.values())
    kv = _db(db)
    assert sorted(kv.list().result()) == sorted(k.encode() for k in items)
    assert all(kv.read(k).result().value == v for k, v in items.items())
    _check_all(db, items, _packindex.PackIndex(db))
    _packs.merge(locate(str(tmp_path)), 1)
    _check_all(tmp_path, items, _packindex.PackIndex(tmp_path))


def test_an_empty_encoded_database_has_no_keys(tmp_path, monkeypatch):
    _encoded_db(tmp_path / "db", {}, 1 << 20, monkeypatch)
    assert _db(tmp_path / "db").list().result() == []
    assert _packindex.PackIndex(tmp_path / "db").locate("a/c/0") is None


def _fsdp_pack(tmp_path, world=4, arrays=30, writer=lambda r: r):
    """A packed checkpoint's index as a save of ``arrays`` arrays split row-wise over ``world``
    ranks makes it (over ``dp`` of a ``(pp, dp)`` mesh, pp 2, in ``_mesh``): shard ``c.r.0`` of
    every array is in the database of rank ``writer(r)``; then the merge."""
    values = {}
    for w in range(2 * world):
        items = {f"a{j}/c.{r}.0": os.urandom(64 + j) for j in range(arrays) for r in range(world) if writer(r) == w}
        if items:
            _fill(_db(tmp_path / _packs.rank_base(w), max_inline_value_bytes=0), items.items())
            values.update(items)
    _packs.merge(locate(str(tmp_path)), 2 * world)
    metas = [ArrayMeta(f"a{j}", (2 * world, 3), "float32", (2, 3), (2, 3), lc.P("dp")) for j in range(arrays)]
    return values, metas


def _mesh(world=4):
    return lc.Mesh({"pp": 2, "dp": world})


def _lookups(tmp_path, rules, boxes, keys, mesh=None):
    """Each key's value through a ``Router`` (of a checkpoint saved on ``mesh``, ``_mesh()`` by
    default) that expected ``boxes``, and the B+tree nodes read per database meanwhile."""
    before = _packindex.nodes_read()
    router = _packindex.Router(tmp_path, _shardread.Files(tmp_path), rules, mesh or _mesh())
    router.expect(boxes)
    got = {key: _value_at(tmp_path, router.locate(key)) for key in keys}
    after = _packindex.nodes_read()
    return got, {base: n - before.get(base, 0) for base, n in after.items() if n != before.get(base, 0)}


def test_a_load_of_one_writers_shards_reads_its_database_not_the_merged_root(tmp_path):
    """Rank 2's rows of every array: found in rank 2's database, one node read, none of the
    merged root's. Rows of all four ranks of a ``dp`` mesh: through the merged root, as before."""
    values, metas = _fsdp_pack(tmp_path)
    rules = {m.path: (0, 1) for m in metas}
    keys = [f"{m.path}/c.2.0" for m in metas]
    got, nodes = _lookups(tmp_path, rules, [(m, ((4, 6), (0, 3))) for m in metas], keys)
    assert got == {k: values[k] for k in keys}
    assert nodes == {"packs/00002/": 1}
    keys = [f"{m.path}/c.{r}.0" for m in metas for r in range(4)]
    got, nodes = _lookups(tmp_path, rules, [(m, ((0, 8), (0, 3))) for m in metas], keys, lc.Mesh({"dp": 4}))
    assert got == {k: values[k] for k in keys}
    assert set(nodes) == {""}


def test_shards_without_a_rule_are_found_among_their_pieces_holders(tmp_path):
    """Data parallelism over ``pp``: piece r is held by ranks r and r + 4, and the save's
    balance wrote some pieces from the second. Without a rule, a load of piece 1 and 2 looks in
    the databases of their holders, never in the merged root."""
    values, metas = _fsdp_pack(tmp_path, writer=lambda r: r + 4 * (r % 2))
    keys = [f"{m.path}/c.{r}.0" for m in metas for r in (1, 2)]
    got, nodes = _lookups(tmp_path, {}, [(m, ((2, 6), (0, 3))) for m in metas], keys)
    assert got == {k: values[k] for k in keys}
    assert "" not in nodes and set(nodes) <= {f"{_packs.rank_base(r)}/" for r in (1, 2, 5, 6)}, nodes


@pytest.mark.parametrize("harm", ["wrong rule", "missing database", "damaged database"])
def test_a_shard_its_writers_database_does_not_give_is_found_in_the_merged_root(tmp_path, harm):
    """The merged root holds every key: a rule that names another rank, or a writer's database
    that is gone or does not decode, costs a lookup there, never a wrong or missing shard."""
    values, metas = _fsdp_pack(tmp_path)
    rules = {m.path: (1, 0) if harm == "wrong rule" else (0, 1) for m in metas}
    manifest = tmp_path / _packs.rank_base(2) / _packindex.MANIFEST
    if harm == "missing database":
        manifest.unlink()
    elif harm == "damaged database":
        raw = bytearray(manifest.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        manifest.write_bytes(bytes(raw))
    keys = [f"{m.path}/c.2.0" for m in metas]
    got, nodes = _lookups(tmp_path, rules, [(m, ((4, 6), (0, 3))) for m in metas], keys)
    assert got == {k: values[k] for k in keys}
    assert nodes.get("", 0) >= 1


def test_a_shard_is_its_piece_where_trailing_pieces_are_empty(tmp_path):
    """Five columns over four ``dp`` pieces of two: the last piece is empty, so the shard grid
    (2 x 3) is narrower than the pieces' (2 x 4). Shard ``c.1.0`` is piece 4, held by rank 4
    alone, not the fourth shard in the grid's order."""
    _fill(_db(tmp_path / _packs.rank_base(4), max_inline_value_bytes=0), [("a/c.1.0", b"piece 4")])
    for r in (0, 1, 2, 3, 5, 6, 7):
        _fill(_db(tmp_path / _packs.rank_base(r), max_inline_value_bytes=0), [(f"other/c.{r}", b"x")])
    _packs.merge(locate(str(tmp_path)), 8)
    meta = ArrayMeta("a", (4, 5), "float32", (2, 2), (2, 2), lc.P("pp", "dp"))
    got, nodes = _lookups(tmp_path, {}, [(meta, ((2, 4), (0, 2)))], ["a/c.1.0"])
    assert got == {"a/c.1.0": b"piece 4"}
    assert nodes == {"packs/00004/": 1}
