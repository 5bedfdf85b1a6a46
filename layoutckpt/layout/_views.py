"""Local tensors that are not one box of one array: fused projections and padded vocabularies.

- ``Fused``: a rank's tensor is its pieces of several logical arrays, concatenated along one
  dimension: Megatron's ``linear_qkv`` (query groups interleaved: per group, its q rows, then its
  k rows, then its v rows), fused SwiGLU ``[gate; up]``, GPT-2's ``c_attn`` ``[q | k | v]``.
  Each logical array is stored on its own, so another tensor-parallel degree, or an unfused
  model, reads exactly its own rows of each.
- ``Padded``: every rank holds the same number of rows of an array padded past its logical size
  (Megatron pads the vocabulary to a multiple of ``make_vocab_size_divisible_by * tp``). The
  logical rows are stored; a load under another padding fills the rest with a value.

Both are pure: a rank's ``Cut`` of its local tensor for each stored array follows from the
declaration, the mesh, its coordinates and its local shape.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from ..base._errors import LayoutError
from ._plan import entry_split, split_range
from ._spec import Mesh, P


@attrs.frozen
class Cut:
    """The elements of a local tensor that one stored array's piece occupies, along ``dim``.

    The dimension is seen as ``groups`` blocks of ``total`` each; the piece is ``[offset, offset
    + width)`` of every block, the blocks' parts concatenated (one block: a plain slice).
    """

    dim: int
    groups: int
    total: int
    offset: int
    width: int

    def take(self, x: Any) -> Any:
        """The piece of ``x`` (a tensor or NumPy array), contiguous: a view where it is one."""
        piece = self._view(x)
        shape = (*x.shape[: self.dim], self.groups * self.width, *x.shape[self.dim + 1 :])
        piece = piece.reshape(shape)
        if hasattr(piece, "is_contiguous"):
            return piece if piece.is_contiguous() else piece.contiguous()
        return piece if piece.flags.c_contiguous else piece.copy()

    def place(self, x: Any, data: Any) -> None:
        """Copy ``data`` (the piece's shape) into its place in ``x``."""
        view = self._view(x)
        data = data.reshape(view.shape)
        if hasattr(view, "copy_"):
            view.copy_(data)
        else:
            view[...] = data

    def _view(self, x: Any) -> Any:
        shape = tuple(x.shape)
        grouped = x.reshape((*shape[: self.dim], self.groups, self.total, *shape[self.dim + 1 :]))
        index = (slice(None),) * (self.dim + 1) + (slice(self.offset, self.offset + self.width),)
        return grouped[index]


def _parts(parts: Sequence[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
    out = []
    for item in parts:
        if not (isinstance(item, tuple | list) and len(item) == 2 and isinstance(item[0], str)):
            raise LayoutError(f"Fused parts must be (name, size) pairs, got {item!r}")
        name, size = item
        if not name.isidentifier():
            raise LayoutError(f"Fused part name {name!r} must be an identifier such as 'q' or 'gate'")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise LayoutError(f"Fused part {name!r}: size must be an integer >= 1, got {size!r}")
        out.append((name, size))
    if len(out) < 1 or len({n for n, _ in out}) != len(out):
        raise LayoutError(f"Fused parts {out!r} must be one or more, each named once")
    return tuple(out)


def _nonneg_dim(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise LayoutError(f"dim must be an integer >= 0, got {value!r}")
    return value


def _fill_value(value: object) -> float:
    """A padding value as a plain Python number (NumPy's too: a pad id read from an array)."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise LayoutError(f"Padded value (what fills the padding rows) must be a number, got {value!r}")
    return value  # type: ignore[return-value]


def _spec(value: object) -> P:
    if not isinstance(value, P):
        raise LayoutError(f"Fused and Padded wrap a P(...) spec, got {value!r}")
    return value


def _piece(spec: P, dim: int, mesh: Mesh, coords: Mapping[str, int]) -> tuple[int, int]:
    """(pieces, this rank's piece) of dimension ``dim`` under ``spec``."""
    entries = spec.padded(dim + 1)
    return entry_split(entries[dim], mesh, dict(coords))


def part_name(name: str, part: str) -> str:
    """The stored name of ``part`` of the fused array ``name``: before its last component
    (``a.qkv.weight`` -> ``a.qkv.q.weight``), so parameters still end in ``weight``/``bias``."""
    head, dot, last = name.rpartition(".")
    return f"{head}.{part}.{last}" if dot else f"{name}.{part}"


@attrs.frozen(repr=False)
class Fused:
    """A local tensor made of this rank's pieces of several logical arrays along ``dim``.

    ``spec`` splits each logical array as it would split it alone. ``parts`` are (name, size):
    without ``groups``, ``size`` is the part's global length along ``dim``, and the local tensor
    is each part's piece in turn (fused SwiGLU ``[gate; up]``). With ``groups=G``, ``size`` is the
    part's length per group, the ranks split the G groups, and the local tensor holds, for each
    of its groups, that group's rows of every part in turn (Megatron's ``linear_qkv`` with
    grouped-query attention: G query groups, parts q, k and v). Each part is stored as its own
    array, named by ``part_name``.

    >>> Fused(P("tp", None), [("gate", 8), ("up", 8)])
    Fused(P('tp', None), [('gate', 8), ('up', 8)])
    """

    spec: P = attrs.field(converter=_spec)
    parts: tuple[tuple[str, int], ...] = attrs.field(converter=_parts)
    dim: int = attrs.field(default=0, kw_only=True, converter=_nonneg_dim)
    groups: int | None = attrs.field(default=None, kw_only=True)

    def __attrs_post_init__(self) -> None:
        if self.groups is not None and (
            isinstance(self.groups, bool) or not isinstance(self.groups, int) or self.groups < 1
        ):
            raise LayoutError(f"Fused groups must be an integer >= 1, got {self.groups!r}")

    def __repr__(self) -> str:
        extra = (f", dim={self.dim}" if self.dim else "") + (f", groups={self.groups}" if self.groups else "")
        return f"Fused({self.spec!r}, {[tuple(p) for p in self.parts]!r}{extra})"

    @property
    def axes(self) -> tuple[str, ...]:
        return self.spec.axes

    def cuts(self, name: str, shape: Sequence[int], mesh: Mesh, coords: Mapping[str, int]) -> list[tuple[str, Cut]]:
        """(stored name, cut) of every part in the local tensor ``name`` of ``shape``."""
        if self.dim >= len(shape):
            raise LayoutError(f"array {name!r}: {self!r} fuses dimension {self.dim} but the array has {len(shape)}")
        k, i = _piece(self.spec, self.dim, mesh, coords)
        if self.groups is None:
            widths = [len(range(*split_range(size, k, i))) for _, size in self.parts]
            groups, total = 1, sum(widths)
            offsets = [sum(widths[:j]) for j in range(len(widths))]
            expected = total
        else:
            if self.groups % k:
                raise LayoutError(
                    f"array {name!r}: {self.groups} groups cannot be split evenly over the {k} ranks of "
                    f"{self.spec!r}; use a degree that divides the number of groups (replicated groups, "
                    "as tp > num_query_groups needs, are not supported)"
                )
            widths = [size for _, size in self.parts]
            groups, total = self.groups // k, sum(widths)
            offsets = [sum(widths[:j]) for j in range(len(widths))]
            expected = groups * total
        if shape[self.dim] != expected:
            raise LayoutError(
                f"array {name!r}: dimension {self.dim} has {shape[self.dim]} elements on this rank, but "
                f"{self!r} on piece {i} of {k} gives {expected}; make the parts' sizes add up to the local tensor"
            )
        return [
            (part_name(name, part), Cut(self.dim, groups, total, offset, width))
            for (part, _), offset, width in zip(self.parts, offsets, widths)
        ]


@attrs.frozen(repr=False)
class Padded:
    """A local tensor that is this rank's piece of an array padded along ``dim`` past ``size``.

    Every rank holds the same length along ``dim``; piece ``i`` of ``k`` covers ``[i * n, (i + 1)
    * n)`` of the padded array, and rows at or past ``size`` are padding: not stored, and set to
    ``value`` when loaded.

    >>> Padded(P("tp", None), 50257)
    Padded(P('tp', None), 50257)
    """

    spec: P = attrs.field(converter=_spec)
    size: int = attrs.field()
    dim: int = attrs.field(default=0, kw_only=True, converter=_nonneg_dim)
    value: float = attrs.field(default=0, kw_only=True, converter=_fill_value)

    @size.validator
    def _check_size(self, _: object, value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise LayoutError(f"Padded size must be an integer >= 0, got {value!r}")

    def __repr__(self) -> str:
        extra = (f", dim={self.dim}" if self.dim else "") + (f", value={self.value!r}" if self.value else "")
        return f"Padded({self.spec!r}, {self.size}{extra})"

    @property
    def axes(self) -> tuple[str, ...]:
        return self.spec.axes

    def cut(self, name: str, shape: Sequence[int], mesh: Mesh, coords: Mapping[str, int]) -> tuple[Cut, int, int]:
        """(the logical rows' cut, their first row in the array, the rows per piece) of ``name``."""
        if self.dim >= len(shape):
            raise LayoutError(f"array {name!r}: {self!r} pads dimension {self.dim} but the array has {len(shape)}")
        k, i = _piece(self.spec, self.dim, mesh, coords)
        rows = shape[self.dim]
        if rows * k < self.size:
            raise LayoutError(
                f"array {name!r}: {k} pieces of {rows} rows hold {rows * k} rows, fewer than the logical "
                f"size {self.size} of {self!r}; the padding must be at least the logical size"
            )
        start = min(i * rows, self.size)
        valid = min(rows, self.size - start)
        return Cut(self.dim, 1, rows, 0, valid), start, rows
