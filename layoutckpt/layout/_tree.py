"""Pytrees of nested dicts, lists and tuples: flatten to global names and rebuild.

A leaf's global name joins the keys on its path with dots (``{"model": {"layers": [w]}}`` gives
``model.layers.0``); the name maps to the storage path ``model/layers/0``. The tree's shape is
stored as JSON, so rebuilding it never runs code.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from ..base._errors import InvalidNameError

JSONScalar = None | bool | int | float | str

# Characters that would escape the name's directory, or that stores treat specially.
_BAD_CHARS = re.compile(r"[/\\\x00-\x1f\x7f]")
# A part is a directory or file name: file systems cap those at 255 bytes (NAME_MAX). The whole
# storage path is capped well below PATH_MAX (4096 bytes), which must also hold the directory
# the checkpoint is in, its temporary name and a chunk key (docs/format.md section 2.1).
MAX_PART_BYTES = 255
MAX_PATH_BYTES = 2048
# How deep a state's tree may nest: a reader refuses deeper trees (docs/format.md section 9).
MAX_TREE_DEPTH = 256


_NUMPY_LEAVES = (np.ndarray, np.generic)


def is_array_leaf(x: object) -> bool:
    torch = sys.modules.get("torch")  # a tensor cannot exist before torch is imported
    return (torch is not None and isinstance(x, torch.Tensor)) or isinstance(x, _NUMPY_LEAVES)


@functools.lru_cache(maxsize=65536)  # the same names, save after save
def name_to_path(name: str) -> str:
    """``model.layers.0.weight`` -> ``model/layers/0/weight``, refusing names that are unsafe."""
    parts = name.split(".")
    if not name.isascii():
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidNameError(
                f"array name {name!r} is not valid Unicode text (it holds a lone surrogate, as a name decoded "
                "from bytes with surrogateescape does), so it has no UTF-8 storage path; rename the key"
            ) from None
    if _utf8_len(name) > MAX_PATH_BYTES:
        raise InvalidNameError(
            f"array name {name[:64]!r}... is {_utf8_len(name)} bytes as a storage path, above the "
            f"limit of {MAX_PATH_BYTES}; use shorter keys in the state"
        )
    for part in parts:
        problem = None
        if _utf8_len(part) > MAX_PART_BYTES:
            problem = f"a part of {_utf8_len(part)} bytes ({part[:32]!r}...), longer than a file name may be"
        elif part == "":
            problem = "an empty part (two dots in a row, or a leading or trailing dot)"
        elif _BAD_CHARS.search(part):
            problem = f"part {part!r} with a slash, backslash or control character"
        elif part.startswith("__"):
            problem = f"part {part!r}, and names starting with '__' are reserved by Zarr"
        if problem:
            raise InvalidNameError(
                f"array name {name!r} has {problem}; rename the key in the state so that every "
                "dot-separated part is a plain, non-empty name"
            )
    return "/".join(parts)


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _key_str(key: object, where: str) -> str:
    if type(key) is str:
        return key
    if isinstance(key, bool) or not isinstance(key, str | int):
        raise InvalidNameError(
            f"key {key!r} under {where or 'the root'!r} is a {type(key).__name__}, but keys must be a str or "
            "an int; rename the key to a str"
        )
    return str(key)


def _encode_value(x: object, name: str) -> Any:
    if x is None or isinstance(x, bool | int | str):
        return {"value": x}
    if isinstance(x, float):
        if math.isfinite(x):
            return {"value": x}
        return {"float": repr(x)}
    raise TypeError(
        f"leaf {name!r} has type {type(x).__name__}, which layoutckpt cannot store: leaves must be "
        "tensors, NumPy arrays, or None/bool/int/float/str (stored as JSON; never pickle). Convert "
        "it to one of those, e.g. a dict of plain values"
    )


def decode_value(node: Mapping[str, Any]) -> JSONScalar:
    if "float" in node:
        return float(node["float"])
    return node["value"]


def flatten(state: object) -> tuple[Any, dict[str, Any]]:
    """(JSON structure, {global name: leaf}) for a nested dict/list/tuple of leaves."""
    if not isinstance(state, Mapping | list | tuple):
        raise TypeError(f"the state must be a dict, list or tuple of leaves, got {type(state).__name__}")
    leaves: dict[str, Any] = {}
    structure = _flatten(state, "", leaves, 0)
    check_no_prefix_clash(tuple(n for n, v in leaves.items() if is_array_leaf(v)))
    return structure, leaves


# The walks over a tree are module functions, not closures that call themselves: such a closure
# is a reference cycle, and everything it holds (a load's whole plan) would wait for the cyclic
# garbage collector, whose full passes over a training process take a tenth of a second.
def _flatten(x: object, name: str, leaves: dict[str, Any], depth: int) -> Any:
    if depth > MAX_TREE_DEPTH:
        raise ValueError(
            f"the state nests deeper than {MAX_TREE_DEPTH} levels (at {name[:80]!r}...), which no reader "
            "opens; flatten the state, e.g. with dotted keys"
        )
    kind = _node_kind(type(x))
    if kind == "dict":
        return {"dict": [[k, _flatten(v, _join(name, _key_str(k, name)), leaves, depth + 1)] for k, v in x.items()]}
    if kind is not None:
        return {kind: [_flatten(v, _join(name, str(i)), leaves, depth + 1) for i, v in enumerate(x)]}
    if name in leaves:
        raise InvalidNameError(
            f"two leaves share the global name {name!r} (a key containing dots collides with a "
            "nested key); rename one of them"
        )
    name_to_path(name)
    leaves[name] = x
    if is_array_leaf(x):
        return {"array": name}
    return _encode_value(x, name)


@functools.cache
def _node_kind(cls: type) -> str | None:
    """A tree node's kind by its type: "dict", "list", "tuple", or None for a leaf. Once per
    type: a state's walk asks for every node, and the check against the ``Mapping`` ABC is the
    slow part of a plain ``isinstance``."""
    if issubclass(cls, Mapping):
        return "dict"
    if issubclass(cls, list):
        return "list"
    return "tuple" if issubclass(cls, tuple) else None


def any_leaf(tree: object, test: Callable[[object], bool]) -> bool:
    """Whether ``test`` holds for a leaf of ``tree`` (nested dicts, lists, tuples): a walk that,
    unlike ``flatten``, names nothing and stops at the first."""
    stack = [tree]
    while stack:
        node = stack.pop()
        kind = _node_kind(type(node))
        if kind == "dict":
            stack.extend(node.values())
        elif kind is not None:
            stack.extend(node)
        elif test(node):
            return True
    return False


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


@functools.lru_cache(maxsize=64)  # the same names, save after save
def check_no_prefix_clash(names: tuple[str, ...]) -> None:
    """An array cannot also be a group: ``a`` and ``a.b`` cannot both be arrays."""
    paths = sorted(name_to_path(n) for n in names)
    for a, b in itertools.pairwise(paths):
        if b.startswith(a + "/"):
            raise InvalidNameError(
                f"array {a.replace('/', '.')!r} is also the parent of array {b.replace('/', '.')!r}; "
                "a stored array cannot contain others, rename one of them"
            )


def unflatten(structure: Any, leaf: Callable[[str, Mapping[str, Any]], Any], keep: set[str] | None = None) -> Any:
    """Rebuild the tree; ``leaf(name, node)`` gives each kept leaf's value.

    With ``keep``, only those leaves are rebuilt: the others are dropped from dicts (and dicts
    left empty by that are dropped too) and become ``None`` in lists and tuples, so the indices
    of the leaves kept stay meaningful.
    """
    result = _unflatten(structure, "", leaf, keep)
    return type_of_root(structure)() if result is _DROPPED else result


_DROPPED = object()  # a subtree ``unflatten`` leaves out


def _unflatten(
    node: Mapping[str, Any], name: str, leaf: Callable[[str, Mapping[str, Any]], Any], keep: set[str] | None
) -> Any:
    if "dict" in node:
        out = {}
        for key, child in node["dict"]:
            value = _unflatten(child, _join(name, str(key)), leaf, keep)
            if value is not _DROPPED:
                out[key] = value
        return _DROPPED if keep is not None and node["dict"] and not out else out
    for kind, build in (("list", list), ("tuple", tuple)):
        if kind in node:
            items = [_unflatten(c, _join(name, str(i)), leaf, keep) for i, c in enumerate(node[kind])]
            if keep is not None and items and all(v is _DROPPED for v in items):
                return _DROPPED
            return build(None if v is _DROPPED else v for v in items)
    if keep is not None and name not in keep:
        return _DROPPED
    return leaf(name, node)


def type_of_root(structure: Mapping[str, Any]) -> type:
    return dict if "dict" in structure else list if "list" in structure else tuple


def leaf_nodes(structure: Any) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """(global name, node) of every leaf, in tree order."""
    return _leaf_nodes(structure, "")


def _leaf_nodes(node: Mapping[str, Any], name: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
    if "dict" in node:
        for key, child in node["dict"]:
            yield from _leaf_nodes(child, _join(name, str(key)))
    elif "list" in node or "tuple" in node:
        for i, child in enumerate(node.get("list", node.get("tuple", []))):
            yield from _leaf_nodes(child, _join(name, str(i)))
    else:
        yield name, node


def nested(prefix: str, names: list[str]) -> Any:
    """A tree node of nested dicts whose array leaves are ``prefix.name`` for every dotted name."""
    root: dict[str, Any] = {}
    for name in names:
        node = root
        parts = name.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise InvalidNameError(f"array {prefix}.{name!r} lies under another array; rename one of them")
        if parts[-1] in node:
            raise InvalidNameError(f"array {prefix}.{name!r} is also the parent of other arrays; rename one of them")
        node[parts[-1]] = f"{prefix}.{name}"
    return _nested_node(root)


def _nested_node(node: Any) -> Any:
    if isinstance(node, str):
        return {"array": node}
    return {"dict": [[k, _nested_node(v)] for k, v in node.items()]}


def tree_of(nodes: Mapping[str, Any]) -> Any:
    """A tree of nested dicts whose leaf at each dotted name is its node (global names' tree)."""
    root: dict[str, Any] = {}
    groups = {id(root)}
    for name, leaf in nodes.items():
        node = root
        parts = name.split(".")
        for part in parts[:-1]:
            if part not in node:
                node[part] = {}
                groups.add(id(node[part]))
            node = node[part]
            if id(node) not in groups:
                raise InvalidNameError(f"{name!r} lies under the leaf {part!r}; rename one of them")
        if parts[-1] in node:
            raise InvalidNameError(f"{name!r} is also the parent of other leaves; rename one of them")
        node[parts[-1]] = leaf
    return _tree_node(root, groups)


def _tree_node(node: Any, groups: set[int]) -> Any:
    if id(node) in groups:
        return {"dict": [[k, _tree_node(v, groups)] for k, v in node.items()]}
    return node


def rewrite(structure: Any, visit: Callable[[Mapping[str, Any], str], Any]) -> Any:
    """The tree with every node for which ``visit(node, name)`` returns a node replaced by it.

    Nodes for which it returns None are kept, and their children visited.
    """
    return _rewrite(structure, "", visit)


def _rewrite(node: Mapping[str, Any], name: str, visit: Callable[[Mapping[str, Any], str], Any]) -> Any:
    new = visit(node, name)
    if new is not None:
        return new
    if "dict" in node:
        return {"dict": [[k, _rewrite(child, _join(name, str(k)), visit)] for k, child in node["dict"]]}
    for kind in ("list", "tuple"):
        if kind in node:
            return {kind: [_rewrite(child, _join(name, str(i)), visit) for i, child in enumerate(node[kind])]}
    return node


def retarget(structure: Any, targets: Mapping[str, str]) -> Any:
    """The tree with the array leaves named in ``targets`` pointing at another stored array."""
    return rewrite(
        structure, lambda node, name: {"array": targets[name]} if "array" in node and name in targets else None
    )


def replace_leaf(structure: Any, target: str, replacement: Any) -> Any:
    """The tree with the leaf named ``target`` replaced by the node ``replacement``."""
    return rewrite(structure, lambda node, name: replacement if name == target and _is_leaf(node) else None)


def collapse(structure: Any, chosen: Callable[[str], bool]) -> Any:
    """The tree with every inner node whose name is ``chosen`` turned into one leaf of that name."""
    return rewrite(
        structure, lambda node, name: {"flat": name} if name and not _is_leaf(node) and chosen(name) else None
    )


def _is_leaf(node: Mapping[str, Any]) -> bool:
    return not ("dict" in node or "list" in node or "tuple" in node)
