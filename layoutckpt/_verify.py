"""``verify``: read every stored byte of a checkpoint once and report every problem found.

The root document was checked when the checkpoint was opened (its checksum and the invariants
of ``docs/format.md`` section 8). Every other document the format requires is checked here: the
group document of every group on the way to an array (plain zarr walks them), and for each
array its own ``zarr.json``, which must agree with the root document (plain zarr reads only
that one). Then, for each array, every shard file its grid needs is stored (in checkpoints marked ``all_chunks_stored``;
older ones could leave out all-zero shards, which read as zeros); and every shard, read through
the read engine, passes the crc32c checks of its index and inner chunks (``DATA_LOSS``) with no inner
chunk missing (``NOT_FOUND``), and, where the checkpoint binds its shards (``save_id``), holds the
binding block of its own save, array and cell: a shard moved or copied in is reported. Then every per-rank document must parse and be its rank's. A damaged
array does not stop the others from being checked. Documents are read as regular files inside
the checkpoint only, of bounded size (``Location.read``).

Memory stays bounded whatever the sizes: shards are read by the read engine in pieces of whole
inner-chunk rows (``_readplan.read_pieces``), at most ``IOConfig.budget_bytes`` of them in
flight, and each piece is dropped once checked.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from ._reader import Reader
from .base._errors import FormatError, IntegrityError
from .engine import _readplan
from .engine._read import BoxRead
from .format._format import GROUP_DOCUMENT, parse_json
from .format._hierarchy import RANK_STATE_DIR
from .format._shard import grid_cells
from .layout._plan import Box, box_shape, chunks_touched
from .storage._os import NotRegularFile


@attrs.frozen
class Finding:
    """A problem (or, as a warning, a remark) about an array, one of its shards, or the checkpoint."""

    array: str | None
    shard: str | None
    text: str

    def to_dict(self) -> dict[str, Any]:
        return {"array": self.array, "shard": self.shard, "text": self.text}


@attrs.define
class Verification:
    """What ``verify`` checked (counts of what is stored) and what it found."""

    path: str
    arrays: int = 0
    shards: int = 0
    chunks: int = 0  # inner chunks
    nbytes: int = 0  # decoded bytes of the shards read
    rank_states: int = 0
    problems: list[Finding] = attrs.field(factory=list)
    warnings: list[Finding] = attrs.field(factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def damaged_arrays(self) -> list[str]:
        return sorted({p.array for p in self.problems if p.array is not None})

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "ok": self.ok,
            "arrays": self.arrays,
            "shards": self.shards,
            "chunks": self.chunks,
            "bytes": self.nbytes,
            "rank_states": self.rank_states,
            "damaged_arrays": self.damaged_arrays,
            "problems": [p.to_dict() for p in self.problems],
            "warnings": [w.to_dict() for w in self.warnings],
        }


def cell_box(shape: tuple[int, ...], shard: tuple[int, ...], cell: tuple[int, ...]) -> Box:
    """The elements of the array that shard ``cell`` holds."""
    return tuple((i * s, min((i + 1) * s, n)) for n, s, i in zip(shape, shard, cell))


def stored_shards(rd: Reader, name: str, v: Verification) -> set[str]:
    """Check the array's ``zarr.json`` and that the shard files its grid needs are stored; the
    keys of those that are (only they are read)."""
    a = rd.meta.arrays[name]
    problem = _document_problem(rd, f"{a.path}/zarr.json", a.zarr_metadata())
    if problem == "missing":
        v.problems.append(Finding(name, None, "its zarr.json is missing: plain zarr cannot open it (layoutckpt can)"))
    elif problem:
        text = f"its zarr.json {problem}, disagreeing with the checkpoint's root metadata: plain zarr would misread it"
        v.problems.append(Finding(name, None, text))
    present = {k.decode() for k in rd.tensorstore(name).kvstore.list().result()}
    expected: set[str] = set()  # the stored ones only: the grid may have many cells
    for cell in grid_cells(a.shape, a.shard_shape):
        key = a.chunk_key(cell)
        if key in present:
            expected.add(key)
        elif rd.meta.all_chunks_stored:
            v.problems.append(Finding(name, key, "the shard file is missing"))
        else:
            # Checkpoints older than ``all_chunks_stored`` left out all-zero shards.
            v.warnings.append(Finding(name, key, "absent: reads as zeros (allowed in this checkpoint)"))
    unexpected = sorted(present - expected - {"zarr.json"})
    if unexpected:
        v.warnings.append(Finding(name, None, f"files the format does not know: {unexpected[:5]}"))
    return present


def _document_problem(rd: Reader, key: str, expected: object) -> str | None:
    """How the document at ``key`` differs from ``expected`` (``"missing"`` if absent), or None."""
    try:
        raw = rd._arrays.read(key)  # the documents of the checkpoint the reader opened
    except NotRegularFile as err:
        return f"is not a regular file inside the checkpoint ({err.strerror})"
    except IntegrityError as err:  # a packed checkpoint's database, damaged
        return f"cannot be read ({err})"
    if raw is None:
        return "missing"
    try:
        doc = parse_json(raw, key)
    except FormatError:
        return "is not valid JSON"
    return None if doc == expected else "differs from what the format requires"


def check_groups(rd: Reader, v: Verification) -> None:
    """Every group document the format requires (section 3) is there and is exactly the empty
    group: plain zarr walks the hierarchy through them."""
    groups = {a.path.rsplit("/", i)[0] for a in rd.meta.arrays.values() for i in range(1, a.path.count("/") + 1)}
    if rd.meta.rank_state_world is not None:
        groups.add(RANK_STATE_DIR)
    for group in sorted(groups):
        problem = _document_problem(rd, f"{group}/zarr.json", GROUP_DOCUMENT)
        if problem:
            text = f"the group document {group}/zarr.json {problem}: plain zarr cannot walk to the arrays under it"
            v.problems.append(Finding(None, None, text))


def _reads(rd: Reader, name: str, present: set[str]) -> Iterator[BoxRead]:
    """Reads that cover every stored shard of ``name`` once, in pieces of whole inner-chunk rows
    (``_readplan.read_pieces``), each keyed by its shard."""
    a = rd.meta.arrays[name]
    for cell in grid_cells(a.shape, a.shard_shape):
        key = a.chunk_key(cell)
        if key in present:
            for piece in _readplan.read_pieces(a, cell_box(a.shape, a.shard_shape, cell)):
                yield BoxRead(name, a, piece, key=key)


# Damage the shard reader names by more than a checksum (``_shardread``).
_OTHER_DAMAGE = re.compile(
    r"(is not a regular file inside the checkpoint|declares \S+ decoded bytes, not \d+|fails to decode"
    r"|the index of shard \S+ is invalid: [^;()]*|lies outside its file|too short for its index"
    r"|belongs to another place: [^;()]*[^;()\s])"
)


def _damage(err: IntegrityError) -> str:
    text = str(err)
    other = _OTHER_DAMAGE.search(text)
    missing = re.search(r"its data file \S+ is missing|reads as empty: the data file under packs/", text)
    if missing:
        reason = f"{missing.group(0).removeprefix('reads as empty: ')}"
    elif "NOT_FOUND" in text or "is missing from storage" in text:
        reason = "an inner chunk is missing from the shard"
    elif other:
        reason = other.group(1)
    else:
        reason = "fails its checksum (crc32c of an inner chunk or of the shard index)"
    entry = re.search(r"(?:shard entry|inner chunk) (\{[\d, ]*\})", text)
    if entry:  # the position of the damaged inner chunk in the shard's grid
        reason += f", inner chunk {entry.group(1)}"
    return reason


def _present_shards(rd: Reader, v: Verification) -> dict[str, set[str]]:
    present: dict[str, set[str]] = {}
    for name in rd.keys():
        try:
            present[name] = stored_shards(rd, name, v)
        except (ValueError, OSError) as err:
            v.problems.append(Finding(name, None, f"cannot list its files: {err}"))
            present[name] = set()
    return present


def _count(rd: Reader, v: Verification, present: dict[str, set[str]]) -> int:
    """Count the arrays, shards and chunks to check; return their bytes."""
    total = 0
    for name, keys in present.items():
        a = rd.meta.arrays[name]
        itemsize = rd.info(name).dtype.itemsize
        v.arrays += 1
        for cell in grid_cells(a.shape, a.shard_shape):
            if a.chunk_key(cell) in keys:
                box = cell_box(a.shape, a.shard_shape, cell)
                v.shards += 1
                v.chunks += chunks_touched(box, a.inner_chunk_shape)  # chunks past the edge are never stored
                total += itemsize * math.prod(box_shape(box))
    return total


def verify(rd: Reader, *, progress: Callable[[int, int], None] | None = None) -> Verification:
    """Check the checkpoint ``rd`` reads; ``progress(bytes_done, bytes_total)`` after each read."""
    v = Verification(rd.path)
    check_groups(rd, v)
    present = _present_shards(rd, v)
    total = _count(rd, v, present)
    damaged: set[tuple[str, str]] = set()

    def found(r: BoxRead, err: IntegrityError) -> None:
        if (r.name, r.key) not in damaged:  # one finding per shard, however many pieces fail
            damaged.add((r.name, r.key))
            v.problems.append(Finding(r.name, r.key, _damage(err)))
        done(r)

    def done(r: BoxRead) -> None:
        v.nbytes += r.nbytes
        if progress is not None:
            progress(v.nbytes, total)

    requests = (r for name, keys in present.items() for r in _reads(rd, name, keys))
    for r, _ in rd.read_boxes(requests, on_damage=found):
        done(r)  # the piece is dropped once checked: memory stays within the engine's budget

    if rd.meta.rank_state_world is not None:
        try:
            v.rank_states = len(rd.rank_states())
        except (FormatError, OSError, ValueError, KeyError) as err:
            v.problems.append(Finding(None, None, f"per-rank state: {err}"))
        except ImportError as err:  # a document holding torch tensors, in a NumPy-only install
            v.warnings.append(Finding(None, None, f"per-rank state not decoded: {err}"))
    return v
