"""The shard format (``docs/format.md`` section 5.4), defined once.

Every array is stored with Zarr v3's ``sharding_indexed`` codec: a shard file holds inner chunks,
each little-endian bytes, optionally compressed, followed by its crc32c; at the end of the file an
index of ``(offset, nbytes)`` as two uint64 per inner chunk in C order over the shard's inner
grid, followed by the index's crc32c. A chunk that was never written has both entries
``ABSENT``. A shard of a checkpoint with a ``save_id`` (format version 6 on) holds a binding block
(``binding``) between its last inner chunk and its index: the shard's proof of which checkpoint,
array and grid cell it belongs to, which Zarr readers skip (they find chunks by offset). The TensorStore/zarr codec description (``codecs_json``), the numcodecs codec that
layoutckpt's own shard writer and reader use (``codec_for``), and the byte counts a read plan
reports all derive from the definitions here.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any

from ..base._options import COMPRESSIONS
from ..layout._plan import Box

ABSENT = 2**64 - 1  # both index entries of a chunk that is not stored
CRC_BYTES = 4  # after every inner chunk, and after the shard index
INDEX_ENTRY_BYTES = 16  # (offset, nbytes) as two uint64 per inner chunk of a shard
ZSTD_LEVEL = 3
# The binding block: a magic, then the first ``BINDING_DIGEST_BYTES`` of a BLAKE2b digest of
# the save's id, the array's path and the shard's grid cell (``binding``).
BINDING_MAGIC = b"LCBIND1\0"
BINDING_DIGEST_BYTES = 24
BINDING_BYTES = len(BINDING_MAGIC) + BINDING_DIGEST_BYTES


def _check(compression: str | None) -> None:
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")


def _blosc_shuffle(itemsize: int) -> str:
    # Byte shuffling groups the bytes of wide types; single bytes gain only from bit shuffling.
    return "shuffle" if itemsize > 1 else "bitshuffle"


def compression_json(compression: str | None, itemsize: int) -> list[dict[str, Any]]:
    """The compression step of an inner chunk's codec chain, as Zarr v3 JSON (none: empty)."""
    _check(compression)
    if compression is None:
        return []
    if compression == "zstd":
        return [{"name": "zstd", "configuration": {"level": ZSTD_LEVEL, "checksum": False}}]
    config = {"cname": "zstd", "clevel": ZSTD_LEVEL, "shuffle": _blosc_shuffle(itemsize), "typesize": itemsize}
    return [{"name": "blosc", "configuration": {**config, "blocksize": 0}}]


def codec_for(compression: str | None, itemsize: int) -> Any:
    """The numcodecs codec of ``compression_json``: its ``encode`` writes what TensorStore would,
    its ``decode`` reads any such chunk; None for uncompressed chunks."""
    _check(compression)
    if compression is None:
        return None
    from numcodecs import Blosc, Zstd

    if compression == "zstd":
        return Zstd(level=ZSTD_LEVEL, checksum=False)
    shuffle = Blosc.SHUFFLE if _blosc_shuffle(itemsize) == "shuffle" else Blosc.BITSHUFFLE
    return Blosc(cname="zstd", clevel=ZSTD_LEVEL, shuffle=shuffle, blocksize=0, typesize=itemsize)


def binding(save_id: str, path: str, cell: Sequence[int]) -> bytes:
    """The binding block of the shard at grid ``cell`` of the array at ``path``, written by the
    save ``save_id``: a shard moved to another cell or array, or copied from another checkpoint,
    carries another block, though its checksums all hold."""
    text = f"{save_id}\0{path}\0{'.'.join(map(str, cell))}".encode()
    return BINDING_MAGIC + hashlib.blake2b(text, digest_size=BINDING_DIGEST_BYTES).digest()


def grid_cells(shape: Sequence[int], chunk: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Every cell of the regular grid of ``chunk`` over ``shape`` that holds an element; a 0-d
    array has one cell, an array with an empty dimension none."""
    return itertools.product(*(range(-(-n // c)) for n, c in zip(shape, chunk)))


def inner_count(shard_shape: Sequence[int], inner_shape: Sequence[int]) -> int:
    """The number of inner chunks of a shard, those past the array's edge included."""
    return math.prod(-(-s // c) for s, c in zip(shard_shape, inner_shape))


def index_bytes(shard_shape: Sequence[int], inner_shape: Sequence[int]) -> int:
    """The bytes of a shard's index, its checksum included."""
    return INDEX_ENTRY_BYTES * inner_count(shard_shape, inner_shape) + CRC_BYTES


def inner_boxes(
    shape: Sequence[int], shard_shape: Sequence[int], inner_shape: Sequence[int], cell: Sequence[int]
) -> Iterator[Box | None]:
    """For each inner chunk of shard ``cell``, in C order, the box of the array it covers (clipped
    at the array's edge), or None where it lies wholly outside the array; ``inner_count`` of them.

    Made one at a time: a list of a shard's thousands of boxes, held while the shard is written,
    would count towards the garbage collector's next collections."""
    per_dim = []
    for n, s, c, i in zip(shape, shard_shape, inner_shape, cell):
        starts = range(i * s, (i + 1) * s, c)
        per_dim.append([(start, min(start + c, n)) for start in starts])
    return (box if all(a < b for a, b in box) else None for box in itertools.product(*per_dim))


_ZSTD_MAGIC = 0xFD2FB528
_BLOSC_HEADER_BYTES = 16


def declared_size(compression: str | None, payload: Any) -> int | None:
    """The decoded byte count an encoded inner chunk declares in its header, read before any
    decoding so that a reader can refuse a chunk that would inflate past its inner chunk's size
    (a decompression bomb); None where the header declares none or is malformed.

    A zstd frame states its content size in its header (RFC 8878 section 3.1.1.1); a blosc
    chunk's 16-byte header states it at bytes 4 to 8, and its own length at bytes 12 to 16.
    """
    head = bytes(payload[:18])
    if compression == "blosc":
        if len(head) < _BLOSC_HEADER_BYTES or int.from_bytes(head[12:16], "little") != len(payload):
            return None
        return int.from_bytes(head[4:8], "little")
    if compression != "zstd" or len(head) < 5 or int.from_bytes(head[:4], "little") != _ZSTD_MAGIC:
        return None
    descriptor = head[4]
    single_segment = (descriptor >> 5) & 1
    size_bytes = (1 if single_segment else 0, 2, 4, 8)[descriptor >> 6]
    if size_bytes == 0:
        return None  # content size unknown: not what a writer of this format writes
    at = 5 + (0 if single_segment else 1) + (0, 1, 2, 4)[descriptor & 3]
    if len(payload) < at + size_bytes:
        return None
    value = int.from_bytes(bytes(payload[at : at + size_bytes]), "little")
    return value + 256 if size_bytes == 2 else value
