"""Damaged chunk files: every stored chunk and shard index carries a crc32c checksum.

What this file proves: one flipped byte in a chunk file of array ``A`` (in an inner chunk's data,
or in the shard index at the end of the file), or a truncated chunk file, makes ``lc.load`` and
``lc.open(p).read`` raise ``lc.IntegrityError`` naming ``A``, while every other array (and the
parts of ``A`` outside the damaged inner chunk) still loads bit-exact. Checked in one process, and
for a checkpoint saved by two ranks and loaded under another layout.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import layoutckpt as lc

INNER_CHUNK_BYTES = 1024  # small inner chunks, so a chunk file holds several of them


def full_state() -> dict:
    return {
        "A": torch.arange(32 * 16, dtype=torch.float32).reshape(32, 16) / 7,
        "B": torch.linspace(-3, 3, 40).to(torch.bfloat16).reshape(8, 5),
        "C": np.arange(50, dtype=np.int64) * 3,
        "step": 11,
    }


def bits(x) -> bytes:
    if isinstance(x, torch.Tensor):
        return x.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return np.ascontiguousarray(x).tobytes()


def chunk_files(ckpt: Path, name: str) -> list[Path]:
    files = sorted((ckpt / name).glob("c.*"))
    assert files, f"no chunk files of {name!r} under {ckpt}"
    return files


def index_entries(raw: bytes, n_inner: int) -> np.ndarray:
    """The shard index at the end of a chunk file: (offset, nbytes) per inner chunk, then a crc32c."""
    index = raw[-(16 * n_inner + 4) : -4]
    return np.frombuffer(index, dtype="<u8").reshape(n_inner, 2)


def inner_chunks_per_file(ckpt: Path, name: str) -> int:
    info = lc.open(ckpt).info(name)
    return int(np.prod([s // c for s, c in zip(info.shard_shape, info.inner_chunk_shape)]))


def damage(path: Path, how: str, n_inner: int) -> None:
    """Flip one byte in the middle of the first inner chunk's data or of the index; or truncate."""
    raw = bytearray(path.read_bytes())
    index_bytes = 16 * n_inner + 4
    if how == "data":
        offset, nbytes = (int(v) for v in index_entries(bytes(raw), n_inner)[0])
        assert offset + nbytes <= len(raw) - index_bytes
        raw[offset + nbytes // 2] ^= 0x5A
    elif how == "index":
        raw[len(raw) - index_bytes // 2] ^= 0x5A
    elif how == "truncated":
        raw = raw[: len(raw) // 2]
    else:
        raise AssertionError(how)
    path.write_bytes(bytes(raw))


def assert_names_a(err: BaseException | str) -> None:
    text = str(err)
    assert "array 'A'" in text and "damaged" in text, text
    assert "'B'" not in text and "'C'" not in text, text


# --- one process --------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["data", "index", "truncated"])
def test_damaged_chunk_single_process(tmp_path, how):
    path = tmp_path / "ck"
    full = full_state()
    lc.save(path, full, lc.Layout.replicated(), inner_chunk_bytes=INNER_CHUNK_BYTES)
    n_inner = inner_chunks_per_file(path, "A")
    assert n_inner > 1
    (chunk,) = chunk_files(path, "A")
    damage(chunk, how, n_inner)

    with pytest.raises(lc.IntegrityError) as info:
        lc.load(path)
    assert isinstance(info.value, ValueError)
    assert_names_a(info.value)
    with pytest.raises(lc.IntegrityError) as info:
        lc.open(path).read("A")
    assert_names_a(info.value)

    # The other arrays are untouched.
    out = lc.load(path, select=["B", "C"])
    assert set(out) == {"B", "C"}
    assert bits(out["B"]) == bits(full["B"]) and out["B"].dtype == torch.bfloat16
    assert bits(out["C"]) == bits(full["C"])
    reader = lc.open(path)
    assert bits(reader.read("B")) == bits(full["B"].view(torch.int16).numpy())
    assert bits(reader.read("C")) == bits(full["C"])
    assert reader.read("step") == 11

    # Damage in one inner chunk's data stays there: rows of A outside that inner chunk still read.
    rows = reader.info("A").inner_chunk_shape[0]
    if how == "data":
        assert bits(reader.read("A", np.s_[rows:, :])) == bits(full["A"][rows:])
    else:  # the index (or the whole tail) of the file is gone: nothing of this file can be trusted
        with pytest.raises(lc.IntegrityError):
            reader.read("A", np.s_[rows:, :])


# --- a checkpoint saved by two ranks ------------------------------------------------------------

SAVE_LAYOUT = lc.Layout(lc.Mesh({"tp": 2}), [(r"^A$", lc.P("tp", None)), (r".*", lc.P())])


def _save_two(rank, group, path):
    full = full_state()
    state = {**full, "A": full["A"].chunk(2)[rank].clone()}
    lc.save(path, state, SAVE_LAYOUT, group=group, inner_chunk_bytes=INNER_CHUNK_BYTES)


def _load_columns(rank, group, path, select):
    """Load under another layout: A split by columns, so every rank reads from both of A's files."""
    layout = lc.Layout(lc.Mesh({"c": 2}), [(r"^A$", lc.P(None, "c")), (r"^B$", lc.P("c")), (r".*", lc.P())])
    try:
        out = lc.load(path, layout, group=group, select=select)
    except Exception as err:  # noqa: BLE001 - returned to the test, which asserts on it
        return type(err).__name__, str(err)
    return "ok", {k: (bits(v) if not isinstance(v, int) else v) for k, v in out.items()}


@pytest.mark.parametrize("how", ["data", "index", "truncated"])
def test_damaged_chunk_saved_by_two_ranks(ranks, tmp_path, how):
    path = tmp_path / "ck"
    ranks.run(_save_two, 2, str(path))
    files = chunk_files(path, "A")
    assert [f.name for f in files] == ["c.0.0", "c.1.0"]  # one per writer
    damage(files[1], how, inner_chunks_per_file(path, "A"))
    full = full_state()

    for rank, (kind, message) in enumerate(ranks.run(_load_columns, 2, str(path), None)):
        assert kind == "IntegrityError", (rank, kind, message)
        assert_names_a(message)
    for rank, (kind, out) in enumerate(ranks.run(_load_columns, 2, str(path), ["B", "C"])):
        assert kind == "ok", (rank, out)
        assert out["B"] == bits(full["B"].chunk(2)[rank])
        assert out["C"] == bits(full["C"]) and set(out) == {"B", "C"}

    reader = lc.open(path)
    with pytest.raises(lc.IntegrityError) as info:
        reader.read("A")
    assert_names_a(info.value)
    assert bits(reader.read("A", np.s_[:16])) == bits(full["A"][:16])  # the first writer's file is intact
    assert bits(reader.read("C")) == bits(full["C"])
    assert [f.name for f in chunk_files(path, "A")] == ["c.0.0", "c.1.0"]


# --- read through TensorStore (memory://, object stores) -----------------------------------------


def _peak_rss_reset() -> bool:
    """Reset this process's peak resident size (VmHWM), where Linux lets it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) << 10
    raise AssertionError("no VmHWM in /proc/self/status")


@pytest.mark.parametrize("how", ["zstd-bomb", "blosc-bomb", "zstd-garbled", "cut-short"])
def test_undecodable_chunk_through_tensorstore(tmp_path, how):
    """A memory:// checkpoint is read by TensorStore, whose decoders report bad bytes as a bare
    ``ValueError: FAILED_PRECONDITION``: it must come out as ``IntegrityError`` naming the array,
    from ``lc.load``, ``Reader.read`` and ``verify`` alike, the other arrays still readable, and a
    bomb of 1 GiB must not be inflated (TensorStore stops at the inner chunk's size)."""
    from layoutckpt._verify import verify
    from tests.attacks import craft

    compression = {"zstd-bomb": "zstd", "blosc-bomb": "blosc", "zstd-garbled": "zstd", "cut-short": None}[how]
    url = f"memory://integrity/{tmp_path.name}/{how}"
    full = full_state()
    lc.save(url, full, lc.Layout.replicated(), inner_chunk_bytes=INNER_CHUNK_BYTES, compression=compression)
    chunks = inner_chunks_per_file_url(url, "A")

    def edit(raw: bytes) -> bytes:
        payloads = craft.shard_payloads(raw, chunks)
        first = payloads[0]
        if how == "zstd-bomb":
            first = craft.zstd_rle_frame(1 << 30, 1 << 30)
        elif how == "blosc-bomb":
            first = first[:4] + (1 << 30).to_bytes(4, "little") + first[8:]
        elif how == "cut-short":
            first = first[: len(first) // 3]
        else:  # a frame that is no zstd frame, its crc32c valid
            first = bytes([first[0] ^ 0xFF]) + first[1:]
        return craft.shard_bytes([first, *payloads[1:]], block=craft.block_of(raw, chunks))

    craft.edit_memory_shard(url, "A/c.0.0", edit)
    measured = _peak_rss_reset()
    before = _peak_rss()
    with pytest.raises(lc.IntegrityError) as info:
        lc.load(url)
    assert_names_a(info.value)
    assert "fails to decode" in str(info.value) and "FAILED_PRECONDITION" in str(info.value)
    with lc.open(url) as reader:
        with pytest.raises(lc.IntegrityError) as info:
            reader.read("A")
        assert_names_a(info.value)
        rows = reader.info("A").inner_chunk_shape[0]
        assert bits(reader.read("A", np.s_[rows:, :])) == bits(full["A"][rows:])  # the other inner chunks
        found = verify(reader)
    assert [(p.array, "fails to decode" in p.text) for p in found.problems] == [("A", True)], found.problems
    if measured:
        assert _peak_rss() - before < 256 << 20, f"peak resident memory grew by {(_peak_rss() - before) >> 20} MiB"
    out = lc.load(url, select=["B", "C"])
    assert bits(out["B"]) == bits(full["B"]) and bits(out["C"]) == bits(full["C"])


def inner_chunks_per_file_url(url: str, name: str) -> int:
    info = lc.open(url).info(name)
    return int(np.prod([s // c for s, c in zip(info.shard_shape, info.inner_chunk_shape)]))
