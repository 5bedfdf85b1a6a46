"""The safetensors format: headers as frozen values, encoded, and parsed with the checks the
``safetensors`` library makes, so a bad file fails here, naming the file and the tensor.

A file is an 8-byte little-endian length ``N``, ``N`` bytes of JSON (``{name: {"dtype",
"shape", "data_offsets": [begin, end]}}`` and an optional ``"__metadata__"`` of strings, padded
with spaces to a multiple of 8), then the tensors' bytes in C order, little-endian, with offsets
counted from the end of the header. Nothing here reads tensor data.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs

from ..base._errors import FormatError
from ._dtypes import numpy_dtype

# safetensors dtype code -> Zarr data type name, for every type both know.
SAFETENSORS_TO_ZARR = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}
ZARR_TO_SAFETENSORS = {v: k for k, v in SAFETENSORS_TO_ZARR.items()}

# The safetensors library refuses larger headers, so a hostile length cannot make it allocate
# gigabytes; this reader refuses them too.
MAX_HEADER_BYTES = 100_000_000


@attrs.frozen
class TensorEntry:
    """One tensor of a safetensors file; ``begin`` and ``end`` count from the end of the header."""

    name: str
    dtype: str  # the Zarr name
    shape: tuple[int, ...]
    begin: int
    end: int


@attrs.frozen
class SafetensorsHeader:
    """A parsed and checked header: the tensors tile the data exactly, in header order."""

    path: str
    data_start: int
    tensors: tuple[TensorEntry, ...]
    metadata: Mapping[str, str] = attrs.field(factory=dict)


def nbytes(dtype: str, shape: Sequence[int]) -> int:
    return math.prod(shape) * numpy_dtype(dtype).itemsize


def place(arrays: Iterable[tuple[str, str, tuple[int, ...]]]) -> list[TensorEntry]:
    """(name, Zarr dtype, shape) laid out back to back, in the order given."""
    entries, offset = [], 0
    for name, dtype, shape in arrays:
        size = nbytes(dtype, shape)
        entries.append(TensorEntry(name, dtype, tuple(shape), offset, offset + size))
        offset += size
    return entries


def encode_header(entries: Sequence[TensorEntry], metadata: Mapping[str, str] | None = None) -> bytes:
    """The length prefix and the JSON header, padded with spaces to a multiple of 8 bytes so
    the data that follows starts aligned."""
    doc: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    for t in entries:
        doc[t.name] = {"dtype": ZARR_TO_SAFETENSORS[t.dtype], "shape": list(t.shape), "data_offsets": [t.begin, t.end]}
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def _no_duplicate_keys(where: str) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    def build(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise FormatError(f"{where}: the header names {key!r} twice")
            out[key] = value
        return out

    return build


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def parse_header(raw: bytes, where: str, data_bytes: int) -> tuple[tuple[TensorEntry, ...], dict[str, str]]:
    """The tensors and metadata of the JSON header ``raw``, checked against the ``data_bytes``
    that follow it: known dtypes, sizes that match the shapes, offsets that tile the data."""
    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys(where))
    except (ValueError, RecursionError) as err:  # ValueError: bad UTF-8, bad JSON, an integer of 5,000 digits
        raise FormatError(
            f"{where}: the header is not valid JSON ({type(err).__name__}: {err}); not a safetensors file, or damaged"
        ) from None
    if not isinstance(doc, dict):
        raise FormatError(f"{where}: the header must be a JSON object, got {type(doc).__name__}")
    metadata = doc.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise FormatError(f"{where}: '__metadata__' must be an object of strings, got {metadata!r}")
    tensors = []
    for name, d in doc.items():
        what = f"{where}: tensor {name!r}"
        if not isinstance(d, dict):
            raise FormatError(f"{what}: its entry must be an object with dtype, shape, data_offsets, got {d!r}")
        code, shape, offsets = d.get("dtype"), d.get("shape"), d.get("data_offsets")
        if code not in SAFETENSORS_TO_ZARR:
            raise FormatError(
                f"{what} has dtype {code!r}, which layoutckpt cannot store; it stores {list(SAFETENSORS_TO_ZARR)}"
            )
        if not isinstance(shape, list) or not all(_is_int(n) for n in shape):
            raise FormatError(f"{what}: shape must be a list of non-negative integers, got {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
            raise FormatError(f"{what}: data_offsets must be [begin, end] integers, got {offsets!r}")
        t = TensorEntry(name, SAFETENSORS_TO_ZARR[code], tuple(shape), *offsets)
        size = nbytes(t.dtype, t.shape)
        if t.end - t.begin != size:
            raise FormatError(
                f"{what}: a {code} tensor of shape {list(shape)} has {size} bytes, but data_offsets "
                f"{offsets} span {t.end - t.begin}; the header is damaged"
            )
        tensors.append(t)
    # Offsets must tile the data, as the safetensors library requires: no gaps, no overlaps
    # (a crafted file could otherwise alias one tensor's bytes as another's), nothing after.
    end = 0
    for t in sorted(tensors, key=lambda t: (t.begin, t.end)):
        if t.end > data_bytes:
            raise FormatError(
                f"{where}: tensor {t.name!r} ends at byte {t.end} of the data, but the file holds only "
                f"{data_bytes} bytes after the header; the file is truncated"
            )
        if t.begin != end:
            raise FormatError(
                f"{where}: tensor {t.name!r} starts at byte {t.begin} of the data, but the tensor before "
                f"it ends at {end}; the offsets must tile the data without gaps or overlaps"
            )
        end = t.end
    if end != data_bytes:
        raise FormatError(f"{where}: {data_bytes - end} bytes follow the last tensor; the file is damaged")
    return tuple(tensors), dict(metadata)


def read_header(path: str | os.PathLike[str]) -> SafetensorsHeader:
    """Read and check the header of the safetensors file at ``path``."""
    where = os.fspath(path)
    size = os.stat(path).st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        n = int.from_bytes(prefix, "little")
        if len(prefix) < 8 or n > min(MAX_HEADER_BYTES, size - 8):
            raise FormatError(
                f"{where}: the header length {n if len(prefix) == 8 else '(missing)'} does not fit in the "
                f"file's {size} bytes; not a safetensors file, or truncated"
            )
        raw = f.read(n)
    tensors, metadata = parse_header(raw, where, size - 8 - n)
    return SafetensorsHeader(where, 8 + n, tensors, metadata)
