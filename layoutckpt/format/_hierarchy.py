"""The Zarr documents around a checkpoint's arrays, and the user metadata its marker holds.

Every group on the way to an array, and every array, has its own ``zarr.json``, so plain
``zarr`` walks the hierarchy (``docs/format.md``); the root document is the commit marker
(``_format.root_document``), written last. Whoever writes a checkpoint (``save``, on every
rank; ``import_safetensors``) writes these documents from here.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator, Mapping
from typing import Any

from ._format import ArrayMeta, CheckpointMeta, group_document

# The group of the per-rank documents (``_rankstate``): ``.rank_state/00003/zarr.json``.
RANK_STATE_DIR = ".rank_state"


def user_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """User metadata as it is stored, strict JSON in the commit marker: checked, and copied as
    of this call (a save commits later, and a caller may change its dict meanwhile)."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise TypeError(f"metadata= must be a dict of JSON values, got {type(metadata).__name__}")
    out = {}
    for key, value in metadata.items():
        try:
            out[key] = json.loads(json.dumps(value, allow_nan=False))
        except (TypeError, ValueError) as err:
            raise TypeError(
                f"metadata[{key!r}] cannot be stored as JSON ({err}); use str/int/float/bool/None, "
                "lists and dicts of them, with finite floats"
            ) from None
        if not isinstance(key, str):
            raise TypeError(f"metadata key {key!r} must be a str")
    return out


def documents(meta: CheckpointMeta, rank: int = 0, world: int = 1) -> Iterator[tuple[str, bytes]]:
    """``(key, document)`` of rank ``rank``'s share of the group and array documents (all of
    them for a world of one). Shared round-robin: a model has hundreds of them, and one rank
    writing all would hold up the commit; each rank encodes only its own share."""
    groups: set[str] = set()
    docs: list[tuple[str, bytes | None]] = []
    for a in meta.arrays.values():
        parts = a.path.split("/")
        groups.update("/".join(parts[:i]) for i in range(1, len(parts)))
        docs.append((a.path, None))
    if meta.rank_state_world is not None:
        groups.add(RANK_STATE_DIR)
    docs.extend((g, group_document()) for g in sorted(groups))
    arrays = {a.path: a for a in meta.arrays.values()}
    for path, doc in docs[rank::world]:
        yield f"{path}/zarr.json", doc or array_document(arrays[path])


# A manager saves the same arrays step after step (a tier every step): their documents are
# encoded once. ``ArrayMeta`` is a frozen value, so equal arrays share the bytes.
@functools.lru_cache(maxsize=1 << 14)
def array_document(meta: ArrayMeta) -> bytes:
    """The array's ``zarr.json`` as written."""
    return json.dumps(meta.zarr_metadata()).encode()
