"""Tools that make hostile checkpoints: a valid one to start from, and edits that keep every
checksum valid where an attacker (or an unlucky tool) would, so that the check under test is the
one that must fire rather than a checksum that happens to catch the edit first."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import crc32c
import numpy as np

import layoutckpt as lc
from layoutckpt.format._shard import BINDING_BYTES

ABSENT = 2**64 - 1
SHAPE = (64, 64)
# Inner chunks of 16 rows (4 KiB): four per shard of the replicated array.
INNER_CHUNK_BYTES = 4 << 10


def weights() -> np.ndarray:
    return np.arange(SHAPE[0] * SHAPE[1], dtype=np.float32).reshape(SHAPE)


def plain(
    path: Path,
    *,
    compression: str | None = None,
    rank_state: Any = None,
    values: np.ndarray | None = None,
    packing: str = "auto",
) -> Path:
    """One replicated array ``model.w`` of one shard (``values``, ``weights()`` by default),
    saved by one process (plain files, unless ``packing="ocdbt"``)."""
    lc.save(
        path,
        {"model": {"w": weights() if values is None else values}},
        lc.Layout.replicated(),
        step=12,
        metadata={"run": "attack"},
        inner_chunk_bytes=INNER_CHUNK_BYTES,
        compression=compression,
        rank_state=rank_state,
        packing=packing,
    )
    return path


def split(path: Path, *, name: str = "w") -> Path:
    """The array ``w`` cut in two shards along rows (``c.0.0`` and ``c.1.0``), from one
    process: imported from a safetensors file with a layout of two ranks."""
    data = weights()
    header = json.dumps({name: {"dtype": "F32", "shape": list(SHAPE), "data_offsets": [0, data.nbytes]}}).encode()
    source = path.parent / f"{path.name}.safetensors"
    source.write_bytes(struct.pack("<Q", len(header)) + header + data.tobytes())
    layout = lc.Layout(lc.Mesh({"tp": 2}), [(".*", lc.P("tp", None))])
    lc.import_safetensors(source, path, layout, step=1, inner_chunk_bytes=INNER_CHUNK_BYTES)
    return path


# ------------------------------------------------------------------------------------ documents


def root(path: Path) -> dict[str, Any]:
    return json.loads((path / "zarr.json").read_bytes())


def edit_root(path: Path, edit: Callable[[dict[str, Any]], None], *, reseal: bool = True) -> None:
    """Change the ``layoutckpt`` object of the root document; with ``reseal`` its checksum is
    recomputed, as a tool that knows the format would, so that only the invariants can catch it."""
    doc = root(path)
    body = doc["attributes"]["layoutckpt"]
    edit(body)
    if reseal:
        rest = {k: v for k, v in body.items() if k != "sha256"}
        body["sha256"] = hashlib.sha256(json.dumps(rest, separators=(",", ":")).encode()).hexdigest()
    (path / "zarr.json").write_text(json.dumps(doc, separators=(",", ":")))


def array_entry(name: str) -> Callable[[Callable[[dict[str, Any]], None]], Callable[[dict[str, Any]], None]]:
    def wrap(edit: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
        return lambda body: edit(body["arrays"][name])

    return wrap


# --------------------------------------------------------------------------------------- shards


def _tail(raw: bytes, chunks: int) -> int:
    """Where a shard's binding block starts: every shard layoutckpt saves is bound (version 6)."""
    return len(raw) - 4 - 16 * chunks - BINDING_BYTES


def block_of(raw: bytes, chunks: int) -> bytes:
    """The binding block of a shard of ``chunks`` inner chunks (docs/format.md 5.4)."""
    at = _tail(raw, chunks)
    return raw[at : at + BINDING_BYTES]


def unbound(raw: bytes, chunks: int) -> bytes:
    """The shard ``raw`` without its binding block, its chunks and index as they were."""
    at = _tail(raw, chunks)
    return raw[:at] + raw[at + BINDING_BYTES :]


def read_shard(shard: Path, chunks: int) -> list[bytes | None]:
    """The payloads (checksums stripped) of a shard's ``chunks`` inner chunks, None if absent."""
    return shard_payloads(shard.read_bytes(), chunks)


def shard_payloads(raw: bytes, chunks: int) -> list[bytes | None]:
    """``read_shard`` of a shard's bytes."""
    index = np.frombuffer(raw[-4 - 16 * chunks : -4], "<u8").reshape(chunks, 2)
    return [None if o == ABSENT else raw[o : o + n - 4] for o, n in index.tolist()]


def shard_bytes(payloads: list[bytes | None], index: list[tuple[int, int]] | None = None, block: bytes = b"") -> bytes:
    """A shard file of ``payloads``, each followed by its crc32c, the binding ``block`` (the
    original shard's, ``block_of``, so that the shard stays bound to its place), and an index
    (``index`` where given, crafted; else where the chunks lie) with a valid crc32c."""
    body = b""
    entries = []
    for p in payloads:
        if p is None:
            entries.append((ABSENT, ABSENT))
            continue
        entries.append((len(body), len(p) + 4))
        body += p + crc32c.crc32c(p).to_bytes(4, "little")
    table = np.array(index if index is not None else entries, dtype="<u8").tobytes()
    return body + block + table + crc32c.crc32c(table).to_bytes(4, "little")


def zstd_rle_frame(content: int, declared: int | None) -> bytes:
    """A zstd frame of ``content`` zero bytes as RLE blocks (4 bytes per 128 KiB), whose header
    declares ``declared`` bytes (None: no content size, as a streaming compressor writes)."""
    block = 128 << 10
    if declared is None:
        head = bytes([0x00, 0x58])  # no content size; window descriptor of 1 MiB
    else:
        head = bytes([0xE0]) + declared.to_bytes(8, "little")  # single segment, 8-byte content size
    out = bytearray((0xFD2FB528).to_bytes(4, "little") + head)
    left = content
    while left > 0:
        size = min(block, left)
        left -= size
        out += ((size << 3) | (1 << 1) | (1 if left == 0 else 0)).to_bytes(3, "little") + b"\0"
    return bytes(out)


# ------------------------------------------------------------------ memory:// (TensorStore reads)


def in_memory(
    tmp: Path, *, compression: str | None = None, name: str = "ckpt", values: np.ndarray | None = None
) -> str:
    """``plain``'s checkpoint saved to ``memory://`` (a URL unique to ``tmp`` and ``name``): every
    read of its arrays goes through TensorStore rather than layoutckpt's own shard reader."""
    url = f"memory://attacks/{tmp.name}/{name}"
    lc.save(
        url,
        {"model": {"w": weights() if values is None else values}},
        lc.Layout.replicated(),
        step=12,
        metadata={"run": "attack"},
        inner_chunk_bytes=INNER_CHUNK_BYTES,
        compression=compression,
    )
    return url


def read_memory_shard(url: str, key: str) -> bytes:
    """The stored object ``key`` of the ``memory://`` checkpoint ``url``."""
    from layoutckpt.storage._location import locate

    return bytes(locate(url)._kv.read(key).result().value)


def edit_memory_shard(url: str, key: str, edit: Callable[[bytes], bytes]) -> None:
    """Replace the stored object ``key`` of the ``memory://`` checkpoint ``url`` with ``edit(old)``."""
    from layoutckpt.storage._location import locate

    kv = locate(url)._kv
    kv.write(key, edit(read_memory_shard(url, key))).result()
