"""The on-disk format as frozen values: JSON in, checked once at the edge, JSON out.

``docs/format.md`` is the normative description; this module is its only implementation. The
root group's ``zarr.json`` carries :class:`CheckpointMeta` under the ``"layoutckpt"`` attribute
and is written last: it is the commit marker.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from ..base._errors import FormatError, InvalidNameError, NewerFormatError
from ..layout._spec import Mesh, P
from ._shard import COMPRESSIONS, compression_json

FORMAT_VERSION = 2
ATTRS_KEY = "layoutckpt"
KINDS = ("torch", "numpy", "numpy_scalar")


def _ints(value: Any, what: str) -> tuple[int, ...]:
    # ``type(v) is int`` turns bools away too, in a quarter less time than two isinstance calls
    # (three times per array when a checkpoint is opened).
    if type(value) is not list or any(type(v) is not int for v in value):
        raise FormatError(f"{what} must be a list of integers, got {value!r}")
    return tuple(value)


@functools.cache
def _parse_helpers() -> tuple[Mapping[str, Any], Callable[[str], str]]:
    """What ``ArrayMeta.from_dict`` checks an entry against, imported once and kept: opening a
    checkpoint parses every array entry, and an import statement per entry would be a large
    share of that time."""
    from ..layout._tree import name_to_path
    from ._dtypes import ZARR_TO_NUMPY

    return ZARR_TO_NUMPY, name_to_path


@attrs.frozen
class ArrayMeta:
    """One stored array: where it lives, its global shape and dtype, and how it is chunked."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    shard_shape: tuple[int, ...]
    inner_chunk_shape: tuple[int, ...]
    spec: P
    kind: str = "torch"
    compression: str | None = None
    # The mesh ``spec`` names, where it is not the checkpoint's (a DTensor on its own mesh).
    mesh: Mesh | None = None
    # What joins the parts of a shard's chunk key: ``c.0.1`` since format version 2, ``c/0/1``
    # in version 1. Not stored per array: the checkpoint's format version says which.
    separator: str = "."

    def chunk_key(self, cell: Sequence[int]) -> str:
        """The key of the shard at grid ``cell``, under the array's path: ``c.0.1``; ``c`` if 0-d."""
        return self.separator.join(["c", *map(str, cell)])

    @property
    def itemsize(self) -> int:
        from ._dtypes import numpy_dtype

        return numpy_dtype(self.dtype).itemsize

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "shard_shape": list(self.shard_shape),
            "inner_chunk_shape": list(self.inner_chunk_shape),
            "spec": self.spec.to_json(),
            "kind": self.kind,
            "compression": self.compression,
            **({"mesh": self.mesh.to_json()} if self.mesh is not None else {}),
        }

    @classmethod
    def from_dict(cls, name: str, d: Any, *, separator: str = ".") -> ArrayMeta:
        if not isinstance(d, Mapping):
            raise FormatError(f"array {name!r}: metadata must be an object, got {d!r}")
        try:
            meta = cls(
                path=str(d["path"]),
                shape=_ints(d["shape"], f"array {name!r}: shape"),
                dtype=str(d["dtype"]),
                shard_shape=_ints(d["shard_shape"], f"array {name!r}: shard_shape"),
                inner_chunk_shape=_ints(d["inner_chunk_shape"], f"array {name!r}: inner_chunk_shape"),
                spec=P.from_json(d["spec"]),
                kind=str(d.get("kind", "torch")),
                compression=d.get("compression"),
                mesh=Mesh.from_json(d["mesh"]) if d.get("mesh") is not None else None,
                separator=separator,
            )
        except FormatError:
            raise
        except KeyError as err:
            raise FormatError(f"array {name!r}: metadata lacks the key {err.args[0]!r}") from None
        except (TypeError, ValueError) as err:
            raise FormatError(f"array {name!r}: metadata is malformed ({err!r})") from None
        if not len(meta.shape) == len(meta.shard_shape) == len(meta.inner_chunk_shape):
            raise FormatError(f"array {name!r}: shape, shard_shape and inner_chunk_shape differ in rank")
        if meta.kind not in KINDS or meta.compression not in COMPRESSIONS:
            raise FormatError(f"array {name!r}: unknown kind {meta.kind!r} or compression {meta.compression!r}")
        zarr_dtypes, name_to_path = _parse_helpers()
        if meta.dtype not in zarr_dtypes:
            raise FormatError(f"array {name!r}: unknown data type {meta.dtype!r}; known: {sorted(zarr_dtypes)}")
        # The path is derived from the name, never trusted: an absolute path in a crafted root
        # document would otherwise make readers open files outside the checkpoint.
        try:
            expected_path = name_to_path(str(name))
        except InvalidNameError as err:
            raise FormatError(f"array {name!r}: the stored name is invalid ({err})") from None
        if meta.path != expected_path:
            raise FormatError(f"array {name!r}: stored path {meta.path!r} is not {expected_path!r}, its name's path")
        return meta

    def zarr_metadata(self) -> dict[str, Any]:
        """The array's Zarr v3 ``zarr.json``: a regular grid of shards, each a writer's box."""
        fill: Any = False if self.dtype == "bool" else 0
        inner_codecs = [
            {"name": "bytes", "configuration": {"endian": "little"}},
            *compression_json(self.compression, self.itemsize),
            {"name": "crc32c"},
        ]
        return {
            "zarr_format": 3,
            "node_type": "array",
            "shape": list(self.shape),
            "data_type": self.dtype,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(self.shard_shape)}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": self.separator}},
            "fill_value": fill,
            "codecs": [
                {
                    "name": "sharding_indexed",
                    "configuration": {
                        "chunk_shape": list(self.inner_chunk_shape),
                        "codecs": inner_codecs,
                        "index_codecs": [
                            {"name": "bytes", "configuration": {"endian": "little"}},
                            {"name": "crc32c"},
                        ],
                        "index_location": "end",
                    },
                }
            ],
            "attributes": {ATTRS_KEY: {"spec": self.spec.to_json()}},
        }


@attrs.frozen
class CheckpointMeta:
    """Everything a reader needs, in one small document: opening a checkpoint is one read."""

    arrays: Mapping[str, ArrayMeta]
    tree: Any
    mesh: Mesh
    rules: tuple[tuple[str, P], ...]
    step: int | None = None
    user_metadata: Mapping[str, Any] = attrs.field(factory=dict)
    library_version: str = ""
    format_version: int = FORMAT_VERSION
    # The number of per-rank JSON documents (one per saving rank), or None when there are none.
    rank_state_world: int | None = None
    # Every chunk was stored, all-zero ones included, so a missing one is damage. Checkpoints
    # of the first releases omitted all-zero chunks and lack the member.
    all_chunks_stored: bool = False

    def to_dict(self) -> dict[str, Any]:
        optional: dict[str, Any] = {}
        if self.rank_state_world is not None:
            optional["rank_state_world"] = self.rank_state_world
        if self.all_chunks_stored:
            optional["all_chunks_stored"] = True
        return {
            "format_version": self.format_version,
            "library_version": self.library_version,
            "arrays": {name: a.to_dict() for name, a in self.arrays.items()},
            "tree": self.tree,
            "mesh": self.mesh.to_json(),
            "rules": [[p, s.to_json()] for p, s in self.rules],
            "step": self.step,
            "user_metadata": dict(self.user_metadata),
            **optional,
        }

    @classmethod
    def from_dict(cls, d: Any, where: str = "checkpoint") -> CheckpointMeta:
        if not isinstance(d, Mapping):
            raise FormatError(f"{where}: the {ATTRS_KEY!r} metadata must be an object")
        version = d.get("format_version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise FormatError(
                f"{where}: unknown format version {version!r} (expected an integer from 1 to {FORMAT_VERSION}); "
                "the metadata is corrupt or this is not a layoutckpt checkpoint"
            )
        if version > FORMAT_VERSION:
            raise NewerFormatError(
                f"{where}: written with layoutckpt format version {version} (by layoutckpt "
                f"{d.get('library_version', '?')}), but this layoutckpt reads versions up to "
                f"{FORMAT_VERSION}; upgrade layoutckpt to read it"
            )
        try:
            try:
                # Version 1 nested each chunk key's parts as directories (``c/0/1``); version 2
                # keeps them in one file name (``c.0.1``): a quarter fewer files and directories
                # to create, each of which costs more than its bytes.
                separator = "/" if version == 1 else "."
                arrays = {
                    str(name): ArrayMeta.from_dict(name, a, separator=separator) for name, a in d["arrays"].items()
                }
            except FormatError as err:
                raise FormatError(f"{where}: {err}; the checkpoint's metadata is corrupt") from None
            step = d.get("step")
            if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
                raise FormatError(f"{where}: step must be an integer or null, got {step!r}")
            _check_tree_matches(d["tree"], arrays, where)
            rank_state_world = d.get("rank_state_world")
            if rank_state_world is not None and (
                not isinstance(rank_state_world, int) or isinstance(rank_state_world, bool) or rank_state_world < 1
            ):
                raise FormatError(f"{where}: rank_state_world must be a positive integer or absent")
            return cls(
                arrays=arrays,
                tree=d["tree"],
                mesh=Mesh.from_json(d["mesh"]),
                rules=tuple((str(p), P.from_json(s)) for p, s in d["rules"]),
                step=step,
                user_metadata=dict(d.get("user_metadata") or {}),
                library_version=str(d.get("library_version", "")),
                format_version=version,
                rank_state_world=rank_state_world,
                all_chunks_stored=d.get("all_chunks_stored") is True,
            )
        except FormatError:
            raise
        except KeyError as err:
            raise FormatError(
                f"{where}: the {ATTRS_KEY!r} metadata lacks the key {err.args[0]!r}; the checkpoint is corrupt"
            ) from None
        except (TypeError, ValueError, AttributeError) as err:
            raise FormatError(
                f"{where}: the {ATTRS_KEY!r} metadata is malformed ({err!r}); the checkpoint is corrupt"
            ) from None


def _check_tree_matches(tree: Any, arrays: Mapping[str, ArrayMeta], where: str) -> None:
    """Every array node of the tree has an entry in ``arrays``, and every entry a node."""
    from ..layout._tree import leaf_nodes

    try:
        named = [node["array"] for _, node in leaf_nodes(tree) if "array" in node]
    except (TypeError, KeyError, ValueError, AttributeError) as err:
        raise FormatError(f"{where}: the tree structure is malformed ({err!r}); the checkpoint is corrupt") from None
    missing = sorted(set(named) - set(arrays))
    unreferenced = sorted(set(arrays) - set(named))
    if missing or unreferenced:
        raise FormatError(
            f"{where}: the tree and the arrays table disagree (tree-only: {missing[:5]}, "
            f"table-only: {unreferenced[:5]}); the checkpoint is corrupt"
        )


def root_document(meta: CheckpointMeta) -> bytes:
    doc = {"zarr_format": 3, "node_type": "group", "attributes": {ATTRS_KEY: meta.to_dict()}}
    # Compact: opening a checkpoint reads this document, and indentation doubles its size (and
    # makes json fall back to its slower pure-Python encoder).
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def group_document() -> bytes:
    return json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}).encode()


def parse_root_document(raw: bytes, where: str) -> CheckpointMeta:
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise FormatError(f"{where}: zarr.json is not valid JSON ({err}); the checkpoint is corrupt") from None
    if not isinstance(doc, dict) or doc.get("zarr_format") != 3 or doc.get("node_type") != "group":
        raise FormatError(f"{where}: zarr.json is not a Zarr v3 group document")
    attributes = doc.get("attributes")
    if not isinstance(attributes, dict) or ATTRS_KEY not in attributes:
        raise FormatError(f"{where}: a Zarr group without {ATTRS_KEY!r} metadata; not a layoutckpt checkpoint")
    return CheckpointMeta.from_dict(attributes[ATTRS_KEY], where)
