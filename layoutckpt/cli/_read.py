"""``layoutckpt read``: one array, a NumPy slice of it, or a JSON value; printed or saved as ``.npy``."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

from .._reader import Reader, similar_names
from ..base._errors import CheckpointExistsError
from ..engine import _readplan
from ..engine._read import BoxRead
from ..format._dtypes import ZARR_TO_NUMPY
from ..layout._index import index_box
from ..layout._plan import Box, box_shape, box_view
from ..storage._commit import write_file_atomically
from ..storage._location import check_outside_checkpoints
from ._common import PROG, NotFound, UsageError, open_checkpoint
from ._text import human, json_safe, progress


def array_or_value(rd: Reader, name: str) -> None:
    if name in rd:
        return
    known = [*rd.keys(), *rd.aliases, *rd.value_keys()]
    close = similar_names(name, known, n=3)
    hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
    raise NotFound(f"no array or value {name!r} in checkpoint {rd.path!r}{hint} (`layoutckpt ls {rd.path}` lists them)")


def parse_index(text: str | None, shape: tuple[int, ...], name: str) -> tuple[Box, Any]:
    """``"0:8, :"`` (NumPy basic indexing: ints, slices with steps, ``...``) as the box to read
    and the index that takes the selection from that box (``index_box``). Out-of-range slices
    clip as in NumPy."""
    where = f"--slice {text!r} for {name!r} of shape {shape}"
    parts = [p.strip() for p in text.split(",")] if text and text.strip() else []
    if parts.count("...") > 1:
        raise UsageError(f"{where}: '...' may appear once")
    try:
        box, post = index_box(tuple(_term(part, where) for part in parts), shape, name)
    except IndexError as err:
        raise UsageError(f"{where}: {err}") from None
    return box, (...) if post is None else post


def _term(part: str, where: str) -> Any:
    """One entry of ``--slice``: ``...``, an integer, or a ``start:stop:step`` slice."""
    if part == "...":
        return ...
    fields = part.split(":")
    try:
        if len(fields) == 1:
            return int(fields[0])
        if len(fields) > 3:
            raise ValueError
        start, stop, step = (int(f) if f.strip() else None for f in fields + [""] * (3 - len(fields)))
    except ValueError:
        raise UsageError(
            f"{where}: {part!r} is not an integer or a start:stop:step slice; write e.g. --slice '0:8,:'"
        ) from None
    if step == 0:
        raise UsageError(f"{where}: the step of {part!r} is zero")
    return slice(start, stop, step)


def read_box(rd: Reader, name: str, box: Box, bar: Any) -> np.ndarray:
    """The elements of ``box`` of array ``name``, read by the read engine in pieces of whole
    inner-chunk rows, each straight into its rows of the result, the bar moving as they land."""
    stored = rd.aliases.get(name, name)
    a = rd.meta.arrays[stored]
    out = np.empty(box_shape(box), dtype=rd.info(name).dtype)
    origin = [lo for lo, _ in box]
    pieces = [BoxRead(stored, a, piece, box_view(out, piece, origin)) for piece in _readplan.read_pieces(a, box)]
    for r, _ in rd.read_boxes(pieces):
        bar.update(r.nbytes)
    return out


def npy_ready(data: np.ndarray, name: str) -> np.ndarray:
    """``data`` as ``np.save`` can store it: types without a ``.npy`` code (bfloat16, float8,
    from ml_dtypes) would be written as raw void bytes, so their bits go as unsigned ints."""
    if data.dtype.kind != "V":
        return data
    bits = np.dtype(f"<u{data.dtype.itemsize}")
    print(
        f"{PROG} read: note: {data.dtype} has no .npy type; saved the bits of {name!r} as {bits} "
        f"(np.load(f).view(ml_dtypes.{data.dtype})), or pass --astype float32",
        file=sys.stderr,
    )
    return data.view(bits)


def _check_out(out: str) -> None:
    """``--out`` must not land inside a checkpoint: it would replace one of its files."""
    try:
        check_outside_checkpoints(Path(out), "an .npy file", itself=True)
    except CheckpointExistsError as err:
        raise UsageError(f"--out {err}") from None


def cmd_read(args: argparse.Namespace) -> int:
    if args.out:
        _check_out(args.out)
    with open_checkpoint(args.path) as rd:
        array_or_value(rd, args.name)
        if args.name in rd.value_keys():
            if args.slice or args.out or args.astype:
                raise UsageError(
                    f"{args.name!r} is a JSON value ({rd.read(args.name)!r}), not an array: it has no slices, "
                    ".npy form or data type"
                )
            print(json.dumps(json_safe(rd.read(args.name))))
            return 0
        info = rd.info(args.name)
        box, post = parse_index(args.slice, info.shape, args.name)
        if args.astype and args.astype not in ZARR_TO_NUMPY:
            raise UsageError(f"--astype {args.astype!r} is not a data type; use one of {sorted(ZARR_TO_NUMPY)}")
        with progress(args, info.dtype.itemsize * math.prod(box_shape(box)), args.name) as bar:
            data = read_box(rd, args.name, box, bar)[post]
        if args.astype:
            data = data.astype(ZARR_TO_NUMPY[args.astype])
        what = f"{args.name}" + (f"[{args.slice}]" if args.slice else "")
        header = f"{what}: {data.dtype} {data.shape}" + (f" of {info.shape}" if args.slice else "")
        if args.out:
            # Whole or not at all: a read that fails leaves a file already there as it was.
            ready = npy_ready(data, args.name)
            write_file_atomically(Path(args.out), lambda f: np.save(f, ready, allow_pickle=False))
            print(f"wrote {args.out}: {header}, {human(data.nbytes)}")
            return 0
        print(header)
        with np.printoptions(threshold=sys.maxsize if args.full else 1000):
            print(repr(data))
    return 0
