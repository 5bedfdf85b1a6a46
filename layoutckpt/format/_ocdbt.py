"""TensorStore's OCDBT format, as far as reading a packed checkpoint needs it: pure decoding.

A packed checkpoint (``docs/format.md`` section 3.1) is an OCDBT database. Reading it means the
manifest (``manifest.ocdbt``: configuration, data file table, the newest versions), the root
B+tree node of the newest version, and the nodes down to the leaf entry of each key; a value
larger than the configuration's ``max_inline_value_bytes`` is a byte range of a data file. The
encodings follow TensorStore's published description of the format (its ``ocdbt`` kvstore
documentation): little-endian fixed-width integers, LEB128 varints, zstd-compressed bodies, a
crc32c of every structure, keys prefix-compressed within a node.

Nothing here reads a file: ``storage/_packindex`` fetches the bytes and calls these functions,
which raise ``Malformed`` for anything that does not decode exactly.
"""

from __future__ import annotations

import bisect
import itertools

import attrs
import crc32c
import numpy as np
from numcodecs import Zstd

MANIFEST_MAGIC = 0x0CDB3A2A
BTREE_MAGIC = 0x0CDB20DE
NO_NODE = 2**64 - 1  # offset and length of the root of an empty version
MAX_NODE_BYTES = 64 << 20  # a node's decoded size is bounded by the configuration (8 MiB by default)


class Malformed(ValueError):
    """Bytes that are not the OCDBT structure they are read as."""


@attrs.frozen
class Ref:
    """``length`` bytes at ``offset`` of the data file ``path`` (relative to the database); a
    node read from there resolves its own data file table under ``base``."""

    path: str
    offset: int
    length: int
    base: str = ""


@attrs.frozen
class Root:
    """The newest version's root B+tree node (``None`` for an empty database) and its height."""

    node: Ref | None
    height: int


@attrs.frozen
class Leaf:
    """A leaf node: its keys (sorted, relative to the prefix of the path to it) and, for each,
    a ``Ref`` to its value or the value itself where it is stored inline."""

    keys: tuple[bytes, ...]
    values: tuple[Ref | bytes, ...]

    def get(self, key: bytes) -> Ref | bytes | None:
        i = bisect.bisect_left(self.keys, key)
        return self.values[i] if i < len(self.keys) and self.keys[i] == key else None


@attrs.frozen
class Interior:
    """An interior node: the first key of each child (relative, as in ``Leaf``), the length of
    the part of that key every key below the child shares, and the child."""

    keys: tuple[bytes, ...]
    common: tuple[int, ...]
    children: tuple[Ref, ...]

    def child(self, key: bytes) -> int | None:
        """The child whose keys may include ``key``: the last one starting at or before it."""
        i = bisect.bisect_right(self.keys, key) - 1
        return i if i >= 0 else None


class Unsupported(Malformed):
    """A valid database in a form this reader does not read (TensorStore's own reader does)."""


class _Cursor:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise Malformed("it ends before its last field")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def byte(self) -> int:
        return self.take(1)[0]

    def varint(self) -> int:
        value = shift = 0
        while True:
            b = self.byte()
            value |= (b & 0x7F) << shift
            if b < 0x80:
                return value
            shift += 7
            if shift > 63:
                raise Malformed("a varint is longer than 64 bits")

    def varints(self, n: int) -> list[int]:
        """``n`` varints. A node stores each column of its entries as a run of varints, so runs
        are decoded with NumPy: a node of thousands of keys decodes in a few calls, not one
        Python call per byte."""
        if n < 16:
            return [self.varint() for _ in range(n)]
        view = np.frombuffer(self.data, np.uint8, offset=self.pos)
        ends = np.flatnonzero(view < 0x80)[:n]  # the last byte of each varint
        if len(ends) < n:
            raise Malformed("it ends before its last field")
        self.pos += int(ends[-1]) + 1
        if ends[-1] == n - 1:  # every one a single byte
            return view[:n].tolist()
        starts = np.concatenate(([0], ends[:-1] + 1))
        widths = ends - starts + 1
        if widths.max() > 9:
            raise Malformed("a varint is longer than 64 bits")
        values = np.zeros(n, np.uint64)
        for k in range(int(widths.max())):
            has = widths > k
            values[has] |= (view[starts[has] + k] & 0x7F).astype(np.uint64) << np.uint64(7 * k)
        return values.tolist()

    def done(self) -> None:
        if self.pos != len(self.data):
            raise Malformed(f"{len(self.data) - self.pos} bytes follow its last field")


def _body(raw: bytes, magic: int, what: str) -> _Cursor:
    """The decompressed body of an encoded manifest or node: its header and crc32c checked."""
    if len(raw) < 18:
        raise Malformed(f"the {what} is {len(raw)} bytes, too short for its header")
    if int.from_bytes(raw[:4], "big") != magic:
        raise Malformed(f"the {what} does not start with its magic number")
    if int.from_bytes(raw[4:12], "little") != len(raw):
        raise Malformed(f"the {what}'s header gives another length than the {len(raw)} bytes read")
    if crc32c.crc32c(raw[:-4]) != int.from_bytes(raw[-4:], "little"):
        raise Malformed(f"the {what} fails its crc32c")
    head = _Cursor(raw[12:-4])
    if head.varint() != 0:
        raise Malformed(f"the {what} has a format version other than 0")
    compression = head.varint()
    rest = head.data[head.pos :]
    if compression == 0:
        return _Cursor(rest)
    if compression != 1:
        raise Malformed(f"the {what} is compressed with unknown method {compression}")
    try:
        body = bytes(Zstd().decode(rest))
    except Exception as err:  # noqa: BLE001 - any failure to decompress is damage
        raise Malformed(f"the {what}'s zstd body does not decompress ({err})") from None
    if len(body) > MAX_NODE_BYTES:
        raise Malformed(f"the {what} decompresses to {len(body)} bytes, above {MAX_NODE_BYTES}")
    return _Cursor(body)


def _files(cur: _Cursor, transitive: str) -> tuple[list[str], list[str]]:
    """A data file table: each file's path and the transitive path its nodes' tables extend."""
    n = cur.varint()
    shared = [0, *cur.varints(max(n - 1, 0))]
    suffix_lengths, base_lengths = cur.varints(n), cur.varints(n)
    paths: list[str] = []
    bases: list[str] = []
    previous = ""
    for i in range(n):
        if shared[i] > len(previous):
            raise Malformed("a data file path shares more than the previous path holds")
        path = previous[: shared[i]] + _text(cur.take(suffix_lengths[i]))
        if base_lengths[i] > len(path):
            raise Malformed("a data file's base path is longer than its path")
        paths.append(transitive + path)
        bases.append(transitive + path[: base_lengths[i]])
        previous = path
    return paths, bases


def _text(raw: bytes) -> str:
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise Malformed("a data file path is not UTF-8") from None


def _ref(files: list[str], bases: list[str], file_id: int, offset: int, length: int) -> Ref:
    if file_id >= len(files):
        raise Malformed(f"a reference names data file {file_id} of a table of {len(files)}")
    return Ref(files[file_id], offset, length, bases[file_id])


def decode_manifest(raw: bytes) -> Root:
    """The newest version's root, from an encoded ``manifest.ocdbt``."""
    cur = _body(raw, MANIFEST_MAGIC, "manifest")
    cur.take(16)  # the database's uuid
    if cur.varint() != 0:
        raise Unsupported("the manifest keeps its versions in numbered files")
    cur.varints(2)  # max_inline_value_bytes, max_decoded_node_bytes
    arity_log2 = cur.byte()
    if cur.varint() != 0:  # compression method: zstd's level follows
        cur.take(4)
    files, bases = _files(cur, "")
    n = cur.varint()
    if n == 0:
        return Root(None, 0)
    if n > 1 << arity_log2:
        raise Malformed(f"the manifest lists {n} versions inline, more than its arity allows")
    generations, heights = cur.varints(n), [cur.byte() for _ in range(n)]
    ids, offsets, lengths = cur.varints(n), cur.varints(n), cur.varints(n)
    if any(b <= a for a, b in itertools.pairwise(generations)) or generations[0] == 0:
        raise Malformed("the manifest's generation numbers are not increasing from 1")
    cur.varints(3 * n)  # statistics: keys, tree bytes, indirect value bytes
    cur.take(8 * n)  # commit times
    # What follows refers to older versions (version tree nodes), which a reader of the newest
    # one does not need.
    if lengths[-1] in (0, NO_NODE):  # the version of an empty database
        return Root(None, heights[-1])
    return Root(_ref(files, bases, ids[-1], offsets[-1], lengths[-1]), heights[-1])


def decode_node(raw: bytes, transitive: str, height: int) -> Leaf | Interior:
    """An encoded B+tree node read from a data file whose path has ``transitive`` as its
    transitive part; ``height`` is what its parent (or the manifest) says it is."""
    cur = _body(raw, BTREE_MAGIC, "B+tree node")
    if cur.byte() != height:
        raise Malformed(f"a B+tree node's height is not the {height} its parent gives")
    files, bases = _files(cur, transitive)
    n = cur.varint()
    shared = [0, *cur.varints(max(n - 1, 0))]
    suffix_lengths = cur.varints(n)
    common = cur.varints(n) if height > 0 else []
    keys = _keys(cur, shared, suffix_lengths)
    if any(b <= a for a, b in itertools.pairwise(keys)):
        raise Malformed("a B+tree node's keys are not in increasing order")
    if height > 0:
        if any(c > len(k) for c, k in zip(common, keys)):
            raise Malformed("a B+tree node's common prefix is longer than its key")
        ids, offsets, lengths = cur.varints(n), cur.varints(n), cur.varints(n)
        cur.varints(3 * n)  # statistics
        cur.done()
        children = tuple(_ref(files, bases, i, o, ln) for i, o, ln in zip(ids, offsets, lengths))
        return Interior(tuple(keys), tuple(common), children)
    value_lengths, kinds = cur.varints(n), cur.varints(n)
    if any(k not in (0, 1) for k in kinds):
        raise Malformed("a B+tree leaf gives a value kind other than inline or out of line")
    indirect = [i for i in range(n) if kinds[i] == 1]
    ids, offsets = cur.varints(len(indirect)), cur.varints(len(indirect))
    values: list[Ref | bytes] = [b""] * n
    for i, file_id, offset in zip(indirect, ids, offsets):
        values[i] = _ref(files, bases, file_id, offset, value_lengths[i])
    for i in range(n):
        if kinds[i] == 0:
            values[i] = cur.take(value_lengths[i])
    cur.done()
    return Leaf(tuple(keys), tuple(values))


def _keys(cur: _Cursor, shared: list[int], suffix_lengths: list[int]) -> list[bytes]:
    keys: list[bytes] = []
    previous = b""
    for common, length in zip(shared, suffix_lengths):
        if common > len(previous):
            raise Malformed("a key shares more with the previous key than the previous key holds")
        previous = previous[:common] + cur.take(length)
        keys.append(previous)
    return keys
