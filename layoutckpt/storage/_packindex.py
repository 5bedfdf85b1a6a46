"""Where each shard of a local packed checkpoint lies, read from its OCDBT B+tree.

A packed checkpoint's shards are values of an OCDBT database, each stored out of line as one
byte range of a data file. Knowing those ranges, layoutckpt's own shard reader reads a packed
checkpoint as it reads a plain one (only the index and the inner chunks a box needs, straight
into the destination) instead of going through TensorStore. ``PackIndex`` walks the B+tree on
demand: a lookup reads the nodes on the path to its key, each once per index, so a partial
read of one array reads a few small nodes, not the whole tree.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

from ..format import _ocdbt
from . import _os
from ._shardread import Damaged, Extent, Files

MANIFEST = "manifest.ocdbt"


class Inline(Exception):
    """The value of a key is stored inside its B+tree leaf, not in a data file (TensorStore
    writes values up to ``max_inline_value_bytes`` so, 100 by default): read it otherwise."""


class PackIndex:
    """The B+tree of the packed checkpoint at ``root``, decoded as lookups need its nodes, which
    it reads through ``files`` (a reader's: the nodes lie in the data files its shards do)."""

    def __init__(self, root: Path, files: Files | None = None) -> None:
        self.root = root
        self.files = files if files is not None else Files(root)
        self._lock = threading.Lock()
        self._tree: _ocdbt.Root | None = None
        self._nodes: dict[_ocdbt.Ref, Future[_ocdbt.Leaf | _ocdbt.Interior]] = {}

    def locate(self, key: str) -> Extent | None:
        """Where the value of ``key`` lies (None where the database has no such key); ``Inline``
        where it is stored in its leaf; ``Damaged`` where the tree does not decode."""
        tree = self.tree()
        ref, height, rest = tree.node, tree.height, key.encode()
        while ref is not None:
            node = self.node(ref, height)
            if isinstance(node, _ocdbt.Leaf):
                value = node.get(rest)
                if isinstance(value, bytes):
                    raise Inline(key)
                return None if value is None else Extent(value.path, value.offset, value.length)
            i = node.child(rest)
            if i is None or not rest.startswith(node.keys[i][: node.common[i]]):
                return None
            ref, height, rest = node.children[i], height - 1, rest[node.common[i] :]
        return None

    def tree(self) -> _ocdbt.Root:
        if self._tree is not None:  # every lookup starts here: no lock once it is read
            return self._tree
        with self._lock:  # every reading thread starts here: one reads the manifest, the rest wait
            if self._tree is None:
                try:
                    raw = _os.read_regular(self.root, MANIFEST, _ocdbt.MAX_NODE_BYTES)
                except FileNotFoundError:
                    raise Damaged(True, f"the packed checkpoint's {MANIFEST} does not exist") from None
                except OSError as err:
                    raise Damaged(False, f"the packed checkpoint's {MANIFEST} cannot be read ({err})") from None
                with _decoding("manifest"):
                    self._tree = _ocdbt.decode_manifest(raw)
            return self._tree

    def node(self, ref: _ocdbt.Ref, height: int) -> _ocdbt.Leaf | _ocdbt.Interior:
        """The node at ``ref``, read and decoded once: threads that want it meanwhile wait for
        it (a merged root's leaf takes tens of milliseconds to decode, under the GIL)."""
        pending = self._nodes.get(ref)
        if pending is not None and pending.done():
            return pending.result()
        with self._lock:
            pending = self._nodes.get(ref)
            mine = pending is None
            if mine:
                pending = self._nodes[ref] = Future()
        if mine:
            try:
                raw = self._read(ref, "B+tree node")
                with _decoding("B+tree node"):
                    pending.set_result(_ocdbt.decode_node(raw, ref.base, height))
            except BaseException as err:  # noqa: BLE001 - a waiter must get any failure, not hang
                pending.set_exception(err)
        return pending.result()

    def _read(self, ref: _ocdbt.Ref, what: str) -> bytes:
        """``ref``'s bytes, through ``Files`` (as ``open_regular`` opens them): the tree may name
        any path, and only a regular file inside the checkpoint is read."""
        if ref.length > _ocdbt.MAX_NODE_BYTES:
            raise Damaged(False, f"the packed checkpoint's {what} in {ref.path} claims {ref.length} bytes")
        try:
            fd, _, owned = self.files.open(Extent(ref.path, ref.offset, ref.length))
        except FileNotFoundError:
            raise Damaged(True, f"the packed checkpoint's {what} file {ref.path} does not exist") from None
        except OSError as err:
            raise Damaged(False, f"the packed checkpoint's {what} file {ref.path} cannot be read ({err})") from None
        try:
            raw = os.pread(fd, ref.length, ref.offset)
        finally:
            if owned:
                os.close(fd)
        if len(raw) != ref.length:
            raise Damaged(False, f"the packed checkpoint's {what} in {ref.path} is cut short")
        return raw


@contextlib.contextmanager
def _decoding(what: str) -> Iterator[None]:
    """Bytes that do not decode are damage, named as such; a form this reader does not know is
    left to the caller (``Unsupported``), which reads through TensorStore instead."""
    try:
        yield
    except _ocdbt.Unsupported:
        raise
    except _ocdbt.Malformed as err:
        raise Damaged(False, f"the packed checkpoint's {what} is damaged: {err}") from None
