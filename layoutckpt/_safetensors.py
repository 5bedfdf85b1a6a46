"""Hugging Face safetensors: export a checkpoint as sharded ``.safetensors`` files, import such
files as a checkpoint. Both stream, so neither holds a whole model, nor a whole large tensor.

The format is simple enough to write and parse here (``_safetensors_format``; never pickle),
so the ``safetensors`` package is needed only by the tests, which check the files with it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from . import _importing as importing
from ._load import Select, _selector
from ._reader import Reader
from .base._errors import FormatError, InvalidNameError
from .base._options import DEFAULT_IO
from .engine._read import BoxRead
from .format import _hierarchy as hierarchy
from .format._dtypes import numpy_dtype
from .format._format import ArrayMeta, CheckpointMeta, new_save_id, root_document
from .format._safetensors_format import (
    ZARR_TO_SAFETENSORS,
    SafetensorsHeader,
    TensorEntry,
    encode_header,
    nbytes,
    place,
    read_header,
)
from .format._shard import grid_cells
from .layout import _plan
from .layout._layout import Layout
from .layout._plan import Box
from .layout._tree import check_no_prefix_clash
from .storage._commit import new_token, publish, write_beside, write_file_atomically
from .storage._location import Location, check_outside_checkpoints

# Bytes of an array held at once when exporting (one C-order block, written whole).
BLOCK_BYTES = 16 << 20
# transformers refuses files whose metadata lacks a known "format"; "pt" is what it writes.
FILE_METADATA = {"format": "pt"}

Sources = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]


# --- Export: checkpoint -> sharded safetensors files. ---


@attrs.frozen
class _Out:
    name: str  # in the checkpoint
    out: str  # in the files
    dtype: str
    shape: tuple[int, ...]
    inner: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return nbytes(self.dtype, self.shape)


def plan_files(arrays: Sequence[_Out], max_shard_bytes: int) -> list[list[_Out]]:
    """Hugging Face's rule: in order, a file takes arrays until the next would pass
    ``max_shard_bytes``; an array larger than that gets a file of its own."""
    files: list[list[_Out]] = []
    size = 0
    for a in arrays:
        if not files or (files[-1] and size + a.nbytes > max_shard_bytes):
            files.append([])
            size = 0
        files[-1].append(a)
        size += a.nbytes
    return files


def row_blocks(
    shape: Sequence[int], itemsize: int, inner: Sequence[int], max_bytes: int
) -> Iterator[tuple[int | slice, ...]]:
    """Indices that cut an array into runs of its C-order bytes of about ``max_bytes``, in
    order: blocks of rows, or blocks of one row's rows where a row alone is larger.

    A block holds whole rows of inner chunks when one such row is at most twice ``max_bytes``,
    so that no inner chunk is read (and decoded) twice.
    """
    d = 0
    while itemsize * math.prod(shape[d + 1 :]) > max_bytes:
        d += 1
    if not shape:
        yield ()
        return
    row_bytes = itemsize * math.prod(shape[d + 1 :])
    rows = max(1, max_bytes // row_bytes)
    if rows >= inner[d]:
        rows -= rows % inner[d]
    elif inner[d] * row_bytes <= 2 * max_bytes:
        rows = inner[d]
    for prefix in np.ndindex(*shape[:d]):
        for start in range(0, shape[d], rows):
            yield (*prefix, slice(start, min(start + rows, shape[d])))


def _aligned(start: int, stop: int, step: int) -> list[tuple[int, int]]:
    """``range(start, stop)`` cut at the multiples of ``step``."""
    cuts = []
    while start < stop:
        end = min(stop, (start // step + 1) * step)
        cuts.append((start, end))
        start = end
    return cuts


def chunk_pieces(
    block: tuple[int | slice, ...], shape: Sequence[int], inner: Sequence[int]
) -> list[tuple[tuple[int | slice, ...], tuple[slice, ...]]]:
    """A block of ``row_blocks`` cut along the inner chunk grid: (index in the array, index in
    the block) of pieces that each lie in one inner chunk."""
    d = len(block) - 1
    rows = block[d]
    assert isinstance(rows, slice)
    per_dim = [_aligned(rows.start, rows.stop, inner[d])]
    per_dim += [_aligned(0, n, c) for n, c in zip(shape[d + 1 :], inner[d + 1 :])]
    pieces = []
    for ranges in itertools.product(*per_dim):
        source = (*block[:d], *(slice(a, b) for a, b in ranges))
        (a, b), rest = ranges[0], ranges[1:]
        pieces.append((source, (slice(a - rows.start, b - rows.start), *(slice(x, y) for x, y in rest))))
    return pieces


def _selected(rd: Reader, select: Select) -> list[str]:
    try:
        keep = _selector(select, rd.keys())
    except KeyError as err:
        raise KeyError(
            f"{err.args[0]} (JSON values are not exported, and a tied weight only under its first name); "
            "rd.keys() lists the arrays"
        ) from None
    return [n for n in rd.keys() if keep is None or n in keep]


def export_safetensors(
    path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    select: Select = None,
    max_shard_bytes: int = 5 * 2**30,
    prefix: str = "model",
    rename: Callable[[str], str] | None = None,
) -> list[str]:
    """Write the arrays of the checkpoint at ``path`` to ``out_dir`` as Hugging Face does:
    ``{prefix}-00001-of-0000N.safetensors`` files of at most ``max_shard_bytes`` of tensors
    each (a larger tensor gets a file of its own), and ``{prefix}.safetensors.index.json``
    (``{"metadata": {"total_size": ...}, "weight_map": {name: file}}``); tensors that fit in
    one file go to ``{prefix}.safetensors`` alone, with no index, as ``save_pretrained`` writes
    them. Returns the paths written, the index last.

    Tensors are named by their global names (``model.layers.0.attn.q_proj.weight``), or by
    ``rename(name)``. ``select=`` picks arrays as in ``load`` (a regex, names, or a predicate).
    JSON leaves are not exported (safetensors holds tensors only), and a tied weight is
    exported once, under its first name. Arrays are read in blocks of about 16 MiB into files
    under temporary names; once every file is complete they are renamed into place, the index
    last. An earlier export of ``prefix`` into ``out_dir`` is replaced as a whole (its index
    goes first, its files that the new set lacks after); one that fails leaves the earlier
    export as it was and nothing of its own.
    """
    if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be a positive number of bytes, got {max_shard_bytes!r}")
    if not prefix or "/" in prefix or os.sep in prefix:
        raise ValueError(f"prefix must be a plain file name stem such as 'model', got {prefix!r}")
    with Reader(path) as rd:
        arrays = _exports(rd, _selected(rd, select), rename)
        if not arrays:
            raise ValueError(f"nothing to export: select={select!r} matches no array of checkpoint {rd.path!r}")
        files = plan_files(arrays, max_shard_bytes)
        out = Path(out_dir)
        check_outside_checkpoints(out, "safetensors files", itself=True)
        created = not out.exists()
        out.mkdir(parents=True, exist_ok=True)
        staged: list[tuple[Path, Path]] = []
        weight_map = {}
        try:
            for i, group in enumerate(files, 1):
                name = (
                    f"{prefix}.safetensors" if len(files) == 1 else f"{prefix}-{i:05d}-of-{len(files):05d}.safetensors"
                )
                file = out / name
                staged.append((write_beside(file, lambda f, group=group: _write_file(rd, f, group)), file))
                weight_map.update((a.out, file.name) for a in group)
        except BaseException:
            for tmp, _ in staged:
                tmp.unlink(missing_ok=True)
            if created:
                with contextlib.suppress(OSError):
                    out.rmdir()
            raise
    index = None
    if len(files) > 1:
        total = sum(a.nbytes for a in arrays)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    return _replace_export(out, prefix, staged, index)


def _replace_export(out: Path, prefix: str, staged: list[tuple[Path, Path]], index: dict[str, Any] | None) -> list[str]:
    """Put the staged files of an export in place of any earlier export of ``prefix`` in
    ``out``: the old index first (no index ever names a mixed set), then the new files, then
    the old files the new set lacks, then the new index. The paths written, the index last."""
    index_file = out / f"{prefix}.safetensors.index.json"
    member = re.compile(rf"{re.escape(prefix)}(\.safetensors|-\d{{5}}-of-\d{{5}}\.safetensors)")
    earlier = {p for p in out.iterdir() if member.fullmatch(p.name)}
    index_file.unlink(missing_ok=True)
    for tmp, file in staged:
        publish(tmp, file)
    for stale in earlier - {file for _, file in staged}:
        stale.unlink(missing_ok=True)
    written = [os.fspath(file) for _, file in staged]
    if index is None:
        return written
    write_file_atomically(index_file, lambda f: f.write((json.dumps(index, indent=2) + "\n").encode()))
    return [*written, os.fspath(index_file)]


def _exports(rd: Reader, names: list[str], rename: Callable[[str], str] | None) -> list[_Out]:
    arrays, seen = [], {}
    for name in names:
        a = rd.meta.arrays[name]
        if a.dtype not in ZARR_TO_SAFETENSORS:
            raise TypeError(
                f"array {name!r} of checkpoint {rd.path!r} has dtype {a.dtype}, which safetensors cannot "
                f"hold (it holds {sorted(ZARR_TO_SAFETENSORS)}); leave it out with select="
            )
        out = name if rename is None else rename(name)
        if not isinstance(out, str) or not out or out == "__metadata__":
            raise ValueError(f"rename({name!r}) gave {out!r}; a tensor name must be a non-empty str")
        if out in seen:
            raise ValueError(f"rename gives arrays {seen[out]!r} and {name!r} the same name {out!r}")
        seen[out] = name
        arrays.append(_Out(name, out, a.dtype, a.shape, a.inner_chunk_shape))
    return arrays


def _write_file(rd: Reader, f: Any, group: list[_Out]) -> None:
    # Wider types first (then checkpoint order), as the safetensors library writes them: with an
    # 8-byte aligned header every tensor then starts aligned to its element size, so readers
    # can map it without a copy.
    ordered = sorted(group, key=lambda a: -numpy_dtype(a.dtype).itemsize)
    entries = place((a.out, a.dtype, a.shape) for a in ordered)
    f.write(encode_header(entries, FILE_METADATA))
    for a, entry in zip(ordered, entries):
        if entry.end == entry.begin:
            continue
        _copy_array(rd, a, f)


def _copy_array(rd: Reader, a: _Out, f: Any) -> None:
    """Stream array ``a`` into ``f`` in C order: each block is filled in one reused buffer by
    the read engine, one inner chunk per read, each straight into its place in the buffer.

    Reading a whole block at once holds its encoded chunks, its decoded chunks and the result
    together, and freed memory of that size is not reliably reused; reads of one chunk into a
    reused buffer keep the export's memory at one block.
    """
    stored = rd.aliases.get(a.name, a.name)
    meta = rd.meta.arrays[stored]
    if not a.shape:
        _write_block(f, rd.read(a.name))
        return
    buffer = None
    for block in row_blocks(a.shape, numpy_dtype(a.dtype).itemsize, a.inner, BLOCK_BYTES):
        d = len(block) - 1
        rows = block[d]
        assert isinstance(rows, slice)
        if buffer is None:
            buffer = np.empty((rows.stop - rows.start, *a.shape[d + 1 :]), numpy_dtype(a.dtype))
        out = buffer[: rows.stop - rows.start]
        reads = [
            BoxRead(stored, meta, _box_of(source), out[where][(None,) * d])
            for source, where in chunk_pieces(block, a.shape, a.inner)
        ]
        for _ in rd.read_boxes(reads):
            pass
        _write_block(f, out)


def _box_of(index: tuple[int | slice, ...]) -> Box:
    """The box an index of ints and unit-step slices (``chunk_pieces``) selects."""
    return tuple((i, i + 1) if isinstance(i, int) else (i.start, i.stop) for i in index)


def _write_block(f: Any, block: np.ndarray) -> None:
    f.write(np.ascontiguousarray(block).reshape(-1).view(np.uint8))


# --- Import: safetensors files -> checkpoint. ---


def _index_files(index: Path) -> tuple[list[Path], dict[str, str]]:
    where = os.fspath(index)
    try:
        doc = json.loads(index.read_bytes())
    except (ValueError, RecursionError) as err:  # ValueError: bad UTF-8, bad JSON, an integer of 5,000 digits
        raise FormatError(f"{where}: not valid JSON ({type(err).__name__}: {err})") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise FormatError(f"{where}: needs a 'weight_map' object of tensor name -> file name")
    for file in set(weight_map.values()):
        # A file name only: a crafted index must not send the reader outside its folder.
        if Path(file).name != file or file in ("", ".", ".."):
            raise FormatError(f"{where}: weight_map names file {file!r}; expected a file name in the same folder")
    return [index.parent / f for f in sorted(set(weight_map.values()))], weight_map


def _sources(src: Sources) -> tuple[list[Path], dict[str, str] | None, Path | None]:
    """The files to import, and the index's weight map (and path) when there is one."""
    if not isinstance(src, str | os.PathLike):
        files = [Path(f) for f in src]
        if not files:
            raise ValueError("import_safetensors: src is an empty list of files")
        return files, None, None
    p = Path(src)
    if p.is_dir():
        indexes = sorted(p.glob("*.safetensors.index.json"))
        if len(indexes) > 1:
            raise ValueError(f"{os.fspath(src)!r} holds several indexes {[i.name for i in indexes]}; pass one of them")
        if indexes:
            return (*_index_files(indexes[0]), indexes[0])
        files = sorted(p.glob("*.safetensors"))
        if len(files) != 1:
            raise (FileNotFoundError if not files else ValueError)(
                f"{os.fspath(src)!r} holds {len(files)} .safetensors files and no *.safetensors.index.json; "
                "pass the index, a file, or a list of files"
            )
        return files, None, None
    if p.name.endswith(".index.json"):
        return (*_index_files(p), p)
    if not p.is_file():
        raise FileNotFoundError(f"no safetensors file or folder at {os.fspath(src)!r}")
    return [p], None, None


def _gather(
    headers: list[SafetensorsHeader], weight_map: dict[str, str] | None, index: Path | None
) -> dict[str, tuple[SafetensorsHeader, TensorEntry]]:
    """Every tensor by name, from whichever file holds it; each name once, where the index says."""
    tensors: dict[str, tuple[SafetensorsHeader, TensorEntry]] = {}
    for h in headers:
        for t in h.tensors:
            if t.name in tensors:
                raise FormatError(f"tensor {t.name!r} is in both {tensors[t.name][0].path} and {h.path}")
            tensors[t.name] = (h, t)
    for name, file in (weight_map or {}).items():
        if name not in tensors or Path(tensors[name][0].path).name != file:
            raise FormatError(f"{index}: weight_map puts tensor {name!r} in {file}, which does not hold it")
    return tensors


def _read_box(h: SafetensorsHeader, t: TensorEntry, box: Box) -> np.ndarray:
    """A copy of ``box`` of tensor ``t``, through a mapping of just the bytes the box spans: the
    mapping closes on return, so the pages it touched leave this process's memory."""
    dtype = numpy_dtype(t.dtype)
    # Strided views of ml_dtypes types fail in NumPy; an unsigned integer of the same width
    # carries the bits instead.
    carrier = np.dtype(f"<u{dtype.itemsize}")
    strides = [math.prod(t.shape[d + 1 :]) for d in range(len(t.shape))]
    first = sum(start * s for (start, _), s in zip(box, strides))
    last = sum((stop - 1) * s for (_, stop), s in zip(box, strides))
    mapped = np.memmap(h.path, carrier, "r", h.data_start + t.begin + first * dtype.itemsize, (last - first + 1,))
    view = np.lib.stride_tricks.as_strided(mapped, _plan.box_shape(box), [s * dtype.itemsize for s in strides])
    return np.array(view).view(dtype)


def import_safetensors(
    src: Sources,
    path: str | os.PathLike[str],
    layout: Layout | None = None,
    *,
    step: int | None = None,
    metadata: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    inner_chunk_bytes: int = 2 << 20,
    compression: str | None = None,
) -> None:
    """Write the tensors of safetensors files as a committed checkpoint at ``path``, from one
    process (no ``torch.distributed``).

    ``src`` is a ``.safetensors`` file, an ``*.safetensors.index.json``, a folder holding one
    index (or one ``.safetensors`` file), or a list of files. The checkpoint's tree is a flat
    dict ``{name: tensor}``, so ``load(path)`` gives a state dict. ``layout`` (default:
    replicated) chunks each array as a save under it would, so a load under that layout reads
    whole shards. Bad files raise ``FormatError`` naming the file and tensor before anything is
    written; an existing checkpoint at ``path`` raises ``CheckpointExistsError`` unless
    ``overwrite``. Memory stays at a few inner chunks: the files are mapped one chunk at a time.
    """
    layout = importing.check_options(layout, step, compression, metadata)
    files, weight_map, index = _sources(src)
    tensors = _gather([read_header(f) for f in files], weight_map, index)
    arrays = {
        name: _import_meta(name, h, t, layout, inner_chunk_bytes, compression) for name, (h, t) in tensors.items()
    }
    check_no_prefix_clash(tuple(arrays))
    tree = {"dict": [[name, {"array": name}] for name in arrays]}
    # Bound to a fresh id, as a save's shards are: a shard moved or copied in later is refused.
    meta = importing.checkpoint_meta(arrays, tree, layout, step, metadata).bound(new_save_id())
    final = importing.local_destination(path, overwrite, "import_safetensors")
    _write_checkpoint(final, meta, tensors, overwrite)


def _import_meta(
    name: str, h: SafetensorsHeader, t: TensorEntry, layout: Layout, inner_chunk_bytes: int, compression: str | None
) -> ArrayMeta:
    """The document of tensor ``t`` of file ``h`` as an array chunked as ``layout`` says."""
    try:
        return importing.array_meta(name, t.shape, t.dtype, layout, inner_chunk_bytes, compression)
    except InvalidNameError as err:
        raise InvalidNameError(f"{h.path}: {err}") from None


@attrs.frozen
class _Mapped:
    """A tensor of a safetensors file as a writer's source: any box of it, read on demand."""

    header: SafetensorsHeader
    tensor: TensorEntry

    def wait(self) -> Callable[[Box], np.ndarray]:
        return lambda box: _read_box(self.header, self.tensor, box)

    def release(self) -> None:
        """Nothing is held: each box read is a copy of its own."""


def _write_checkpoint(
    final: Location, meta: CheckpointMeta, tensors: dict[str, tuple[SafetensorsHeader, TensorEntry]], overwrite: bool
) -> None:
    """Committed as a save commits: every shard and document durable under a temporary name,
    the root document (the commit marker) last, then one rename (``Location.commit``)."""
    staging = final.staging(new_token())
    try:
        final.claim(staging, meta.save_id)
        with staging.box_writer(DEFAULT_IO) as writer:
            for name, a in meta.arrays.items():
                source = _Mapped(*tensors[name])
                for cell in grid_cells(a.shape, a.shard_shape):
                    box = tuple((c * s, min((c + 1) * s, n)) for c, s, n in zip(cell, a.shard_shape, a.shape))
                    writer.write(a, box, source)
            writer.join()
        staging.write_many(hierarchy.documents(meta))
        staging.make_durable()
        final.commit(staging, root_document(meta), overwrite=overwrite, save_id=meta.save_id)
    except BaseException:
        staging.discard()
        raise
