"""Local names to global names: what a pipeline stage or an expert-parallel rank calls its arrays.

Megatron-style stages number their layers from 0 on every stage, and expert-parallel ranks number
their experts from 0 on every rank. The checkpoint stores global names, so a layout declares how a
rank's local names map to them, as ordered rules, each applied once where it matches:

- ``Renumber(pattern, axis, per=k)``: the number ``pattern`` captures becomes ``i + c * k`` on
  the rank at coordinate ``c`` of mesh axis ``axis`` (or ``i + starts[c]`` for uneven stages);
- ``Rename(pattern, replacement)``: a regex substitution (Hugging Face names onto Megatron's).

Everything here is pure: a function of the rules, the mesh and a rank's coordinates.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Mapping, Sequence

import attrs

from ..base._errors import LayoutError
from ._spec import Mesh


def _compiled(pattern: object) -> re.Pattern[str]:
    if not isinstance(pattern, str):
        raise LayoutError(f"a name rule's pattern must be a string, got {pattern!r}")
    try:
        return re.compile(pattern)
    except re.error as err:
        raise LayoutError(f"name rule pattern {pattern!r} is not a valid regex: {err}") from None


def _starts(value: Sequence[int] | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list | tuple):
        raise LayoutError(f"Renumber starts must be a list of integers, one per coordinate, got {value!r}")
    starts = tuple(value)
    if not starts or starts[0] != 0 or any(not isinstance(s, int) or isinstance(s, bool) for s in starts):
        raise LayoutError(f"Renumber starts {starts!r} must be integers beginning with 0, one per coordinate")
    if any(b <= a for a, b in itertools.pairwise(starts)):
        raise LayoutError(f"Renumber starts {starts!r} must increase: each coordinate holds at least one number")
    return starts


@attrs.frozen(repr=False)
class Renumber:
    """The number ``pattern`` captures, local to each coordinate of ``axis``, made global.

    ``pattern`` has one capture group matching decimal digits. On coordinate ``c`` the local
    number ``i`` becomes ``i + c * per``, or ``i + starts[c]`` where stages hold different
    counts (``starts`` has one entry per coordinate, from 0; a final extra entry gives the
    total). A local number past its coordinate's count is refused: two names would meet.

    >>> Renumber(r"^layers\\.(\\d+)\\.", "pp", per=4).apply("layers.1.w", {"pp": 2})
    'layers.9.w'
    """

    pattern: str
    axis: str
    per: int | None = None
    starts: tuple[int, ...] | None = attrs.field(default=None, converter=_starts)
    _regex: re.Pattern[str] = attrs.field(init=False, eq=False, hash=False)

    def __attrs_post_init__(self) -> None:
        regex = _compiled(self.pattern)
        if regex.groups != 1:
            raise LayoutError(f"Renumber pattern {self.pattern!r} must have exactly one capture group (the number)")
        if (self.per is None) == (self.starts is None):
            raise LayoutError(f"Renumber {self.pattern!r}: give per= (numbers per coordinate) or starts=, not both")
        if self.per is not None and (isinstance(self.per, bool) or not isinstance(self.per, int) or self.per < 1):
            raise LayoutError(f"Renumber {self.pattern!r}: per must be an integer >= 1, got {self.per!r}")
        object.__setattr__(self, "_regex", regex)

    def __repr__(self) -> str:
        count = f"per={self.per}" if self.per is not None else f"starts={list(self.starts or ())}"
        return f"Renumber({self.pattern!r}, {self.axis!r}, {count})"

    def span(self, coord: int) -> tuple[int, int | None]:
        """[first, end) of the global numbers held at ``coord``; end None where unbounded."""
        if self.per is not None:
            return coord * self.per, (coord + 1) * self.per
        assert self.starts is not None
        if coord >= len(self.starts):
            raise LayoutError(
                f"Renumber {self.pattern!r}: starts {list(self.starts)} has no entry for {self.axis}={coord}"
            )
        return self.starts[coord], self.starts[coord + 1] if coord + 1 < len(self.starts) else None

    def apply(self, name: str, coords: Mapping[str, int]) -> str:
        match = self._regex.search(name)
        if match is None:
            return name
        digits = match.group(1)
        if not (digits.isascii() and digits.isdigit()):
            raise LayoutError(
                f"array {name!r}: {self!r} captures {digits!r}, not a number; make the capture group "
                "match the digits only, such as (\\d+)"
            )
        local = int(digits)
        first, end = self.span(coords[self.axis])
        number = first + local
        if end is not None and number >= end:
            raise LayoutError(
                f"array {name!r}: local number {local} on {self.axis}={coords[self.axis]} maps past this "
                f"coordinate's numbers [{first}, {end}) under {self!r}, onto another coordinate's name; "
                "fix per=/starts= to the number of layers (or experts) each coordinate holds"
            )
        return f"{name[: match.start(1)]}{number}{name[match.end(1) :]}"


@attrs.frozen(repr=False)
class Rename:
    """``re.sub(pattern, replacement, name, count=1)`` wherever ``pattern`` matches.

    >>> Rename(r"^model\\.embed_tokens\\.", "embedding.word_embeddings.").apply("model.embed_tokens.weight", {})
    'embedding.word_embeddings.weight'
    """

    pattern: str
    replacement: str
    _regex: re.Pattern[str] = attrs.field(init=False, eq=False, hash=False)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.replacement, str):
            raise LayoutError(f"Rename {self.pattern!r}: the replacement must be a string, got {self.replacement!r}")
        object.__setattr__(self, "_regex", _compiled(self.pattern))

    def __repr__(self) -> str:
        return f"Rename({self.pattern!r}, {self.replacement!r})"

    def apply(self, name: str, coords: Mapping[str, int]) -> str:
        try:
            return self._regex.sub(self.replacement, name, count=1)
        except (re.error, IndexError) as err:
            raise LayoutError(f"array {name!r}: {self!r} cannot rewrite it: {err}") from None


NameRule = Renumber | Rename


def parse_names(rules: Iterable[object]) -> tuple[NameRule, ...]:
    out = []
    for i, rule in enumerate(rules):
        if not isinstance(rule, Renumber | Rename):
            raise LayoutError(f"name rule #{i} must be a Renumber(...) or Rename(...), got {rule!r}")
        out.append(rule)
    return tuple(out)


def check_names(rules: tuple[NameRule, ...], mesh: Mesh) -> None:
    for rule in rules:
        if isinstance(rule, Renumber):
            if rule.axis not in mesh.axis_names:
                raise LayoutError(f"{rule!r} numbers along axis {rule.axis!r}, which {mesh!r} does not have")
            size = mesh.axis_size(rule.axis)
            if rule.starts is not None and not size <= len(rule.starts) <= size + 1:
                raise LayoutError(
                    f"{rule!r} gives {len(rule.starts)} starts but axis {rule.axis!r} has {size} coordinates; "
                    "give one start per coordinate (and, optionally, the total after them)"
                )


def to_global(rules: tuple[NameRule, ...], names: Iterable[str], coords: Mapping[str, int]) -> dict[str, str]:
    """{local name: global name} on the rank at ``coords``; two local names meeting is an error."""
    out: dict[str, str] = {}
    seen: dict[str, str] = {}
    for name in names:
        mapped = name
        for rule in rules:
            mapped = rule.apply(mapped, coords)
        if mapped in seen:
            raise LayoutError(
                f"arrays {seen[mapped]!r} and {name!r} both map to the global name {mapped!r} under the "
                "layout's name rules; each array needs its own global name"
            )
        seen[mapped] = name
        out[name] = mapped
    return out
