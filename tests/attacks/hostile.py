"""The corpus: each hostile checkpoint, how it is made, and what a reader must do with it.

Every entry builds its checkpoint under a fresh directory (or, to be read through TensorStore, a
fresh ``memory://`` prefix) from a valid one (``craft``), names the verb that meets it (``open``,
``load``, ``load_rank_state``, ``open_read`` for ``lc.open(p).read`` or ``verify``) and the typed
error that verb must raise, with a fragment of its message (for ``verify``: a fragment of a
reported problem).
``test_attacks.py`` runs each within a time limit and a bound on the memory it allocates.
Entries marked ``gap`` are known to be read silently today; they run as strict expected
failures, so the day a check catches them the suite says so.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import attrs

import layoutckpt as lc

from . import craft
from .craft import ABSENT, array_entry, edit_root

W = "model.w"


@attrs.frozen
class Attack:
    name: str
    make: Callable[[Path], Path | str]  # the checkpoint: a folder, or a memory:// URL
    verb: str  # "open", "load", "load_rank_state", "open_read" or "verify"
    error: type[BaseException] | None  # None for verify: it reports instead of raising
    match: str
    gap: str = ""  # why the attack is not caught yet, where it is not


CORPUS: list[Attack] = []


def attack(verb: str, error: type[BaseException] | None, match: str, gap: str = "") -> Callable:
    def register(make: Callable[[Path], Path | str]) -> Callable[[Path], Path | str]:
        CORPUS.append(Attack(make.__name__, make, verb, error, match, gap))
        return make

    return register


# ------------------------------------------------- the root document: checksum and invariants


@attack("open", lc.FormatError, "fails its checksum")
def root_step_edited(tmp: Path) -> Path:
    path = craft.plain(tmp / "ckpt")
    text = (path / "zarr.json").read_text()
    (path / "zarr.json").write_text(text.replace('"step":12', '"step":13'))
    return path


@attack("open", lc.FormatError, "fails its checksum")
def root_shape_shrunk(tmp: Path) -> Path:
    # [64,64] -> [64,24], with the shard and inner chunk shapes to match, so that every
    # invariant holds and only the checksum can tell.
    path = craft.plain(tmp / "ckpt")
    text = (path / "zarr.json").read_text()
    (path / "zarr.json").write_text(text.replace("[64,64]", "[64,24]").replace("[16,64]", "[16,24]"))
    return path


@attack("open", lc.FormatError, "fails its checksum")
def root_checksum_removed(tmp: Path) -> Path:
    path = craft.plain(tmp / "ckpt")
    edit_root(path, lambda body: body.pop("sha256"), reseal=False)
    return path


@attack("open", lc.FormatError, "shard_shape")
def root_shape_shrunk_resealed(tmp: Path) -> Path:
    path = craft.plain(tmp / "ckpt")
    edit_root(path, array_entry(W)(lambda a: a.update(shape=[64, 24])))
    return path


@attack("open", lc.FormatError, "shard_shape")
def root_shape_below_its_shard(tmp: Path) -> Path:
    path = craft.plain(tmp / "ckpt")
    edit_root(path, array_entry(W)(lambda a: a.update(shape=[60, 64])))
    return path


@attack("open", lc.FormatError, ">= 0")
def root_negative_dimension(tmp: Path) -> Path:
    path = craft.plain(tmp / "ckpt")
    edit_root(path, array_entry(W)(lambda a: a.update(shape=[-64, 64])))
    return path


@attack("open", lc.FormatError, ">= 1")
def root_shard_shape_zero(tmp: Path) -> Path:
    path = craft.plain(tmp / "ckpt")
    edit_root(path, array_entry(W)(lambda a: a.update(shard_shape=[0, 64])))
    return path


@attack("open", lc.FormatError, "does not divide")
def root_inner_chunks_do_not_divide(tmp: Path) -> Path:
    path = craft.plain(tmp / "ckpt")
    edit_root(path, array_entry(W)(lambda a: a.update(inner_chunk_shape=[10, 64])))
    return path


@attack("open", lc.FormatError, "bytes of the array")
def root_shape_of_petabytes(tmp: Path) -> Path:
    path = craft.plain(tmp / "ckpt")
    edit_root(path, array_entry(W)(lambda a: a.update(shape=[10**15, 64], shard_shape=[10**15, 64])))
    return path


@attack("open", lc.FormatError, "mesh of 300000000 ranks")
def root_mesh_of_300_million(tmp: Path) -> Path:
    path = craft.plain(tmp / "ckpt")
    edit_root(path, lambda body: body.update(mesh=[["dp", 300_000_000]]))
    return path


@attack("open", lc.FormatError, "shards, above")
def root_grid_of_8_million_shards(tmp: Path) -> Path:
    def edit(body: dict) -> None:
        body["mesh"] = [["dp", 1 << 23]]
        body["arrays"][W].update(shape=[1 << 23, 64], shard_shape=[1, 64], inner_chunk_shape=[1, 64], spec=["dp"])

    path = craft.plain(tmp / "ckpt")
    edit_root(path, edit)
    return path


@attack("open", lc.FormatError, "tree structure is malformed")
def root_malformed_tree_node(tmp: Path) -> Path:
    path = craft.plain(tmp / "ckpt")
    edit_root(path, lambda body: body["tree"]["dict"].append(["bad", {"value": 1, "list": []}]))
    return path


@attack("open", lc.FormatError, "deeper than")
def root_tree_300_deep(tmp: Path) -> Path:
    path = craft.plain(tmp / "ckpt")
    node: dict = {"value": 1}
    for _ in range(300):
        node = {"list": [node]}
    edit_root(path, lambda body: body["tree"]["dict"].append(["deep", node]))
    return path


@attack("open", lc.FormatError, "nested too deeply")
def root_json_nested_100000_deep(tmp: Path) -> Path:
    path = craft.plain(tmp / "ckpt")
    text = (path / "zarr.json").read_text()
    deep = "[" * 100_000 + "]" * 100_000
    (path / "zarr.json").write_text(text.replace('"user_metadata":{', f'"user_metadata":{{"deep":{deep},', 1))
    return path


@attack("open", lc.FormatError, "not valid JSON")
def root_nan_token(tmp: Path) -> Path:
    path = craft.plain(tmp / "ckpt")
    text = (path / "zarr.json").read_text()
    (path / "zarr.json").write_text(text.replace('"step":12', '"step":NaN'))
    return path


@attack("open", lc.FormatError, "is not 'model/w'")
def root_path_leaves_the_checkpoint(tmp: Path) -> Path:
    path = craft.plain(tmp / "ckpt")
    edit_root(path, array_entry(W)(lambda a: a.update(path="../../outside")))
    return path


# ------------------------------------------------------- links and special files (item 7)


@attack("open", lc.FormatError, "cannot be read safely")
def marker_linked_to_dev_zero(tmp: Path) -> Path:
    path = craft.plain(tmp / "ckpt")
    (path / "zarr.json").unlink()
    (path / "zarr.json").symlink_to("/dev/zero")
    return path


@attack("open", lc.FormatError, "cannot be read safely")
def marker_is_a_fifo(tmp: Path) -> Path:
    path = craft.plain(tmp / "ckpt")
    (path / "zarr.json").unlink()
    os.mkfifo(path / "zarr.json")
    return path


@attack("load", lc.IntegrityError, "not a regular file")
def shard_linked_to_another_checkpoint(tmp: Path) -> Path:
    other = craft.plain(tmp / "other")
    path = craft.plain(tmp / "ckpt")
    (path / "model/w/c.0.0").unlink()
    (path / "model/w/c.0.0").symlink_to(other / "model/w/c.0.0")
    return path


@attack("load", lc.IntegrityError, "not a regular file")
def shard_linked_to_etc_passwd(tmp: Path) -> Path:
    path = craft.plain(tmp / "ckpt")
    (path / "model/w/c.0.0").unlink()
    (path / "model/w/c.0.0").symlink_to("/etc/passwd")
    return path


@attack("load", lc.IntegrityError, "not a regular file")
def array_folder_linked_to_another_checkpoint(tmp: Path) -> Path:
    other = craft.plain(tmp / "other")
    path = craft.plain(tmp / "ckpt")
    shutil.rmtree(path / "model/w")
    (path / "model/w").symlink_to(other / "model/w")
    return path


@attack("load", lc.IntegrityError, "not a regular file|cannot be read")
def packed_data_files_linked_to_etc_passwd(tmp: Path) -> Path:
    """The B+tree's nodes and the shards of a packed checkpoint are read through the same
    checks as shard files, whatever path its data file table names."""
    path = craft.plain(tmp / "ckpt", packing="ocdbt")
    for data in (path / "packs/00000/d").iterdir():
        data.unlink()
        data.symlink_to("/etc/passwd")
    return path


@attack("load", lc.IntegrityError, "not a regular file|cannot be read")
def packed_data_file_is_a_fifo(tmp: Path) -> Path:
    path = craft.plain(tmp / "ckpt", packing="ocdbt")
    for data in (path / "packs/00000/d").iterdir():
        data.unlink()
        os.mkfifo(data)
    return path


@attack("load", lc.IntegrityError, "not a regular file")
def shard_is_a_fifo(tmp: Path) -> Path:
    path = craft.plain(tmp / "ckpt")
    (path / "model/w/c.0.0").unlink()
    os.mkfifo(path / "model/w/c.0.0")
    return path


@attack("load", lc.IntegrityError, "not a regular file")
def shard_is_a_directory(tmp: Path) -> Path:
    path = craft.plain(tmp / "ckpt")
    (path / "model/w/c.0.0").unlink()
    (path / "model/w/c.0.0").mkdir()
    return path


@attack("verify", None, "not a regular file")
def verify_meets_a_fifo_shard(tmp: Path) -> Path:
    return shard_is_a_fifo(tmp)


# ---------------------------------------------------------------- decompression bombs (item 8)


def _zstd_shard(tmp: Path, payload: bytes) -> Path:
    """A zstd checkpoint whose first inner chunk is ``payload`` (checksums valid, still bound)."""
    path = craft.plain(tmp / "ckpt", compression="zstd")
    shard = path / "model/w/c.0.0"
    payloads = craft.read_shard(shard, 4)
    shard.write_bytes(craft.shard_bytes([payload, *payloads[1:]], block=craft.block_of(shard.read_bytes(), 4)))
    return path


@attack("load", lc.IntegrityError, "declares 1073741824 decoded bytes")
def zstd_bomb_of_1_gib(tmp: Path) -> Path:
    return _zstd_shard(tmp, craft.zstd_rle_frame(1 << 30, 1 << 30))


@attack("load", lc.IntegrityError, "fails to decode")
def zstd_bomb_with_a_lying_header(tmp: Path) -> Path:
    # Declares the inner chunk's 16 KiB, holds 1 GiB.
    return _zstd_shard(tmp, craft.zstd_rle_frame(1 << 30, craft.INNER_CHUNK_BYTES))


@attack("load", lc.IntegrityError, "declares None decoded bytes")
def zstd_frame_without_a_content_size(tmp: Path) -> Path:
    return _zstd_shard(tmp, craft.zstd_rle_frame(1 << 30, None))


@attack("load", lc.IntegrityError, "declares 1073741824 decoded bytes")
def blosc_bomb_of_1_gib(tmp: Path) -> Path:
    path = craft.plain(tmp / "ckpt", compression="blosc")
    shard = path / "model/w/c.0.0"
    payloads = craft.read_shard(shard, 4)
    first = bytearray(payloads[0])
    first[4:8] = (1 << 30).to_bytes(4, "little")  # the header's decoded size
    shard.write_bytes(craft.shard_bytes([bytes(first), *payloads[1:]], block=craft.block_of(shard.read_bytes(), 4)))
    return path


@attack("verify", None, "declares 1073741824 decoded bytes")
def verify_meets_a_zstd_bomb(tmp: Path) -> Path:
    return zstd_bomb_of_1_gib(tmp)


# ----------------------------------------------------------------- crafted indexes (item 10)


def _crafted_index(tmp: Path, edit: Callable[[list[list[int]]], None]) -> Path:
    path = craft.plain(tmp / "ckpt")
    shard = path / "model/w/c.0.0"
    payloads = craft.read_shard(shard, 4)
    size = len(payloads[0]) + 4
    index = [[i * size, size] for i in range(4)]
    edit(index)
    shard.write_bytes(craft.shard_bytes(payloads, [tuple(e) for e in index], craft.block_of(shard.read_bytes(), 4)))
    return path


@attack("load", lc.IntegrityError, "two inner chunks overlap")
def index_entries_overlap(tmp: Path) -> Path:
    # Rows 16-31 would read rows 0-15's bytes, whose checksum is valid.
    return _crafted_index(tmp, lambda index: index.__setitem__(1, list(index[0])))


@attack("load", lc.IntegrityError, "outside the file")
def index_entry_past_the_file(tmp: Path) -> Path:
    return _crafted_index(tmp, lambda index: index[3].__setitem__(0, 1 << 40))


@attack("load", lc.IntegrityError, "outside the file")
def index_entry_into_the_index(tmp: Path) -> Path:
    # Past the last chunk lies the binding block, then the index: 8 bytes into the index.
    return _crafted_index(tmp, lambda index: index[3].__setitem__(0, index[3][0] + craft.BINDING_BYTES + 8))


@attack("load", lc.IntegrityError, "outside the file")
def index_entry_into_the_binding_block(tmp: Path) -> Path:
    return _crafted_index(tmp, lambda index: index[3].__setitem__(0, index[3][0] + 8))


@attack("load", lc.IntegrityError, "only one of its offset and length")
def index_entry_half_absent(tmp: Path) -> Path:
    return _crafted_index(tmp, lambda index: index[2].__setitem__(0, ABSENT))


# ------------------------------------------------------- the other documents (item 12)


@attack("verify", None, "group document model/zarr.json is not valid JSON")
def group_document_damaged(tmp: Path) -> Path:
    path = craft.plain(tmp / "ckpt")
    (path / "model/zarr.json").write_text('{"zarr_format": 3, "node_type": "gro')
    return path


@attack("verify", None, "group document model/zarr.json missing")
def group_document_missing(tmp: Path) -> Path:
    path = craft.plain(tmp / "ckpt")
    (path / "model/zarr.json").unlink()
    return path


@attack("verify", None, "group document model/zarr.json differs")
def group_document_made_an_array(tmp: Path) -> Path:
    path = craft.plain(tmp / "ckpt")
    (path / "model/w/zarr.json").replace(path / "model/zarr.json")
    (path / "model/w/zarr.json").write_bytes((path / "model/zarr.json").read_bytes())
    return path


@attack("verify", None, "zarr.json differs from what the format requires")
def array_document_shape_edited(tmp: Path) -> Path:
    path = craft.plain(tmp / "ckpt")
    text = (path / "model/w/zarr.json").read_text()
    (path / "model/w/zarr.json").write_text(text.replace('"shape": [64, 64]', '"shape": [64, 24]'))
    return path


@attack("load_rank_state", lc.FormatError, "not of rank 0")
def rank_state_of_another_rank(tmp: Path) -> Path:
    path = craft.plain(tmp / "ckpt", rank_state={"position": 7})
    doc = path / ".rank_state/00000/zarr.json"
    doc.write_text(doc.read_text().replace('"rank": 0', '"rank": 1'))
    return path


@attack("load_rank_state", lc.FormatError, "per-rank document is malformed")
def rank_state_nested_100000_deep(tmp: Path) -> Path:
    path = craft.plain(tmp / "ckpt", rank_state={"position": 7})
    (path / ".rank_state/00000/zarr.json").write_text("[" * 100_000 + "]" * 100_000)
    return path


# ----------------------------------------------------------- shards in the wrong place (item 6)
# Every checksum of a moved or copied shard holds: only its binding block (docs/format.md 5.4),
# which names the save, the array and the cell it was written for, tells it is not this one.

MISPLACED = "belongs to another place"


@attack("load", lc.IntegrityError, MISPLACED)
def shards_swapped(tmp: Path) -> Path:
    path = craft.split(tmp / "ckpt")
    a, b = path / "w/c.0.0", path / "w/c.1.0"
    a_bytes = a.read_bytes()
    a.write_bytes(b.read_bytes())
    b.write_bytes(a_bytes)
    return path


@attack("load", lc.IntegrityError, MISPLACED)
def shard_copied_from_another_checkpoint(tmp: Path) -> Path:
    other = craft.split(tmp / "other")
    (other / "w/c.0.0").write_bytes((other / "w/c.1.0").read_bytes())
    path = craft.split(tmp / "ckpt")
    shutil.copyfile(other / "w/c.0.0", path / "w/c.0.0")
    return path


@attack("load", lc.IntegrityError, MISPLACED)
def shard_copied_from_the_same_cell_of_another_save(tmp: Path) -> Path:
    # Another save of other values, the same geometry: its c.0.0 is bound to its own save alone.
    other = craft.plain(tmp / "other", values=craft.weights() + 1)
    path = craft.plain(tmp / "ckpt")
    shutil.copyfile(other / "model/w/c.0.0", path / "model/w/c.0.0")
    return path


@attack("load", lc.IntegrityError, MISPLACED)
def shard_stripped_of_its_binding_block(tmp: Path) -> Path:
    # Chunks and index as they were, the block cut out: what a writer that knows no binding writes.
    path = craft.plain(tmp / "ckpt")
    shard = path / "model/w/c.0.0"
    shard.write_bytes(craft.unbound(shard.read_bytes(), 4))
    return path


@attack("verify", None, MISPLACED)
def verify_meets_swapped_shards(tmp: Path) -> Path:
    return shards_swapped(tmp)


# -------------------------------------- the TensorStore read path: memory:// (and object stores)
# The same damage as above, read through TensorStore instead of the shard reader: TensorStore
# reports bytes that fail to decode as a bare ``ValueError: FAILED_PRECONDITION``, which must
# come out as the ``IntegrityError`` naming the array. TensorStore decodes into a buffer of the
# inner chunk's size, so a bomb stops there (``tests/integration/test_integrity.py`` checks the
# resident memory, which ``tracemalloc`` does not see).

SHARD = "model/w/c.0.0"


def _memory_first_chunk(tmp: Path, compression: str | None, first: Callable[[bytes], bytes]) -> str:
    """A ``memory://`` checkpoint whose first inner chunk's payload is ``first(payload)``, checksums valid."""
    url = craft.in_memory(tmp, compression=compression)

    def edit(raw: bytes) -> bytes:
        payloads = craft.shard_payloads(raw, 4)
        return craft.shard_bytes([first(payloads[0]), *payloads[1:]], block=craft.block_of(raw, 4))

    craft.edit_memory_shard(url, SHARD, edit)
    return url


@attack("load", lc.IntegrityError, "fails to decode")
def tensorstore_zstd_bomb_of_1_gib(tmp: Path) -> str:
    return _memory_first_chunk(tmp, "zstd", lambda _: craft.zstd_rle_frame(1 << 30, 1 << 30))


@attack("load", lc.IntegrityError, "fails to decode")
def tensorstore_zstd_bomb_with_a_lying_header(tmp: Path) -> str:
    return _memory_first_chunk(tmp, "zstd", lambda _: craft.zstd_rle_frame(1 << 30, craft.INNER_CHUNK_BYTES))


@attack("open_read", lc.IntegrityError, "fails to decode")
def tensorstore_zstd_frame_without_a_content_size(tmp: Path) -> str:
    return _memory_first_chunk(tmp, "zstd", lambda _: craft.zstd_rle_frame(1 << 30, None))


def _blosc_declares_1_gib(payload: bytes) -> bytes:
    first = bytearray(payload)
    first[4:8] = (1 << 30).to_bytes(4, "little")
    return bytes(first)


@attack("load", lc.IntegrityError, "fails to decode")
def tensorstore_blosc_bomb_of_1_gib(tmp: Path) -> str:
    return _memory_first_chunk(tmp, "blosc", _blosc_declares_1_gib)


@attack("load", lc.IntegrityError, "fails to decode")
def tensorstore_inner_chunk_cut_short(tmp: Path) -> str:
    # Its crc32c is valid for what is left: only the decoder can tell.
    return _memory_first_chunk(tmp, None, lambda payload: payload[:100])


@attack("load", lc.IntegrityError, "fails to decode")
def tensorstore_zstd_chunk_corrupted(tmp: Path) -> str:
    # A flipped byte of compressed data: TensorStore's decoder meets it before the crc32c does.
    url = craft.in_memory(tmp, compression="zstd")

    def flip(raw: bytes) -> bytes:
        out = bytearray(raw)
        out[20] ^= 0xFF
        return bytes(out)

    craft.edit_memory_shard(url, SHARD, flip)
    return url


@attack("verify", None, "fails to decode")
def verify_meets_a_zstd_bomb_through_tensorstore(tmp: Path) -> str:
    return tensorstore_zstd_bomb_of_1_gib(tmp)


@attack("verify", None, "fails to decode")
def verify_meets_a_blosc_bomb_through_tensorstore(tmp: Path) -> str:
    return tensorstore_blosc_bomb_of_1_gib(tmp)


# TensorStore checks an index's checksum and bounds, not overlaps: layoutckpt reads each shard's
# index itself before it trusts a TensorStore read (memory://, object stores, packed checkpoints).
@attack("open_read", lc.IntegrityError, "overlap")
def tensorstore_index_entries_overlap(tmp: Path) -> str:
    url = craft.in_memory(tmp)

    def edit(raw: bytes) -> bytes:
        payloads = craft.shard_payloads(raw, 4)
        size = len(payloads[0]) + 4
        index = [(i * size, size) for i in range(4)]
        index[1] = index[0]
        return craft.shard_bytes(payloads, index, craft.block_of(raw, 4))

    craft.edit_memory_shard(url, SHARD, edit)
    return url


@attack("load", lc.IntegrityError, MISPLACED)
def tensorstore_shard_copied_from_another_save(tmp: Path) -> str:
    url = craft.in_memory(tmp)
    other = craft.in_memory(tmp, name="other", values=craft.weights() + 1)
    craft.edit_memory_shard(url, SHARD, lambda _: craft.read_memory_shard(other, SHARD))
    return url


@attack("verify", None, MISPLACED)
def verify_meets_a_copied_shard_through_tensorstore(tmp: Path) -> str:
    return tensorstore_shard_copied_from_another_save(tmp)
