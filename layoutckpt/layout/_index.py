"""NumPy indexes as boxes: what a read must fetch, and what it then takes from it in memory."""

from __future__ import annotations

from typing import Any

import numpy as np

from ._plan import Box


def _is_basic(term: Any) -> bool:
    if isinstance(term, bool | np.bool_):
        return False
    return term is Ellipsis or isinstance(term, slice | int | np.integer)


def index_box(index: Any, shape: tuple[int, ...], name: str) -> tuple[Box, Any]:
    """The box that covers ``array[index]`` and the index that takes the selection from that
    box (``None`` when the box is the selection itself).

    Indexes mean what they mean to NumPy: negative positions count from the end, slices clip at
    the ends, steps and reversals are taken in memory from the covering box. An index of another
    kind (``None`` as NumPy's new axis, arrays, lists, booleans) covers the whole array and is
    applied as NumPy applies it. ``...`` is the whole array. A position out of range raises
    ``IndexError`` naming the array.
    """
    whole = tuple((0, n) for n in shape)
    terms = index if isinstance(index, tuple) else (index,)
    if not all(_is_basic(t) for t in terms) or terms.count(Ellipsis) > 1:
        return whole, terms
    if Ellipsis in terms:
        at = terms.index(Ellipsis)
        terms = terms[:at] + (slice(None),) * (len(shape) - len(terms) + 1) + terms[at + 1 :]
    if len(terms) > len(shape):
        raise IndexError(f"{len(terms)} indices for {name!r}, which has {len(shape)} dimensions {list(shape)}")
    terms = terms + (slice(None),) * (len(shape) - len(terms))
    box, post = [], []
    for dim, (t, n) in enumerate(zip(terms, shape)):
        if not isinstance(t, slice):
            if not -n <= t < n:
                raise IndexError(f"index {t} is out of range for dimension {dim} of {name!r}, of size {n}")
            box.append((int(t) % n, int(t) % n + 1))
            post.append(0)
            continue
        picked = range(*t.indices(n))
        if not picked:
            box.append((0, 0))
            post.append(slice(None))
            continue
        lo, hi = min(picked), max(picked) + 1
        box.append((lo, hi))
        post.append(slice(picked.start - lo, None, picked.step) if picked.step < 0 else slice(None, None, picked.step))
    plain = all(p == slice(None) or p == slice(None, None, 1) for p in post)
    return tuple(box), None if plain else tuple(post)
