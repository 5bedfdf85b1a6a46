"""TensorStore's OCDBT format, as far as a packed checkpoint needs it: pure decoding and encoding.

A packed checkpoint (``docs/format.md`` section 3.1) is an OCDBT database. Reading it means the
manifest (``manifest.ocdbt``: configuration, data file table, the newest versions), the root
B+tree node of the newest version, and the nodes down to the leaf entry of each key; a value
larger than the configuration's ``max_inline_value_bytes`` is a byte range of a data file. The
encodings follow TensorStore's published description of the format (its ``ocdbt`` kvstore
documentation): little-endian fixed-width integers, LEB128 varints, zstd-compressed bodies, a
crc32c of every structure, keys prefix-compressed within a node.

Nothing here reads or writes a file: ``storage/_packindex`` fetches the bytes and calls the
decoding functions, which raise ``Malformed`` for anything that does not decode exactly;
``storage/_packs`` writes what ``encode_tree`` and ``encode_manifest`` return. A rank's
database is written in one version: every value out of line, nodes uncompressed (the values
are checksummed shards, the nodes a few bytes per key), each node with the whole data file
table of the rank (a handful of paths).
"""

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Iterable, Iterator, Sequence

import attrs
import crc32c
import numpy as np
from numcodecs import Zstd

MANIFEST_MAGIC = 0x0CDB3A2A
BTREE_MAGIC = 0x0CDB20DE
NO_NODE = 2**64 - 1  # offset and length of the root of an empty version
MAX_NODE_BYTES = 64 << 20  # a node's decoded size is bounded by the configuration (8 MiB by default)
# What ``encode_manifest`` declares: TensorStore's defaults, except that no value is inline.
DECODED_NODE_BYTES = 8 << 20
VERSION_TREE_ARITY_LOG2 = 4
# ``encode_tree`` closes a node past this many encoded bytes: a lookup reads one node per level.
NODE_BYTES = 256 << 10


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
    a ``Ref`` to its value or the value itself where it is stored inline. A rank's leaf holds
    thousands of keys and a lookup wants one, so a ``Ref`` is made when it is asked for."""

    keys: tuple[bytes, ...]
    refs: _Refs
    inline: dict[int, bytes]  # the values stored in the leaf, by key index

    def get(self, key: bytes) -> Ref | bytes | None:
        i = bisect.bisect_left(self.keys, key)
        if i == len(self.keys) or self.keys[i] != key:
            return None
        return self.inline[i] if i in self.inline else self.refs.at(i)


@attrs.frozen
class _Refs:
    """A leaf's out-of-line values as the columns they are stored in: key ``i``'s value is
    entry ``slots[i]`` of ``ids`` and ``offsets`` (entry ``i`` where ``slots`` is None: no value
    inline), ``lengths[i]`` bytes long, in data file ``files[ids[...]]``."""

    files: list[str]
    bases: list[str]
    ids: list[int]
    offsets: list[int]
    lengths: list[int]
    slots: list[int] | None

    def at(self, i: int) -> Ref:
        j = i if self.slots is None else self.slots[i]
        file_id = self.ids[j]
        return Ref(self.files[file_id], self.offsets[j], self.lengths[i], self.bases[file_id])


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
        view = np.frombuffer(self.data, np.uint8, offset=self.pos)[: 10 * n]  # at most 10 bytes each
        ends = np.flatnonzero(view < 0x80)[:n]  # the last byte of each varint
        if len(ends) < n:
            raise Malformed("it ends before its last field")
        size = int(ends[-1]) + 1
        self.pos += size
        if size == n:  # every one a single byte
            return view[:n].tolist()
        starts = np.empty(n, np.int64)
        starts[0], starts[1:] = 0, ends[:-1] + 1
        if (ends - starts).max() > 9:  # ten bytes hold 64 bits, as in ``varint``
            raise Malformed("a varint is longer than 64 bits")
        shifts = 7 * (np.arange(size) - np.repeat(starts, ends - starts + 1)).astype(np.uint64)
        return np.add.reduceat((view[:size] & 0x7F).astype(np.uint64) << shifts, starts).tolist()

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


def decode_manifest(raw: bytes, transitive: str = "") -> Root:
    """The newest version's root, from an encoded ``manifest.ocdbt`` at ``transitive`` (the
    database's directory, relative to where its paths are opened)."""
    cur = _body(raw, MANIFEST_MAGIC, "manifest")
    cur.take(16)  # the database's uuid
    if cur.varint() != 0:
        raise Unsupported("the manifest keeps its versions in numbered files")
    cur.varints(2)  # max_inline_value_bytes, max_decoded_node_bytes
    arity_log2 = cur.byte()
    if cur.varint() != 0:  # compression method: zstd's level follows
        cur.take(4)
    files, bases = _files(cur, transitive)
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
    if not all(map(operator.lt, keys, itertools.islice(keys, 1, None))):
        raise Malformed("a B+tree node's keys are not in increasing order")
    if height > 0:
        return _interior(cur, keys, common, files, bases)
    return _leaf(cur, keys, files, bases)


def _interior(cur: _Cursor, keys: list[bytes], common: list[int], files: list[str], bases: list[str]) -> Interior:
    """The rest of an interior node after its keys: its children's references."""
    n = len(keys)
    if any(c > len(k) for c, k in zip(common, keys)):
        raise Malformed("a B+tree node's common prefix is longer than its key")
    ids, offsets, lengths = cur.varints(n), cur.varints(n), cur.varints(n)
    cur.varints(3 * n)  # statistics
    cur.done()
    children = tuple(_ref(files, bases, i, o, ln) for i, o, ln in zip(ids, offsets, lengths))
    return Interior(tuple(keys), tuple(common), children)


def _leaf(cur: _Cursor, keys: list[bytes], files: list[str], bases: list[str]) -> Leaf:
    """The rest of a leaf after its keys: its values, out of line as columns, inline as bytes."""
    n = len(keys)
    value_lengths, kinds = cur.varints(n), cur.varints(n)
    out_of_line = kinds.count(1)
    if out_of_line + kinds.count(0) != n:
        raise Malformed("a B+tree leaf gives a value kind other than inline or out of line")
    ids, offsets = cur.varints(out_of_line), cur.varints(out_of_line)
    if ids and max(ids) >= len(files):
        raise Malformed(f"a reference names data file {max(ids)} of a table of {len(files)}")
    inline = {i: cur.take(value_lengths[i]) for i in range(n) if kinds[i] == 0} if out_of_line < n else {}
    cur.done()
    slots = list(itertools.accumulate(kinds, initial=-1))[1:] if inline else None
    return Leaf(tuple(keys), _Refs(files, bases, ids, offsets, value_lengths, slots), inline)


def _keys(cur: _Cursor, shared: list[int], suffix_lengths: list[int]) -> list[bytes]:
    """A node's keys, each the previous one's first ``shared`` bytes and its own suffix. A
    merged root's leaf holds tens of thousands, so the loop does no more than join bytes."""
    suffixes = cur.take(sum(suffix_lengths))
    keys: list[bytes] = []
    previous, pos = b"", 0
    for common, length in zip(shared, suffix_lengths):
        if common > len(previous):
            raise Malformed("a key shares more with the previous key than the previous key holds")
        previous = previous[:common] + suffixes[pos : pos + length]
        pos += length
        keys.append(previous)
    return keys


# --- encoding ---------------------------------------------------------------------------------


@attrs.frozen
class Placed:
    """A value or node written at ``offset`` of data file ``file`` (an index into the table)."""

    file: int
    offset: int
    length: int


@attrs.frozen
class Tree:
    """Encoded B+tree nodes, to be written one after another from the offset ``encode_tree`` was
    given; ``root`` is where the last of them, the root, lies."""

    nodes: tuple[bytes, ...]
    root: Placed | None
    height: int
    keys: int
    tree_bytes: int
    value_bytes: int


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _column(values: Iterable[int]) -> bytes:
    return b"".join(_varint(v) for v in values)


def _shared(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _prefixed(keys: Sequence[bytes]) -> tuple[bytes, bytes, bytes]:
    """Keys prefix-compressed: the shared lengths (but the first's), the suffix lengths, the
    suffixes."""
    shared = [_shared(a, b) for a, b in itertools.pairwise(keys)]
    suffixes = [k[n:] for k, n in zip(keys, [0, *shared])]
    return _column(shared), _column(len(x) for x in suffixes), b"".join(suffixes)


def _table(paths: Sequence[str]) -> bytes:
    """A data file table of ``paths`` relative to the database (no base paths)."""
    shared, lengths, suffixes = _prefixed([p.encode() for p in paths])
    return _varint(len(paths)) + shared + lengths + _column(0 for _ in paths) + suffixes


def _frame(magic: int, body: bytes) -> bytes:
    """Header (magic, length, format version 0, uncompressed), ``body``, crc32c."""
    head = _varint(0) + _varint(0)
    length = 4 + 8 + len(head) + len(body) + 4
    raw = magic.to_bytes(4, "big") + length.to_bytes(8, "little") + head + body
    return raw + crc32c.crc32c(raw).to_bytes(4, "little")


def encode_leaf(table: bytes, keys: Sequence[bytes], values: Sequence[Placed]) -> bytes:
    """A leaf of ``keys`` (sorted, relative to its prefix), each value out of line."""
    shared, lengths, suffixes = _prefixed(keys)
    body = [bytes([0]), table, _varint(len(keys)), shared, lengths, suffixes]
    body += [_column(v.length for v in values), _column(1 for _ in values)]
    body += [_column(v.file for v in values), _column(v.offset for v in values)]
    return _frame(BTREE_MAGIC, b"".join(body))


@attrs.frozen
class _Node:
    """A written node (or, below the leaves, a value): its keys' range and shared prefix length,
    all absolute, and the statistics of its subtree."""

    lo: bytes
    hi: bytes
    prefix: int
    at: Placed
    keys: int
    tree_bytes: int
    value_bytes: int


def encode_interior(height: int, table: bytes, prefix: int, children: Sequence[_Node]) -> bytes:
    """An interior node whose keys share ``prefix`` bytes, over ``children``."""
    shared, lengths, suffixes = _prefixed([c.lo[prefix:] for c in children])
    body = [bytes([height]), table, _varint(len(children)), shared, lengths]
    body += [_column(c.prefix - prefix for c in children), suffixes]
    body += [_column(getattr(c.at, f) for c in children) for f in ("file", "offset", "length")]
    body += [_column(getattr(c, f) for c in children) for f in ("keys", "tree_bytes", "value_bytes")]
    return _frame(BTREE_MAGIC, b"".join(body))


def encode_tree(paths: Sequence[str], entries: Iterable[tuple[bytes, Placed]], file: int, offset: int) -> Tree:
    """The B+tree of ``entries`` (key, where its value lies; keys unique), its nodes to be
    written one after another at ``offset`` of data file ``file``: leaves first, the root last.
    A node stores its keys without the prefix they all share (the root: none), as TensorStore
    reads them (``Interior``); ``paths`` is the data file table of every node."""
    table = _table(paths)
    level = [_Node(k, k, len(k), v, 1, 0, v.length) for k, v in sorted(entries, key=lambda e: e[0])]
    if not level:
        return Tree((), None, 0, 0, 0, 0)
    nodes: list[bytes] = []
    height = 0
    while True:
        groups = list(_groups(level))
        parents = []
        for group in groups:
            lo, hi = group[0].lo, group[-1].hi
            prefix = _shared(lo, hi) if len(groups) > 1 else 0
            if height == 0:
                raw = encode_leaf(table, [c.lo[prefix:] for c in group], [c.at for c in group])
            else:
                raw = encode_interior(height, table, prefix, group)
            nodes.append(raw)
            below = sum(c.tree_bytes for c in group) + len(raw)
            keys, values = sum(c.keys for c in group), sum(c.value_bytes for c in group)
            parents.append(_Node(lo, hi, prefix, Placed(file, offset, len(raw)), keys, below, values))
            offset += len(raw)
        if len(parents) == 1:
            root = parents[0]
            return Tree(tuple(nodes), root.at, height, root.keys, root.tree_bytes, root.value_bytes)
        level, height = parents, height + 1


def _groups(level: Sequence[_Node]) -> Iterator[Sequence[_Node]]:
    """Runs of ``level`` whose node stays under ``NODE_BYTES`` (at least two per node)."""
    start, size = 0, 0
    for i, c in enumerate(level):
        size += len(c.lo) + 24
        if size > NODE_BYTES and i - start >= 2:
            yield level[start:i]
            start, size = i, len(c.lo) + 24
    yield level[start:]


def encode_manifest(uuid: bytes, paths: Sequence[str], tree: Tree, commit_ns: int) -> bytes:
    """A manifest whose one version (generation 1) is ``tree``, its versions inline."""
    root = tree.root
    if root is None:  # as TensorStore writes an empty version: its "node" in a file of no path
        paths, root = [*paths, ""], Placed(len(paths), NO_NODE, NO_NODE)
    config = [uuid, _varint(0), _varint(0), _varint(DECODED_NODE_BYTES), bytes([VERSION_TREE_ARITY_LOG2])]
    config.append(_varint(0))  # nodes uncompressed
    versions = [_varint(1), _varint(1), bytes([tree.height]), _varint(root.file), _varint(root.offset)]
    versions += [_varint(root.length), _varint(tree.keys), _varint(tree.tree_bytes), _varint(tree.value_bytes)]
    versions += [commit_ns.to_bytes(8, "little"), _varint(0)]  # no older versions
    return _frame(MANIFEST_MAGIC, b"".join([*config, _table(paths), *versions]))
