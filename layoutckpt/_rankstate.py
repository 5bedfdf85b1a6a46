"""Per-rank documents: state each rank owns alone (a data loader's position, its RNG state).

Such state is not a shard of a global array, so it has no layout: each rank stores one JSON
document and gets its own back when the world size is unchanged. The documents are the
attributes of Zarr groups (``.rank_state/00003/zarr.json``), so the checkpoint stays a valid
Zarr hierarchy that plain ``zarr`` walks without complaint.
Values are tagged JSON, decoded without running code: dicts (any str/int keys, kept in order),
lists, tuples, None/bool/int/float/str, bytes, and small tensors or arrays (an RNG state from
``torch.get_rng_state()`` goes in as it is) whose bytes are base64.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .base._errors import FormatError, IntegrityError, WorldSizeError
from .format._dtypes import numpy_dtype, zarr_name
from .format._hierarchy import RANK_STATE_DIR
from .layout._tree import _encode_value, decode_value

if TYPE_CHECKING:
    from .storage._location import Location

DIR = RANK_STATE_DIR
# A document is read whole on every load; bulk data belongs in arrays.
MAX_DOCUMENT_BYTES = 64 << 20

Redistribute = Callable[[list[Any], int, int], Any]


ATTRS_KEY = "layoutckpt_rank_state"


def file_name(rank: int) -> str:
    return f"{DIR}/{rank:05d}/zarr.json"


def encode(x: Any, where: str = "rank_state") -> Any:
    if isinstance(x, Mapping):
        for k in x:
            if isinstance(k, bool) or not isinstance(k, str | int):
                raise TypeError(f"{where}: key {k!r} is a {type(k).__name__}; per-rank state keys must be str or int")
        return {"dict": [[k, encode(v, f"{where}[{k!r}]")] for k, v in x.items()]}
    if isinstance(x, list | tuple):
        kind = "list" if isinstance(x, list) else "tuple"
        return {kind: [encode(v, f"{where}[{i}]") for i, v in enumerate(x)]}
    if isinstance(x, bytes):
        return {"bytes": base64.b64encode(x).decode()}
    array = _as_array(x)
    if array is not None:
        data, kind = array
        data = data.astype(data.dtype.newbyteorder("="), copy=False)  # stored little-endian
        if data.nbytes > MAX_DOCUMENT_BYTES:
            raise ValueError(
                f"{where}: a {data.nbytes}-byte array is too large for a per-rank document; save it "
                "as an array of the state, under a layout"
            )
        return {
            "ndarray": {
                "dtype": zarr_name(data.dtype, where),
                "shape": list(data.shape),
                "kind": kind,
                "base64": base64.b64encode(np.ascontiguousarray(data).tobytes()).decode(),
            }
        }
    return _encode_value(x, where)


def _as_array(x: Any) -> tuple[np.ndarray, str] | None:
    if isinstance(x, np.generic):
        return np.asarray(x), "numpy-scalar"
    if isinstance(x, np.ndarray):
        return np.asarray(x), "numpy"
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        from .torch._tensors import to_numpy

        return to_numpy(x.detach().cpu()), "torch"
    return None


def decode(node: Any) -> Any:
    if "dict" in node:
        return {k: decode(v) for k, v in node["dict"]}
    if "list" in node:
        return [decode(v) for v in node["list"]]
    if "tuple" in node:
        return tuple(decode(v) for v in node["tuple"])
    if "bytes" in node:
        return base64.b64decode(node["bytes"])
    if "ndarray" in node:
        return _decode_array(node["ndarray"])
    return decode_value(node)


def _decode_array(a: Any) -> Any:
    shape, raw, dtype = a["shape"], base64.b64decode(a["base64"]), numpy_dtype(a["dtype"])
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise ValueError(f"an array's shape is {shape!r}, not a list of sizes")
    if len(raw) != dtype.itemsize * math.prod(shape):
        raise ValueError(f"an array of shape {shape} holds {len(raw)} bytes of {a['dtype']}")
    data = np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
    if a["kind"] == "numpy-scalar":
        return data[()]
    from .torch._torch import installed

    if a["kind"] == "torch" and installed():  # without torch, NumPy as lc.load gives
        from .torch._tensors import from_numpy

        return from_numpy(data, a["dtype"])
    return data


def document(value: Any, rank: int, world: int) -> bytes:
    """The file one rank writes; raises (naming the bad leaf) before anything is written."""
    state = encode(value)
    body = {"rank": rank, "world": world, "state": state, "sha256": _digest(state)}
    doc = {"zarr_format": 3, "node_type": "group", "attributes": {ATTRS_KEY: body}}
    raw = json.dumps(doc, allow_nan=False).encode()
    if len(raw) > MAX_DOCUMENT_BYTES:
        raise ValueError(f"rank_state of rank {rank} is {len(raw)} bytes as JSON; the limit is {MAX_DOCUMENT_BYTES}")
    return raw


def parse(raw: bytes, where: str, rank: int | None = None) -> Any:
    """The state in a per-rank document; with ``rank``, only if the document is that rank's (a
    document moved to another rank's place is damage, not that rank's state)."""
    try:
        body = json.loads(raw)["attributes"][ATTRS_KEY]
        if rank is not None and body["rank"] != rank:
            raise ValueError(f"it holds the state of rank {body['rank']!r}, not of rank {rank}")
        digest = body.get("sha256")  # absent from documents written before it was added
        if digest is not None and digest != _digest(body["state"]):
            raise IntegrityError(f"{where}: the per-rank state fails its sha256: the document is damaged")
        return decode(body["state"])
    except IntegrityError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
        raise FormatError(f"{where}: the per-rank document is malformed ({err!r}); the checkpoint is corrupt") from None


def _digest(state: Any) -> str:
    """The sha256 of a document's encoded state, over its canonical JSON (keys sorted, no
    spaces): the same whichever JSON writer stored it."""
    canonical = json.dumps(state, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def choose(states: Sequence[Any], rank: int, world: int, redistribute: Redistribute | None, where: str) -> Any:
    """This rank's document; when the world size changed, ``redistribute`` decides."""
    saved = len(states)
    if redistribute is not None and saved != world:
        return redistribute(list(states), rank, world)
    if saved != world:
        raise WorldSizeError(
            f"{where} holds per-rank state of {saved} ranks but this job has {world}; pass "
            "redistribute=fn, where fn(states, rank, world) gets all saved documents (index = saved "
            "rank) and returns this rank's, or read them all with lc.open(path).rank_states()"
        )
    return states[rank]


def saved_world(meta: Any, where: str) -> int:
    """How many ranks saved per-rank documents into the checkpoint ``meta`` describes; a
    ``KeyError`` (the state is optional, not damaged) where it was saved without any."""
    if meta.rank_state_world is None:
        raise KeyError(f"checkpoint {where!r} holds no per-rank state; it was saved without rank_state=")
    return meta.rank_state_world


def read_one(root: Location, rank: int) -> Any:
    name = file_name(rank)
    raw = root.read(name)
    if raw is None:
        raise FormatError(f"checkpoint {root.url!r} lacks the per-rank state of rank {rank} ({name}); it is damaged")
    return parse(raw, f"{root.url}/{name}", rank)


def read_all(root: Location, world: int) -> list[Any]:
    return [read_one(root, r) for r in range(world)]
