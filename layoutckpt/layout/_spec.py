"""``Mesh`` and ``P``: the vocabulary of named device meshes and partition specs.

Both are small frozen values that hash, compare, and print as the code that builds them, in the
manner of ``jax.sharding.PartitionSpec``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Mapping

import attrs

from ..base._errors import LayoutError

# One entry of a spec: None (not split), an axis name, or axes major-to-minor.
SpecEntry = None | str | tuple[str, ...]


def _axes_from_mapping(axes: Mapping[str, int] | tuple[tuple[str, int], ...]) -> tuple[tuple[str, int], ...]:
    if not isinstance(axes, Mapping | tuple | list):
        raise LayoutError(f"Mesh takes a mapping of axis names to sizes, such as {{'dp': 2, 'tp': 4}}; got {axes!r}")
    items = tuple(axes.items()) if isinstance(axes, Mapping) else tuple(axes)
    seen: set[str] = set()
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise LayoutError(f"Mesh axes must be name -> size pairs, got {item!r}")
        name, size = item
        if not isinstance(name, str) or not name.isidentifier():
            raise LayoutError(f"Mesh axis name {name!r} must be an identifier such as 'dp' or 'tp'")
        if name in seen:
            raise LayoutError(f"Mesh axis {name!r} is declared twice")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise LayoutError(f"Mesh axis {name!r} has size {size!r}; sizes must be integers >= 1")
        seen.add(name)
    return items


@attrs.frozen(repr=False)
class Mesh:
    """Named mesh axes; rank ``r`` maps to coordinates in row-major order of the axes.

    Built from ``{axis: size}`` in order, major to minor; ``axes`` holds the (name, size) pairs.
    Names are identifiers and sizes integers >= 1, else ``LayoutError``.

    >>> Mesh({"dp": 2, "tp": 4}).coords(5)
    {'dp': 1, 'tp': 1}
    """

    axes: tuple[tuple[str, int], ...] = attrs.field(converter=_axes_from_mapping)

    @property
    def shape(self) -> dict[str, int]:
        """``{axis: size}``, in axis order."""
        return dict(self.axes)

    @property
    def axis_names(self) -> tuple[str, ...]:
        """The axis names, major to minor."""
        return tuple(name for name, _ in self.axes)

    @property
    def size(self) -> int:
        """The number of devices (ranks): the product of the axis sizes; 1 for ``Mesh({})``."""
        return math.prod(size for _, size in self.axes)

    def axis_size(self, name: str) -> int:
        """The size of axis ``name``; ``LayoutError`` if the mesh has no such axis."""
        for axis, size in self.axes:
            if axis == name:
                return size
        raise LayoutError(f"Mesh has no axis {name!r}; its axes are {list(self.axis_names)}")

    def coords(self, rank: int) -> dict[str, int]:
        """``{axis: index}`` of ``rank``, row-major (the last axis varies fastest).

        Raises ``LayoutError`` unless ``0 <= rank < size``.
        """
        if not 0 <= rank < self.size:
            raise LayoutError(f"Rank {rank} is outside {self!r}, which has {self.size} devices")
        coords: dict[str, int] = {}
        for name, size in reversed(self.axes):
            rank, coords[name] = divmod(rank, size)
        return {name: coords[name] for name in self.axis_names}

    def rank_of(self, coords: Mapping[str, int]) -> int:
        """The rank at ``coords`` (``{axis: index}`` for every axis): the inverse of ``coords``.

        The indices are not range-checked; a missing axis raises ``KeyError``.
        """
        rank = 0
        for name, size in self.axes:
            rank = rank * size + coords[name]
        return rank

    def to_json(self) -> list[list[object]]:
        """The mesh as JSON, ``[[axis, size], ...]`` (a list, since the order matters)."""
        return [[name, size] for name, size in self.axes]

    @classmethod
    def from_json(cls, data: object) -> Mesh:
        """The mesh ``to_json`` wrote; ``LayoutError`` if ``data`` is not a valid mesh."""
        if not isinstance(data, list) or not all(isinstance(item, list) and len(item) == 2 for item in data):
            raise LayoutError(f"A mesh is stored as [[axis, size], ...], got {data!r}")
        return cls(tuple((item[0], item[1]) for item in data))

    def __repr__(self) -> str:
        return f"Mesh({self.shape!r})"


def _normalize_entry(entry: object) -> SpecEntry:
    if entry is None or isinstance(entry, str):
        return entry
    if isinstance(entry, (tuple, list)) and all(isinstance(a, str) for a in entry):
        axes = tuple(entry)
        if len(axes) == 0:
            return None
        return axes[0] if len(axes) == 1 else axes
    raise LayoutError(f"A spec entry must be None, an axis name or a tuple of axis names, got {entry!r}")


class P:
    """A partition spec: for each tensor dimension, the mesh axis (or axes) splitting it.

    Dimensions past the end of the spec are not split. Mesh axes the spec does not name hold
    replicas. Naming an axis twice raises ``LayoutError``, whatever the mesh.

    >>> P("tp", None)
    P('tp', None)
    >>> P(("dp", "tp"), None).axes
    ('dp', 'tp')
    """

    __slots__ = ("_entries",)
    _entries: tuple[SpecEntry, ...]

    def __init__(self, *entries: object) -> None:
        normalized = tuple(_normalize_entry(e) for e in entries)
        # Whatever the mesh, one axis cannot split two dimensions (or one dimension twice).
        axes = [a for entry in normalized for a in entry_axes(entry)]
        for i, axis in enumerate(axes):
            if axis in axes[:i]:
                raise LayoutError(
                    f"spec {_spec_repr(normalized)} uses axis {axis!r} twice; "
                    "a mesh axis can split at most one dimension"
                )
        object.__setattr__(self, "_entries", normalized)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("P is immutable")

    @property
    def entries(self) -> tuple[SpecEntry, ...]:
        """One entry per leading dimension: ``None`` (not split), an axis name, or a tuple of
        two or more axis names (major to minor). ``()`` and one-axis tuples are normalized."""
        return self._entries

    @property
    def axes(self) -> tuple[str, ...]:
        """Every mesh axis the spec names, in order of appearance."""
        return tuple(a for entry in self._entries for a in entry_axes(entry))

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[SpecEntry]:
        return iter(self._entries)

    def __getitem__(self, i: int) -> SpecEntry:
        return self._entries[i]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, P) and self._entries == other._entries

    def __hash__(self) -> int:
        return hash(("P", self._entries))

    def __reduce__(self) -> tuple[type[P], tuple[SpecEntry, ...]]:
        # Pickle through the constructor: the default slot-state restore hits __setattr__.
        return (P, self._entries)

    def __repr__(self) -> str:
        return _spec_repr(self._entries)

    def padded(self, ndim: int) -> tuple[SpecEntry, ...]:
        """``entries`` followed by ``None`` up to ``ndim`` entries (the dimensions not split).

        A spec of ``ndim`` entries or more is returned as it is (saving and loading refuse a
        spec longer than the array's rank).
        """
        return self._entries + (None,) * (ndim - len(self._entries))

    def to_json(self) -> list[object]:
        """The entries as JSON: ``None``, an axis name, or a list of axis names each."""
        return [list(e) if isinstance(e, tuple) else e for e in self._entries]

    @classmethod
    def from_json(cls, data: object) -> P:
        """The spec ``to_json`` wrote; ``LayoutError`` if ``data`` is not a valid spec."""
        if not isinstance(data, list):
            raise LayoutError(f"A spec is stored as a list of entries, got {data!r}")
        return cls(*data)


def _spec_repr(entries: tuple[SpecEntry, ...]) -> str:
    return f"P({', '.join(repr(e) for e in entries)})"


def entry_axes(entry: SpecEntry) -> tuple[str, ...]:
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return entry


def check_spec(spec: P, mesh: Mesh, ndim: int, name: str, shape: tuple[int, ...] | None = None) -> None:
    """Raise a ``LayoutError`` naming the array if ``spec`` cannot split it on ``mesh``."""
    if _fits(spec, mesh, ndim):
        return
    where = f"array {name!r}" + (f" with shape {tuple(shape)}" if shape is not None else f" of rank {ndim}")
    if len(spec) > ndim:
        raise LayoutError(
            f"{where}: spec {spec!r} has {len(spec)} entries but the array has only {ndim} "
            f"dimension(s); shorten the spec or fix the rule that matched {name!r}"
        )
    # A repeated axis never gets here: ``P`` refuses it when built.
    axis = next(a for a in spec.axes if a not in mesh.axis_names)
    raise LayoutError(
        f"{where}: spec {spec!r} names axis {axis!r}, which {mesh!r} does not have; use one of {list(mesh.axis_names)}"
    )


# A load checks every array's spec, and the layers of a model repeat a few specs and dimension counts.
@functools.lru_cache(maxsize=4096)
def _fits(spec: P, mesh: Mesh, ndim: int) -> bool:
    return len(spec) <= ndim and all(a in mesh.axis_names for a in spec.axes)
