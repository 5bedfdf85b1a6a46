"""PyTorch DCP in: convert a checkpoint that ``torch.distributed.checkpoint.save`` wrote into a
layoutckpt checkpoint, array by array, reading from DCP's files only the bytes each box needs.

What DCP's ``FileSystemWriter`` writes (``torch/distributed/checkpoint/filesystem.py`` and
``metadata.py``): ``.metadata``, a pickle of a ``Metadata`` whose ``state_dict_metadata`` gives
each flattened key (``model.layers.0.wq.weight``) a ``TensorStorageMetadata`` (dtype, global
size, and the chunks the ranks wrote, as offsets and sizes) or a ``BytesStorageMetadata`` (any
other value); whose ``storage_data`` maps ``MetadataIndex(key, chunk offsets)`` to
``_StorageInfo(file, offset, length)``; and whose ``planner_data`` maps each key to its path in
the nested state. In the ``__R_N.distcp`` data files, each item is a ``torch.save`` archive: a
zip whose ``data.pkl`` says which storage record holds the tensor and at which offset, size and
stride, and whose ``data/K`` record holds that storage's bytes, uncompressed.

Two pickles, two guards. ``.metadata`` is unpickled only when the caller says it trusts the
checkpoint (``trust_pickle=True``), by ``_MetadataUnpickler``: it constructs DCP's own metadata
classes and the few torch and standard types they hold, and refuses every other class by name.
An item's ``data.pkl`` is read by ``_ItemUnpickler``, which builds no object of any library: the
tensor-rebuild functions and storage types it admits are inert stand-ins that record where the
bytes are, and the bytes are then mapped straight from the data file. ``torch.load`` is never
called. Non-tensor values (``BytesStorageMetadata``) are imported when their pickle holds plain
values only (numbers, strings, lists, tuples, dicts); the names of those that hold anything else
are returned as skipped.
"""

from __future__ import annotations

import contextlib
import enum
import importlib
import io
import math
import os
import pickle
import struct
import zipfile
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from . import _importing as importing
from ._commit import commit_everywhere
from .base._errors import FormatError, IntegrityError, InvalidNameError
from .base._options import DEFAULT_IO, IOConfig
from .format import _hierarchy as hierarchy
from .format._dtypes import ZARR_TO_NUMPY, numpy_dtype
from .format._format import CheckpointMeta, new_save_id
from .format._shard import grid_cells
from .layout import _plan
from .layout._layout import Layout
from .layout._plan import Box
from .layout._tree import check_no_prefix_clash, flatten
from .storage._commit import new_token
from .storage._location import Location
from .torch._dist import comm_for

METADATA_FILE = ".metadata"


class TrustRequiredError(ValueError):
    """A DCP checkpoint's ``.metadata`` is a pickle, and the caller did not say it trusts it."""


class RefusedPickleError(FormatError):
    """A pickle in a DCP checkpoint names a class or function the importer does not admit."""


@attrs.frozen
class DcpImport:
    """What ``import_dcp`` wrote: the checkpoint, how many arrays and values, and the names of
    the non-tensor values it left out: those whose pickles hold more than plain values, and
    raw bytes DCP stored as they were."""

    path: str
    arrays: int
    values: int
    skipped: tuple[str, ...]


# --- .metadata: DCP's classes, and the torch and standard types they hold. ---

_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
}
# ``StorageMeta.checkpoint_id`` is the path dcp.save was given; a path object is inert.
_PLAIN_CLASSES = {
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


def _refused(module: str, name: str, where: str, admitted: str) -> RefusedPickleError:
    return RefusedPickleError(
        f"{where}: the pickle asks for {module}.{name}, which the DCP importer does not admit (it admits "
        f"{admitted}); the file was not written by dcp.save as this importer knows it, or was tampered with. "
        "Nothing it names was run"
    )


_IMMUTABLE_TYPE = 1 << 8  # Py_TPFLAGS_IMMUTABLETYPE: a C type, whose attributes are fixed


def _kept_apart(found: Any) -> Any:
    """``found``, as this unpickling's own: a Python class as a fresh subclass of the same name,
    a Python function as a fresh function calling it. A pickle's BUILD sets attributes on
    whatever it is handed; handed a library's class, it would change that class for the whole
    process (a path class whose ``name`` lies, defeating the check that keeps reads inside the
    checkpoint). C types are immutable, and enumerations take no subclass: they are called.
    Instances (a dtype) are returned as they are."""
    if not callable(found) or (isinstance(found, type) and found.__flags__ & _IMMUTABLE_TYPE):
        return found  # a dtype or a storage type: an instance, not a class
    if isinstance(found, type) and not issubclass(found, enum.Enum):
        return type(found.__name__, (found,), {"__module__": found.__module__, "__qualname__": found.__qualname__})

    def call(*args: Any, **kwargs: Any) -> Any:
        return found(*args, **kwargs)

    return call


def _torch_layout(name: Any) -> Any:
    """Stands in for ``torch.serialization._get_layout``, as which torch pickles a layout: the
    layout of that name, looked up among torch's layouts."""
    import torch

    layouts = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
    if name not in layouts:
        raise FormatError(f"{name!r} is not a torch layout")
    return layouts[name]


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``Metadata``, constructing only the classes it is made of."""

    def __init__(self, file: Any, where: str) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        return _kept_apart(self._admitted(module, name))

    def _admitted(self, module: str, name: str) -> Any:
        import torch

        if name in _DCP_CLASSES.get(module, ()):
            return getattr(importlib.import_module(module), name)
        if module == "torch":
            found = getattr(torch, name, None) if not name.startswith("_") else None
            if name == "Size" or isinstance(found, torch.dtype | torch.layout):
                return found
        if module == "torch.serialization" and name == "_get_layout":
            return _torch_layout
        if (module, name) in _PLAIN_CLASSES:
            return getattr(importlib.import_module(module), name)
        raise _refused(module, name, self.where, "DCP's metadata classes, torch.Size, torch dtypes and layouts, paths")

    def persistent_load(self, pid: Any) -> Any:
        raise RefusedPickleError(
            f"{self.where}: the pickle holds a persistent reference, which DCP metadata never does"
        )


def read_metadata(src: str | os.PathLike[str], *, trust_pickle: bool = False) -> Any:
    """DCP's ``Metadata`` of the checkpoint folder ``src``, through the restricted unpickler."""
    where = os.fspath(Path(src) / METADATA_FILE)
    if not trust_pickle:
        raise TrustRequiredError(
            f"{where} is a Python pickle, and unpickling a file runs what it says; pass trust_pickle=True "
            "(`layoutckpt import --from dcp --trust`) if you trust where this checkpoint came from. Even then "
            "only DCP's own metadata classes are admitted, and any other class is refused unrun"
        )
    try:
        import torch  # noqa: F401 - the classes the metadata is made of
    except ImportError:
        raise ImportError("importing a DCP checkpoint needs torch: pip install 'layoutckpt[torch]' or torch") from None
    try:
        f = open(where, "rb")
    except FileNotFoundError:
        raise FileNotFoundError(
            f"no DCP checkpoint at {os.fspath(src)!r}: it has no {METADATA_FILE} file (dcp.save writes one, last)"
        ) from None
    with f:
        try:
            meta = _MetadataUnpickler(f, where).load()
        except RefusedPickleError:
            raise
        except Exception as err:  # noqa: BLE001 - any failure of a damaged pickle, named
            raise FormatError(f"{where}: not a DCP metadata pickle ({type(err).__name__}: {err})") from None
    if type(meta).__name__ != "Metadata" or not isinstance(getattr(meta, "state_dict_metadata", None), dict):
        raise FormatError(f"{where}: holds a {type(meta).__name__}, not DCP's Metadata")
    return meta


# --- The items of the data files: torch.save archives, read without torch. ---

# torch.save's legacy storage types (``torch.storage._dtype_to_storage_type_map``) of the
# dtypes a checkpoint holds; newer dtypes are saved as ``UntypedStorage`` plus the dtype.
_STORAGE_TYPES = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "UntypedStorage": "uint8",
}


@attrs.frozen
class _StorageType:
    dtype: str


@attrs.frozen
class _DType:
    name: str


@attrs.frozen
class _StorageRef:
    key: str
    dtype: str


@attrs.frozen
class _TensorRef:
    """Where a saved tensor's elements are: a storage record, an element offset, a stride."""

    key: str
    dtype: str
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def _ints(x: Any, what: str) -> tuple[int, ...]:
    if not isinstance(x, tuple | list) or not all(isinstance(i, int) and i >= 0 for i in x):
        raise FormatError(f"a tensor's {what} is {x!r}, not a tuple of non-negative ints")
    return tuple(x)


def _tensor_ref(storage: Any, offset: Any, size: Any, stride: Any, dtype: str) -> _TensorRef:
    if not isinstance(storage, _StorageRef) or not isinstance(offset, int) or offset < 0:
        raise FormatError(f"a tensor is rebuilt from {storage!r} at {offset!r}, not a storage record and offset")
    shape, strides = _ints(size, "size"), _ints(stride, "stride")
    if len(shape) != len(strides):
        raise FormatError(f"a tensor has size {shape} but stride {strides}")
    return _TensorRef(storage.key, dtype, offset, shape, strides)


def _rebuild_v2(storage: Any, offset: Any, size: Any, stride: Any, *_: Any) -> _TensorRef:
    """Stands in for ``torch._utils._rebuild_tensor_v2``: the storage's type gives the dtype."""
    return _tensor_ref(storage, offset, size, stride, getattr(storage, "dtype", "?"))


def _rebuild_v3(storage: Any, offset: Any, size: Any, stride: Any, _grad: Any, _hooks: Any, dtype: Any, *_: Any) -> Any:
    """Stands in for ``torch._utils._rebuild_tensor_v3``: bytes, and the dtype given apart."""
    if not isinstance(dtype, _DType):
        raise FormatError(f"a tensor is rebuilt with dtype {dtype!r}")
    return _tensor_ref(storage, offset, size, stride, dtype.name)


class _ItemUnpickler(pickle.Unpickler):
    """Reads an item's ``data.pkl`` into plain values and ``_TensorRef`` records, nothing else."""

    def __init__(self, file: Any, where: str, tensors: bool) -> None:
        super().__init__(file)
        self.where = where
        self.tensors = tensors

    def find_class(self, module: str, name: str) -> Any:
        return _kept_apart(self._admitted(module, name))

    def _admitted(self, module: str, name: str) -> Any:
        if self.tensors and module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_tensor_v3"):
            return _rebuild_v2 if name.endswith("v2") else _rebuild_v3
        if self.tensors and module in ("torch", "torch.storage") and name in _STORAGE_TYPES:
            return _StorageType(_STORAGE_TYPES[name])
        if self.tensors and module == "torch" and name in ZARR_TO_NUMPY:
            return _DType(name)
        if module == "collections" and name == "OrderedDict":
            return dict
        admitted = "a plain tensor's rebuild function, storage types and dtypes" if self.tensors else "plain values"
        raise _refused(module, name, self.where, admitted)

    def persistent_load(self, pid: Any) -> Any:
        if not self.tensors:
            raise RefusedPickleError(f"{self.where}: the value holds a tensor's storage; a plain value does not")
        if (
            not isinstance(pid, tuple)
            or len(pid) != 5
            or pid[0] != "storage"
            or not isinstance(pid[1], _StorageType)
            or not isinstance(pid[2], str)
        ):
            raise FormatError(f"{self.where}: the pickle refers to {pid!r}, not to a tensor's storage record")
        return _StorageRef(pid[2], pid[1].dtype)


class _Window(io.RawIOBase):
    """Bytes ``start .. start + length`` of an open file, as a file of their own (for zipfile)."""

    def __init__(self, f: Any, start: int, length: int) -> None:
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.length}[whence]
        self.pos = max(0, min(self.length, base + pos))
        return self.pos

    def readinto(self, b: Any) -> int:
        n = min(len(b), self.length - self.pos)
        self.f.seek(self.start + self.pos)
        got = self.f.readinto(memoryview(b)[:n])
        self.pos += got
        return got


@attrs.frozen
class _Placed:
    """A chunk's elements in a data file: from byte ``start``, ``shape`` with ``stride`` (in elements)."""

    file: str
    start: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


class _NotArchive(FormatError):
    """An item that is no zip archive: raw bytes DCP stored as they were, or a damaged item."""


# zipfile's ways of failing on damaged bytes (RuntimeError: an encrypted record; ValueError covers
# UnicodeDecodeError).
_ZIP_DAMAGE = (zipfile.BadZipFile, EOFError, NotImplementedError, RuntimeError, ValueError, struct.error, zlib.error)
MAX_PICKLE_BYTES = 64 << 20  # an item's data.pkl: a tensor's is a few hundred bytes


def _archive(f: Any, where: str) -> tuple[zipfile.ZipFile, str]:
    """The torch.save archive in ``f``, and the prefix of its records (``archive/``)."""
    try:
        zf = zipfile.ZipFile(f)
    except _ZIP_DAMAGE:
        raise _NotArchive(
            f"{where}: not a torch.save archive, or one cut short; only DCP's default format (FileSystemWriter "
            "with serialization_format TORCH_SAVE) is imported"
        ) from None
    pkls = [n for n in zf.namelist() if n.endswith("data.pkl") and n.count("/") == 1]
    if len(pkls) != 1:
        raise FormatError(f"{where}: a torch.save archive holds one */data.pkl, this one {len(pkls)}")
    prefix = pkls[0].removesuffix("data.pkl")
    pkl = zf.getinfo(pkls[0])
    if pkl.compress_type != zipfile.ZIP_STORED or pkl.file_size > MAX_PICKLE_BYTES:
        raise FormatError(
            f"{where}: its data.pkl is compressed or over {MAX_PICKLE_BYTES} bytes; torch.save stores a small one as it is"
        )
    if prefix + "byteorder" in zf.namelist() and zf.read(prefix + "byteorder") != b"little":
        raise FormatError(f"{where}: the tensor was saved big-endian, which the importer does not read")
    return zf, prefix


@contextlib.contextmanager
def _item(folder: Path, info: Any, where: str, tensors: bool) -> Iterator[tuple[Any, zipfile.ZipFile, str, Path, int]]:
    """An item's unpickled ``data.pkl`` (plain values, ``_TensorRef`` where ``tensors``), its
    archive, the archive's record prefix, its data file and where the archive starts there."""
    name, offset, length = _storage_info(info, where)
    path = _data_file(folder, name, where)
    with _open_data(path, offset + length, where) as f:
        window = _Window(f, offset, length)
        at = f"{where} ({path}, bytes {offset}..{offset + length})"
        try:
            zf, prefix = _archive(window, at)
            raw = zf.read(prefix + "data.pkl")
        except FormatError:
            raise
        except _ZIP_DAMAGE as err:
            raise FormatError(f"{at}: a damaged torch.save archive ({type(err).__name__}: {err})") from None
        with zf:
            try:
                value = _ItemUnpickler(io.BytesIO(raw), where, tensors).load()
            except (RefusedPickleError, FormatError):
                raise
            except Exception as err:  # noqa: BLE001 - any failure of a damaged pickle, named
                raise FormatError(f"{where}: a damaged item pickle ({type(err).__name__}: {err})") from None
            yield value, zf, prefix, path, offset


@contextlib.contextmanager
def _open_data(path: Path, end: int, where: str) -> Iterator[Any]:
    """The data file at ``path``, open, which must hold at least ``end`` bytes."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise FormatError(f"{where}: its data file {path} is missing") from None
    with f:
        if os.fstat(f.fileno()).st_size < end:
            raise FormatError(f"{where}: lies past the end of its data file {path} (cut short?)")
        yield f


def _data_file(folder: Path, name: str, where: str) -> Path:
    """The data file ``name`` an item lies in: a file of the checkpoint's folder, not a link
    out of it."""
    path = folder / name
    if os.path.dirname(os.path.realpath(path)) != os.path.realpath(folder):
        raise FormatError(f"{where}: its data file {path} links out of the checkpoint's folder")
    return path


def _storage_info(info: Any, where: str) -> tuple[str, int, int]:
    name, offset, length = (getattr(info, k, None) for k in ("relative_path", "offset", "length"))
    if not isinstance(name, str) or any(c in name for c in "/\\\0") or name in ("", ".", ".."):
        # A file name only: crafted metadata must not send the reader outside the checkpoint.
        raise FormatError(f"{where}: stored in {name!r}; expected a file name in the checkpoint's folder")
    if not isinstance(offset, int) or not isinstance(length, int) or offset < 0 or length < 0:
        raise FormatError(f"{where}: stored at offset {offset!r}, length {length!r}")
    if getattr(info, "transform_descriptors", None):
        raise FormatError(
            f"{where}: stored through DCP extensions {info.transform_descriptors} (e.g. compression), which "
            "the importer does not read; save without _extensions"
        )
    return name, offset, length


def _place_chunk(folder: Path, info: Any, where: str, dtype: str, sizes: tuple[int, ...]) -> _Placed:
    """Where the elements of one DCP chunk lie in its data file, checked against the metadata,
    and its record's bytes checked against the archive's CRC-32."""
    with _item(folder, info, where, tensors=True) as (ref, zf, prefix, path, start):
        if not isinstance(ref, _TensorRef):
            raise FormatError(f"{where}: the item holds a {type(ref).__name__}, not a tensor")
        if ref.dtype != dtype or ref.shape != sizes:
            raise FormatError(f"{where}: the item is {ref.dtype} {ref.shape}, the metadata says {dtype} {sizes}")
        try:
            record = zf.getinfo(f"{prefix}data/{ref.key}")
        except KeyError:
            raise FormatError(f"{where}: the archive has no record data/{ref.key}") from None
        _check_extent(ref, record, where)
        data = _record_start(zf.fp, record, where)
        if data + record.file_size > zf.fp.length:
            raise FormatError(f"{where}: record data/{ref.key} reaches past its item")
        _check_crc(zf.fp, data, record, where)
    itemsize = numpy_dtype(dtype).itemsize
    return _Placed(os.fspath(path), start + data + ref.offset * itemsize, sizes, ref.stride)


def _check_extent(ref: _TensorRef, record: zipfile.ZipInfo, where: str) -> None:
    """The tensor lies inside its storage record, stored as it is, and no element is repeated:
    a stride of 0 over a tiny record would make a small file import as a vast array."""
    if record.compress_type != zipfile.ZIP_STORED:
        raise FormatError(f"{where}: record data/{ref.key} is compressed; torch.save stores records as they are")
    itemsize = numpy_dtype(ref.dtype).itemsize
    last = ref.offset + sum((n - 1) * s for n, s in zip(ref.shape, ref.stride))
    if (last + 1) * itemsize > record.file_size:
        raise FormatError(f"{where}: the tensor reaches past its storage record data/{ref.key}")
    if math.prod(ref.shape) * itemsize > record.file_size:
        raise FormatError(
            f"{where}: the tensor declares {math.prod(ref.shape)} elements, more than its storage record "
            f"data/{ref.key} holds ({record.file_size} bytes); DCP stores every element"
        )


def _record_start(window: _Window, record: zipfile.ZipInfo, where: str) -> int:
    """Where a stored record's bytes start in its item, past the record's local header."""
    window.seek(record.header_offset)
    header = window.read(30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise FormatError(f"{where}: record {record.filename} has no local header")
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return record.header_offset + 30 + name_len + extra_len


def _check_crc(window: _Window, start: int, record: zipfile.ZipInfo, where: str) -> None:
    """The record's bytes match the CRC-32 the archive holds for them (torch.load never checks):
    damage found here is not carried into the new checkpoint under fresh checksums."""
    window.seek(start)
    crc, left = 0, record.file_size
    while left:
        piece = window.read(min(left, 16 << 20))
        if not piece:
            raise FormatError(f"{where}: record {record.filename} is cut short")
        crc, left = zlib.crc32(piece, crc), left - len(piece)
    if crc != record.CRC:
        raise IntegrityError(f"{where}: record {record.filename} fails its CRC-32: the DCP checkpoint is damaged")


def _read_placed(p: _Placed, dtype: np.dtype, box: Box) -> np.ndarray:
    """A copy of ``box`` of a placed chunk, through a mapping of just the bytes the box spans."""
    shape = _plan.box_shape(box)
    if 0 in shape:
        return np.empty(shape, dtype)
    # Strided views of ml_dtypes types fail in NumPy; an unsigned integer of the same width
    # carries the bits instead.
    carrier = np.dtype(f"<u{dtype.itemsize}") if dtype.itemsize > 1 else np.dtype(np.uint8)
    first = sum(a * s for (a, _), s in zip(box, p.stride))
    last = sum((b - 1) * s for (_, b), s in zip(box, p.stride))
    mapped = np.memmap(p.file, carrier, "r", p.start + first * dtype.itemsize, (last - first + 1,))
    view = np.lib.stride_tricks.as_strided(mapped, shape, [s * dtype.itemsize for s in p.stride])
    return np.array(view).view(dtype)


# --- The plan: DCP's keys as arrays and values, and who converts what. ---


@attrs.frozen
class _Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    info: Any  # DCP's _StorageInfo

    @property
    def box(self) -> Box:
        return tuple((o, o + n) for o, n in zip(self.offsets, self.sizes))


@attrs.frozen
class _Tensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[_Chunk, ...]

    @property
    def nbytes(self) -> int:
        return numpy_dtype(self.dtype).itemsize * math.prod(self.shape)


def _tensors(meta: Any, where: str) -> tuple[list[_Tensor], list[str]]:
    """The tensors of DCP's metadata with their chunks, and the names of the other values."""
    storage = {(getattr(k, "fqn", None), tuple(getattr(k, "offset", None) or ())): v for k, v in _storage(meta, where)}
    tensors, values = [], []
    for name, item in meta.state_dict_metadata.items():
        if type(item).__name__ == "BytesStorageMetadata":
            values.append(name)
            continue
        dtype = str(item.properties.dtype).removeprefix("torch.")
        if dtype not in ZARR_TO_NUMPY:
            raise TypeError(
                f"array {name!r} of {where} has dtype {item.properties.dtype}, which layoutckpt cannot store "
                f"(it stores {sorted(ZARR_TO_NUMPY)})"
            )
        shape = tuple(int(n) for n in item.size)
        chunks = []
        for c in item.chunks:
            offsets, sizes = tuple(int(o) for o in c.offsets), tuple(int(n) for n in c.sizes)
            if (name, offsets) not in storage:
                raise FormatError(f"{where}: chunk {offsets} of {name!r} has no storage entry")
            chunks.append(_Chunk(offsets, sizes, storage[(name, offsets)]))
        _check_tiling(name, shape, chunks, where)
        tensors.append(_Tensor(name, dtype, shape, tuple(chunks)))
    return tensors, values


def _storage(meta: Any, where: str) -> Iterator[tuple[Any, Any]]:
    if not isinstance(meta.storage_data, dict):
        raise FormatError(f"{where}: storage_data is a {type(meta.storage_data).__name__}, not DCP's file map")
    yield from meta.storage_data.items()


def _check_tiling(name: str, shape: tuple[int, ...], chunks: list[_Chunk], where: str) -> None:
    """The chunks lie inside the array, do not overlap, and cover it."""
    for c in chunks:
        if len(c.offsets) != len(shape) or any(o + n > s for o, n, s in zip(c.offsets, c.sizes, shape)):
            raise FormatError(f"{where}: chunk {c.offsets} {c.sizes} of {name!r} lies outside its shape {shape}")
    boxes = [c.box for c in chunks if math.prod(c.sizes)]
    pair = _overlapping(boxes)
    if pair is not None:
        raise FormatError(f"{where}: chunks {pair[0]} and {pair[1]} of {name!r} overlap")
    if sum(math.prod(_plan.box_shape(b)) for b in boxes) != math.prod(shape):
        raise FormatError(f"{where}: the chunks of {name!r} do not cover its shape {shape}")


GRID_CELLS = 1 << 22  # the cells counted at most: 16 MiB of counts


def _overlapping(boxes: list[Box]) -> tuple[Box, Box] | None:
    """Two of ``boxes`` that overlap, or None, in time linear in the boxes for every regular
    sharding (a DTensor over 16,384 ranks has 16,384 chunks per tensor): each box adds one to
    the cells of the grid that all the boxes' edges make, and a cell counted twice lies in
    two boxes. Irregular boxes whose grid is too large are swept instead."""
    if len(boxes) < 2:
        return None
    if not boxes[0]:
        return boxes[0], boxes[1]  # 0-d: every chunk is the whole
    edges = [np.unique([edge for b in boxes for edge in b[d]]) for d in range(len(boxes[0]))]
    if math.prod(len(e) - 1 for e in edges) > GRID_CELLS:
        return _swept(boxes)
    count = np.zeros([len(e) - 1 for e in edges], np.int32)
    for b in boxes:
        count[tuple(slice(np.searchsorted(e, lo), np.searchsorted(e, hi)) for e, (lo, hi) in zip(edges, b))] += 1
    if count.max() <= 1:
        return None
    point = [e[i] for e, i in zip(edges, np.unravel_index(np.argmax(count), count.shape))]
    a, b, *_ = (x for x in boxes if all(lo <= p < hi for p, (lo, hi) in zip(point, x)))
    return a, b


def _swept(boxes: list[Box]) -> tuple[Box, Box] | None:
    """``_overlapping`` by a sweep along the dimension where the boxes start at the most
    places: each box is compared with those still open there only."""
    d = max(range(len(boxes[0])), key=lambda d: len({b[d][0] for b in boxes}))
    open_: list[Box] = []
    for b in sorted(boxes, key=lambda b: b[d][0]):
        open_ = [a for a in open_ if a[d][1] > b[d][0]]
        for a in open_:
            if _overlap(a, b) is not None:
                return a, b
        open_.append(b)
    return None


def _overlap(a: Box, b: Box) -> Box | None:
    box = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in box) else box


def share(tensors: Sequence[_Tensor], rank: int, world: int) -> list[_Tensor]:
    """Rank ``rank``'s arrays: the largest first, each to the rank with the fewest bytes so far
    (every rank computes the same split)."""
    loads = [0] * world
    mine = []
    for t in sorted(tensors, key=lambda t: (-t.nbytes, t.name)):
        r = loads.index(min(loads))
        loads[r] += t.nbytes
        if r == rank:
            mine.append(t)
    return mine


def _paths(meta: Any, names: Sequence[str]) -> dict[str, tuple[str | int, ...]]:
    """Each key's path in the saved state (DCP's ``planner_data``, where it is one), else its
    dotted parts. A path joins to its key, so the tree's global names are DCP's keys."""
    given = meta.planner_data if isinstance(meta.planner_data, dict) else {}
    paths = {}
    for name in names:
        path = given.get(name)
        ok = isinstance(path, tuple) and path and all(isinstance(p, str | int) for p in path)
        paths[name] = path if ok and ".".join(map(str, path)) == name else tuple(name.split("."))
    return paths


# Marks each tensor's place in the nested state: ``flatten`` makes it an array node of that name.
_ARRAY = np.empty(0, np.uint8)


def _tree(paths: Mapping[str, tuple[str | int, ...]], leaves: Mapping[str, Any]) -> Any:
    """The checkpoint's tree: the nested state with an array node per tensor and a value per
    value; a container indexed 0..n-1 is a list, as DCP's paths index lists."""
    root: dict[Any, Any] = {}
    for name, leaf in leaves.items():
        node = root
        path = paths[name]
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise FormatError(f"DCP key {name!r} lies under the value of another key")
        if path[-1] in node:
            raise FormatError(f"DCP key {name!r} is also the parent of other keys")
        node[path[-1]] = leaf

    def build(x: Any) -> Any:
        if not isinstance(x, dict):
            return x
        if x and all(type(k) is int for k in x) and set(x) == set(range(len(x))):
            return [build(x[i]) for i in range(len(x))]
        return {str(k): build(v) for k, v in x.items()}

    structure, _ = flatten(build(root))
    return structure


def _values(src: Path, meta: Any, names: list[str]) -> tuple[dict[str, Any], list[str]]:
    """The non-tensor values whose pickles hold plain values only; the names of the others."""
    storage = {getattr(k, "fqn", None): v for k, v in _storage(meta, os.fspath(src))}
    values, skipped = {}, []
    for name in names:
        where = f"value {name!r} of {os.fspath(src)}"
        if name not in storage:
            raise FormatError(f"{where}: has no storage entry")
        try:
            with _item(src, storage[name], where, tensors=False) as (value, *_):
                pass
        except (RefusedPickleError, _NotArchive):  # objects of other classes, or raw bytes
            skipped.append(name)
            continue
        try:
            _check_size(value, where)
            flatten({"v": value})  # a value the tree can hold: plain, JSON-like
        except (_TooLarge, TypeError, InvalidNameError):
            skipped.append(name)
            continue
        values[name] = value
    return values, skipped


MAX_VALUE_NODES = 1 << 20


class _TooLarge(FormatError):
    """A value of more than ``MAX_VALUE_NODES`` items: left out, as a tree value would be
    walked item by item (a sampler's million indices belong in per-rank state)."""


def _check_size(value: Any, where: str) -> None:
    """A value of at most ``MAX_VALUE_NODES`` lists, dicts and scalars, counted as the tree
    would walk them: a pickle that reuses one list at every level is a few hundred bytes and
    would take years to walk."""
    todo, seen = [value], 0
    while todo:
        x = todo.pop()
        seen += 1
        if seen > MAX_VALUE_NODES:
            raise _TooLarge(f"{where}: holds more than {MAX_VALUE_NODES} items, counting each repeat")
        if isinstance(x, dict):
            todo.extend(x.values())
        elif isinstance(x, list | tuple):
            todo.extend(x)


# --- Writing: each rank converts its share; one commit. ---


@attrs.frozen
class _Chunks:
    """A tensor's placed DCP chunks as a writer's source: any box, read from them on demand."""

    dtype: np.dtype
    placed: tuple[tuple[Box, _Placed], ...]

    def wait(self) -> Callable[[Box], np.ndarray]:
        return self.read

    def read(self, box: Box) -> np.ndarray:
        out = np.empty(_plan.box_shape(box), self.dtype)
        for where, p in self.placed:
            common = _overlap(box, where)
            if common is None:
                continue
            local = tuple((a - o, b - o) for (a, b), (o, _) in zip(common, where))
            into = tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(common, box))
            out[into] = _read_placed(p, self.dtype, local)
        return out

    def release(self) -> None:
        """Nothing is held: each box read is a copy of its own."""


def _write_share(src: Path, staging: Location, meta: CheckpointMeta, mine: list[_Tensor], io: IOConfig) -> None:
    with staging.box_writer(io) as writer:
        for t in mine:
            a = meta.arrays[t.name]
            where = f"array {t.name!r} of DCP checkpoint {os.fspath(src)}"
            placed = tuple(
                (c.box, _place_chunk(src, c.info, where, t.dtype, c.sizes)) for c in t.chunks if math.prod(c.sizes)
            )
            source = _Chunks(numpy_dtype(t.dtype), placed)
            for cell in grid_cells(a.shape, a.shard_shape):
                box = tuple((c * s, min((c + 1) * s, n)) for c, s, n in zip(cell, a.shard_shape, a.shape))
                writer.write(a, box, source)
        writer.join()


def import_dcp(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    layout: Layout | None = None,
    *,
    trust_pickle: bool = False,
    group: Any = None,
    step: int | None = None,
    metadata: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    inner_chunk_bytes: int = 2 << 20,
    compression: str | None = None,
    io: IOConfig | None = None,
) -> DcpImport:
    """Convert the DCP checkpoint folder ``src`` (written by ``torch.distributed.checkpoint.save``)
    into a committed layoutckpt checkpoint at ``dst``, a local directory.

    DCP's ``.metadata`` is a pickle: it is read only with ``trust_pickle=True``, and then only
    DCP's own metadata classes are admitted (``RefusedPickleError`` names any other, unrun);
    without it, ``TrustRequiredError`` says so. The tensors' bytes are mapped from DCP's data
    files box by box, so memory stays at a few inner chunks, never a whole tensor. The tree is
    the saved state's, so ``load(dst)`` gives the nested state dict back; non-tensor values are
    imported where their pickles hold plain values only, and the others' names are returned in
    ``skipped``. ``layout`` (default: replicated) chunks each array as a save under it would.

    In a ``torch.distributed`` job (or with ``group=``), every rank calls it: the ranks split the
    arrays, each converts its share, and rank 0 commits once every rank has written.
    """
    layout = importing.check_options(layout, step, compression, metadata)
    folder = Path(src)
    dcp = read_metadata(folder, trust_pickle=trust_pickle)
    tensors, value_names = _tensors(dcp, os.fspath(folder / METADATA_FILE))
    values, skipped = _values(folder, dcp, value_names)
    check_no_prefix_clash(tuple(t.name for t in tensors))
    arrays = {
        t.name: importing.array_meta(t.name, t.shape, t.dtype, layout, inner_chunk_bytes, compression) for t in tensors
    }
    tree = _tree(_paths(dcp, [*arrays, *values]), {**dict.fromkeys(arrays, _ARRAY), **values})
    meta = importing.checkpoint_meta(arrays, tree, layout, step, metadata)
    final = importing.local_destination(dst, overwrite, "import_dcp")
    _convert(folder, final, meta, tensors, overwrite, io or DEFAULT_IO, group)
    return DcpImport(final.url, len(arrays), len(values), tuple(skipped))


def _convert(
    src: Path, final: Location, meta: CheckpointMeta, tensors: list[_Tensor], overwrite: bool, io: IOConfig, group: Any
) -> None:
    """Every rank writes its share into one staging folder; rank 0 commits once all have. The
    shards are bound to rank 0's fresh save id, as a save's are."""
    comm = comm_for(group)
    ids = comm.broadcast_bytes(f"{new_token()} {new_save_id()}".encode() if comm.rank == 0 else None).decode()
    token, save_id = ids.split()
    meta = meta.bound(save_id)
    staging = final.staging(int(token))
    failure = b""
    try:
        if comm.rank == 0:
            final.claim(staging, save_id)
        _write_share(src, staging, meta, share(tensors, comm.rank, comm.world), io)
        staging.write_many(hierarchy.documents(meta, comm.rank, comm.world))
        staging.make_durable()
    except BaseException as err:
        if comm.world == 1:  # one process: its own error (or Ctrl-C), as it is
            staging.discard()
            raise
        if not isinstance(err, Exception):
            raise
        # Reported to every rank by ``commit_everywhere``, which then commits nothing.
        failure = f"{type(err).__name__}: {err}".encode()
    commit_everywhere(comm, staging, final, meta, failure, overwrite)
