"""The on-disk format as frozen values: JSON in, checked once at the edge, JSON out.

``docs/format.md`` is the normative description; this module is its only implementation. The
root group's ``zarr.json`` carries :class:`CheckpointMeta` under the ``"layoutckpt"`` attribute
and is written last: it is the commit marker.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from ..base._errors import FormatError, InvalidNameError, LayoutError, NewerFormatError
from ..layout._spec import Mesh, P
from ..layout._tree import MAX_TREE_DEPTH, leaf_nodes
from ._shard import COMPRESSIONS, compression_json

# 1: first release; 2: chunk keys joined by dots (``c.0.1``); 3: the root document's SHA-256;
# 4: stages, local names, fused and padded tensors: the tree holds global names, each part of a
# fused tensor is its own array (named by ``part_name``), and the chunk grid also admits a padded
# array's pieces (up to one per rank, longer than ``torch.chunk``'s) and finer shards that tile
# every box (row blocks of flat parameters split by tensor parallelism; replica-parallel writes).
# Older readers would call such a checkpoint corrupt; the version makes them say "newer format".
# 5: packed checkpoints (``packing``: the arrays' objects in one OCDBT database, section 3.1).
# 6: bound shards (``save_id``: each shard carries a binding block naming its save, array and
# cell, section 5.4); older readers would read a moved or copied shard as good.
FORMAT_VERSION = 6
# How the arrays' objects are stored: ``files`` (one object per shard and document, what plain
# zarr reads) or ``ocdbt`` (TensorStore's OCDBT key-value store, a few data files per rank).
PACKINGS = ("files", "ocdbt")
ATTRS_KEY = "layoutckpt"
KINDS = ("torch", "numpy", "numpy_scalar")
# The root document's checksum member (format version 3 on): the SHA-256 of the rest of the
# ``layoutckpt`` object in its canonical form (``canonical_json``).
CHECKSUM_KEY = "sha256"
# The root document's save id (format version 6 on): what every shard's binding block names.
SAVE_ID_KEY = "save_id"
_SAVE_ID = re.compile(r"[0-9a-f]{12,32}")

# What a reader accepts before it reads any data (docs/format.md section 8): each bounds the
# memory or work that a crafted root document could make a reader spend. Real checkpoints stay
# far below them: a shard per rank of the largest meshes, inner chunks of a few MiB.
MAX_ROOT_DOCUMENT_BYTES = 1 << 30
MAX_ARRAY_BYTES = 1 << 50
MAX_SHARDS_PER_ARRAY = 1 << 20
MAX_CHUNKS_PER_SHARD = 1 << 22
MAX_INNER_CHUNK_BYTES = 1 << 31
MAX_MESH_SIZE = 1 << 24


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
    # The save id its shards are bound to (their binding blocks, section 5.4), or None for
    # unbound shards. Not stored per array: the checkpoint's ``save_id`` says which. Left out of
    # equality, so that two saves' documents of one array compare (and plan) alike.
    bound_to: str | None = attrs.field(default=None, eq=False)

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
    def from_dict(cls, name: str, d: Any, *, separator: str = ".", bound_to: str | None = None) -> ArrayMeta:
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
                bound_to=bound_to,
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
        _check_geometry(name, meta, zarr_dtypes[meta.dtype].itemsize)
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


def _check_geometry(name: str, meta: ArrayMeta, itemsize: int) -> None:
    """The shapes of one entry are consistent and within the reader's limits (section 8)."""
    problem = geometry_problem(meta.shape, meta.shard_shape, meta.inner_chunk_shape, itemsize)
    if problem:
        raise FormatError(f"array {name!r}: {problem}")


# Layers repeat a handful of shapes: the checks of one are a lookup for the others.
@functools.lru_cache(maxsize=4096)
def geometry_problem(
    shape: tuple[int, ...], shard: tuple[int, ...], inner: tuple[int, ...], itemsize: int
) -> str | None:
    if any(n < 0 for n in shape) or any(s < 1 for s in shard + inner):
        return (
            f"shape {list(shape)} must be >= 0 and shard_shape {list(shard)}, inner_chunk_shape "
            f"{list(inner)} >= 1 in every dimension"
        )
    if any(s % c for s, c in zip(shard, inner)):
        return f"inner_chunk_shape {list(inner)} does not divide shard_shape {list(shard)}"
    limits = (
        (math.prod(shape) * itemsize, MAX_ARRAY_BYTES, "bytes of the array"),
        (math.prod(-(-n // s) for n, s in zip(shape, shard)), MAX_SHARDS_PER_ARRAY, "shards"),
        (math.prod(s // c for s, c in zip(shard, inner)), MAX_CHUNKS_PER_SHARD, "inner chunks per shard"),
        (math.prod(inner) * itemsize, MAX_INNER_CHUNK_BYTES, "bytes of an inner chunk"),
    )
    for value, limit, what in limits:
        if value > limit:
            return f"{value} {what}, above the reader's limit of {limit}"
    return None


GEOMETRY_FIXES = {
    "inner chunks per shard": "pass a larger inner_chunk_bytes",
    "bytes of an inner chunk": "pass a smaller inner_chunk_bytes",
    "shards": "split the array over fewer ranks",
    "bytes of the array": "store it as several arrays",
}


def check_readable(
    name: str, shape: tuple[int, ...], outer: tuple[int, ...], inner: tuple[int, ...], itemsize: int, chunk: int
) -> None:
    """Refuse an array that no reader would open, before a byte is written: a save (or an import)
    must never commit what ``lc.open`` refuses as corrupt. ``chunk`` is the ``inner_chunk_bytes``
    it was given. The same on every rank: the plan is."""
    problem = geometry_problem(shape, outer, inner, itemsize)
    if problem is not None:
        fix = next((f for what, f in GEOMETRY_FIXES.items() if what in problem), "save it differently")
        raise LayoutError(f"array {name!r} cannot be saved with inner_chunk_bytes={chunk}: {problem}; {fix}")


def _check_grid(name: str, meta: ArrayMeta, mesh: Mesh) -> None:
    """The chunk grid is the one the spec cuts on the mesh (section 5.2): ``shard_shape[d] =
    max(1, ceil(shape[d] / k_d))``, or longer pieces still one per rank (a padded array's); a
    dimension the spec does not split holds the whole extent; or a finer grid whose shards
    tile every box (replica-parallel writes, a flat buffer's row blocks)."""
    problem = _grid_problem(meta.shape, meta.shard_shape, meta.spec, mesh)
    if problem:
        raise FormatError(f"array {name!r}: {problem}; the metadata is corrupt")


@functools.lru_cache(maxsize=4096)
def _grid_problem(shape: tuple[int, ...], shard: tuple[int, ...], spec: P, mesh: Mesh) -> str | None:
    from ..layout._plan import split_counts

    if len(spec) > len(shape):
        return f"spec {spec.to_json()} has more entries than the array's {len(shape)} dimensions"
    missing = [axis for axis in spec.axes if axis not in mesh.axis_names]
    if missing:
        return f"spec {spec.to_json()} names axes {missing} that its mesh {mesh.to_json()} lacks"
    counts = split_counts(len(shape), spec, mesh)
    for d, (n, s, k) in enumerate(zip(shape, shard, counts)):
        expected = max(1, -(-n // k))
        # A padded array's pieces are longer than torch.chunk's but still one per rank.
        padded = k > 1 and s > expected and -(-n // s) <= k
        # A box may be stored as several shards (replicas share its write; a flat buffer's
        # parameters are stored in row blocks): each box is then whole shards.
        finer = s < expected and (k == 1 or d == 0 or expected % s == 0)
        if s != expected and not padded and not finer:
            return (
                f"shard_shape {list(shard)} is not the grid its spec {spec.to_json()} cuts from shape "
                f"{list(shape)} on {mesh.to_json()} (dimension {d}: expected {expected})"
            )
    return None


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
    packing: str = "files"
    # The id of the save that wrote the shards (12 to 32 lowercase hex digits), which each
    # shard's binding block names (format version 6 on); None: the shards are not bound.
    save_id: str | None = None
    # A packed checkpoint's writer rules: ``{array: (start, step)}``, the shard at C-order index
    # ``i`` of the array's grid written by rank ``start + step * i`` into its own database under
    # ``packs/`` (section 3.1). A hint for readers, absent where no rule holds.
    writers: Mapping[str, tuple[int, int]] = attrs.field(factory=dict)

    @property
    def packed(self) -> bool:
        return self.packing != "files"

    @functools.cached_property
    def leaves(self) -> dict[str, Mapping[str, Any]]:
        """``{global name: node}`` of every leaf of ``tree``, in tree order: worked out once,
        as a load asks for it several times."""
        return dict(leaf_nodes(self.tree))

    def bound(self, save_id: str | None) -> CheckpointMeta:
        """This metadata for the save ``save_id``: every array's shards bound to it (None:
        unbound), so that the writers add the binding blocks the root document promises."""
        if save_id is not None and not _SAVE_ID.fullmatch(save_id):
            raise ValueError(f"a save id is 12 to 32 lowercase hex digits, got {save_id!r}")
        arrays = {name: attrs.evolve(a, bound_to=save_id) for name, a in self.arrays.items()}
        return attrs.evolve(self, arrays=arrays, save_id=save_id)

    def to_dict(self) -> dict[str, Any]:
        optional: dict[str, Any] = {}
        if self.packed:
            optional["packing"] = self.packing
        if self.rank_state_world is not None:
            optional["rank_state_world"] = self.rank_state_world
        if self.all_chunks_stored:
            optional["all_chunks_stored"] = True
        if self.save_id is not None:
            optional[SAVE_ID_KEY] = self.save_id
        if self.writers:
            optional["writers"] = {name: list(rule) for name, rule in self.writers.items()}
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
            mesh = Mesh.from_json(d["mesh"])
            if mesh.size > MAX_MESH_SIZE:
                raise FormatError(f"{where}: a mesh of {mesh.size} ranks, above the reader's limit of {MAX_MESH_SIZE}")
            save_id = _save_id(d.get(SAVE_ID_KEY), version, where)
            arrays = _parse_arrays(d["arrays"], version, mesh, where, save_id)
            step = d.get("step")
            if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
                raise FormatError(f"{where}: step must be an integer or null, got {step!r}")
            _check_tree_matches(d["tree"], arrays, where)
            rank_state_world = d.get("rank_state_world")
            if rank_state_world is not None and (
                not isinstance(rank_state_world, int)
                or isinstance(rank_state_world, bool)
                or not 1 <= rank_state_world <= MAX_MESH_SIZE
            ):
                raise FormatError(f"{where}: rank_state_world must be a positive integer or absent")
            user_metadata = d.get("user_metadata") or {}
            if not isinstance(user_metadata, Mapping):
                raise FormatError(f"{where}: user_metadata must be an object, got {type(user_metadata).__name__}")
            return cls(
                arrays=arrays,
                tree=d["tree"],
                mesh=mesh,
                rules=tuple((str(p), P.from_json(s)) for p, s in d["rules"]),
                step=step,
                user_metadata=dict(user_metadata),
                library_version=str(d.get("library_version", "")),
                format_version=version,
                rank_state_world=rank_state_world,
                all_chunks_stored=d.get("all_chunks_stored") is True,
                packing=_packing(d.get("packing", "files"), version, where),
                save_id=save_id,
                writers=_writer_rules(d.get("writers", {}), arrays, where),
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


def _packing(packing: Any, version: int, where: str) -> str:
    if packing not in PACKINGS or (packing != "files" and version < 5):
        raise FormatError(
            f"{where}: unknown packing {packing!r} for format version {version} (expected one of {PACKINGS})"
        )
    return packing


def _writer_rules(rules: Any, arrays: Mapping[str, ArrayMeta], where: str) -> dict[str, tuple[int, int]]:
    if not isinstance(rules, Mapping):
        raise FormatError(f"{where}: writers must be an object, got {type(rules).__name__}")
    out = {}
    for name, rule in rules.items():
        if (
            name not in arrays
            or not isinstance(rule, list)
            or len(rule) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in rule)
        ):
            raise FormatError(
                f"{where}: writers names {str(name)[:80]!r} with {str(rule)[:80]!r}; expected a stored "
                "array and [start, step]; the checkpoint's metadata is corrupt"
            )
        out[name] = (rule[0], rule[1])
    return out


def _save_id(save_id: Any, version: int, where: str) -> str | None:
    if save_id is None:
        return None
    if version < 6 or not isinstance(save_id, str) or not _SAVE_ID.fullmatch(save_id):
        raise FormatError(
            f"{where}: {SAVE_ID_KEY} {str(save_id)[:80]!r} is invalid for format version {version} (expected "
            "12 to 32 lowercase hex digits, from version 6 on); the checkpoint's metadata is corrupt"
        )
    return save_id


def new_save_id() -> str:
    """A fresh save id: 32 random hex digits."""
    return uuid.uuid4().hex


def _parse_arrays(
    entries: Any, version: int, mesh: Mesh, where: str, save_id: str | None = None
) -> dict[str, ArrayMeta]:
    """The array entries, each checked alone (4.1) and against the mesh its spec names (5.2)."""
    # Version 1 nested each chunk key's parts as directories (``c/0/1``); later versions keep
    # them in one file name (``c.0.1``): a quarter fewer files and directories to create.
    separator = "/" if version == 1 else "."
    arrays = {}
    try:
        for name, entry in entries.items():
            a = ArrayMeta.from_dict(name, entry, separator=separator, bound_to=save_id)
            own = a.mesh or mesh
            if own.size != mesh.size:
                raise FormatError(f"array {name!r}: its mesh has {own.size} ranks, the checkpoint's {mesh.size}")
            _check_grid(name, a, own)
            arrays[str(name)] = a
    except FormatError as err:
        raise FormatError(f"{where}: {err}; the checkpoint's metadata is corrupt") from None
    return arrays


def _check_tree_matches(tree: Any, arrays: Mapping[str, ArrayMeta], where: str) -> None:
    """The tree is well formed, no deeper than ``MAX_TREE_DEPTH``, and every array node of it
    has an entry in ``arrays``, and every entry a node (an alias names a stored array)."""
    named: set[str] = set()
    stack: list[tuple[Any, int]] = [(tree, 0)]
    first = True
    while stack:
        node, depth = stack.pop()
        problem = _node_problem(node, depth, root=first)
        first = False
        if problem:
            raise FormatError(f"{where}: the tree structure is malformed ({problem}); the checkpoint is corrupt")
        ((kind, body),) = node.items()
        if kind == "dict":
            stack.extend((child, depth + 1) for _, child in body)
        elif kind in ("list", "tuple"):
            stack.extend((child, depth + 1) for child in body)
        elif kind == "array":
            named.add(body)
    missing = sorted(named - set(arrays))
    unreferenced = sorted(set(arrays) - named)
    if missing or unreferenced:
        raise FormatError(
            f"{where}: the tree and the arrays table disagree (tree-only: {missing[:5]}, "
            f"table-only: {unreferenced[:5]}); the checkpoint is corrupt"
        )


def _node_problem(node: Any, depth: int, *, root: bool) -> str | None:
    """What is wrong with one tree node (section 6), or None."""
    if depth > MAX_TREE_DEPTH:
        return f"nested deeper than {MAX_TREE_DEPTH} levels"
    if type(node) is not dict or len(node) != 1:
        return f"a node must be an object with one member, got {str(node)[:80]}"
    ((kind, body),) = node.items()
    if root and kind not in ("dict", "list", "tuple"):
        return f"the root must be a dict, list or tuple node, got {kind!r}"
    if kind == "dict":
        ok = type(body) is list and all(type(e) is list and len(e) == 2 and type(e[0]) in (str, int) for e in body)
        return None if ok else "a dict node must hold [key, node] pairs with str or int keys"
    if kind in ("list", "tuple"):
        return None if type(body) is list else f"a {kind} node must hold a list"
    if kind == "array":
        return None if type(body) is str else "an array node must hold a name"
    if kind == "value":
        return None if body is None or type(body) in (bool, int, float, str) else "a value node must hold a JSON scalar"
    if kind == "float":
        return None if body in ("nan", "inf", "-inf") else "a float node must hold 'nan', 'inf' or '-inf'"
    return f"unknown node kind {kind!r}"


def canonical_json(value: Any) -> bytes:
    """The canonical form the root checksum covers (section 4): compact JSON, members in their
    stored order, non-ASCII characters escaped, numbers as Python writes them."""
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()


def checksum(body: Mapping[str, Any]) -> str:
    """The SHA-256 (hex) of the ``layoutckpt`` object without its checksum member."""
    return hashlib.sha256(canonical_json({k: v for k, v in body.items() if k != CHECKSUM_KEY})).hexdigest()


# How a root document begins, as layoutckpt writes it: its body follows, then the checksum member.
_ROOT_HEAD = b'{"zarr_format":3,"node_type":"group","attributes":{"' + ATTRS_KEY.encode() + b'":'
_CHECKSUM_MEMBER = b',"' + CHECKSUM_KEY.encode() + b'":"'


def root_document(meta: CheckpointMeta) -> bytes:
    # Compact: opening a checkpoint reads this document, and indentation doubles its size (and
    # makes json fall back to its slower pure-Python encoder).
    body = canonical_json(meta.to_dict())
    if meta.format_version < 3:
        return _ROOT_HEAD + body + b"}}"
    # The checksum covers the canonical body without its own member: encoded once, hashed, and
    # the member spliced in before the closing brace, as section 4 describes a compact writer.
    digest = hashlib.sha256(body).hexdigest().encode()
    return _ROOT_HEAD + body[:-1] + _CHECKSUM_MEMBER + digest + b'"}}}'


def _compact_digest(raw: bytes) -> str | None:
    """The checksum of a root document as ``root_document`` writes it, from its bytes: the
    canonical body is the bytes between the head and the spliced ``sha256`` member, so a
    reader hashes them without encoding the parsed body again. None for any other form (a
    reader then re-serializes, as section 4 says)."""
    tail = len(_CHECKSUM_MEMBER) + 64 + len(b'"}}}')
    if not raw.startswith(_ROOT_HEAD) or len(raw) < len(_ROOT_HEAD) + tail:
        return None
    return hashlib.sha256(raw[len(_ROOT_HEAD) : len(raw) - tail] + b"}").hexdigest()


def group_document() -> bytes:
    return json.dumps(GROUP_DOCUMENT).encode()


# What every group on the way to an array holds (section 3), and ``.rank_state``.
GROUP_DOCUMENT = {"zarr_format": 3, "node_type": "group", "attributes": {}}


def parse_json(raw: bytes, what: str) -> Any:
    """``raw`` as strict JSON; ``FormatError`` naming ``what`` if it is not (nesting too deep for
    the parser, or the ``NaN`` and ``Infinity`` tokens the format forbids, included)."""

    def refuse(token: str) -> Any:
        raise ValueError(f"the token {token} is not strict JSON")

    try:
        return json.loads(raw, parse_constant=refuse)
    except (UnicodeDecodeError, ValueError) as err:
        raise FormatError(f"{what} is not valid JSON ({err}); the checkpoint is corrupt") from None
    except RecursionError:
        raise FormatError(
            f"{what} is nested too deeply to be a layoutckpt document; the checkpoint is corrupt"
        ) from None


# Root documents parsed lately, by their bytes: opening a step reads its root document several
# times (a manager's listing, the tiers' agreement on a restore, the load itself), and checking a
# large one (every array's geometry) is most of what opening costs. Equal bytes parse to equal,
# immutable metadata; failures are not kept, so each is raised with its own ``where``.
_PARSED_KEPT = 4
_PARSED_MAX_BYTES = 16 << 20


def parse_root_document(raw: bytes, where: str, *, keep: bool = True) -> CheckpointMeta:
    """The checked metadata of the root ``zarr.json`` ``raw``; ``FormatError`` naming ``where``.
    ``keep=False`` for a document parsed once (a replica's header): kept, its objects would
    outlive the steps that use them."""
    if keep and len(raw) <= _PARSED_MAX_BYTES:
        return _parse_kept(bytes(raw), where)
    return _parse_root_document(raw, where)


@functools.lru_cache(maxsize=_PARSED_KEPT)
def _parse_kept(raw: bytes, where: str) -> CheckpointMeta:
    return _parse_root_document(raw, where)


def _parse_root_document(raw: bytes, where: str) -> CheckpointMeta:
    if len(raw) > MAX_ROOT_DOCUMENT_BYTES:
        raise FormatError(
            f"{where}: zarr.json is {len(raw)} bytes, above the reader's limit of {MAX_ROOT_DOCUMENT_BYTES}"
        )
    doc = parse_json(raw, f"{where}: zarr.json")
    if not isinstance(doc, dict) or doc.get("zarr_format") != 3 or doc.get("node_type") != "group":
        raise FormatError(f"{where}: zarr.json is not a Zarr v3 group document")
    attributes = doc.get("attributes")
    if not isinstance(attributes, dict) or ATTRS_KEY not in attributes:
        raise FormatError(f"{where}: a Zarr group without {ATTRS_KEY!r} metadata; not a layoutckpt checkpoint")
    body = attributes[ATTRS_KEY]
    meta = CheckpointMeta.from_dict(body, where)
    if meta.format_version >= 3:
        # Checked after the structure, so that a malformed document is named for what is wrong
        # with it; a well-formed one that was edited (a step, a shape) fails here.
        stored = body.get(CHECKSUM_KEY)
        try:
            actual = stored if _compact_digest(raw) == stored else checksum(body)
        except ValueError:
            actual = None
        if stored != actual:
            raise FormatError(
                f"{where}: zarr.json fails its checksum (its {CHECKSUM_KEY!r} member is {str(stored)[:80]!r}): "
                "the metadata was changed after the save or is damaged; restore the checkpoint from a copy"
            )
    return meta
