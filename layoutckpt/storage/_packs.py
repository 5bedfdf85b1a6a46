"""Packed checkpoints: the arrays' objects in TensorStore's OCDBT key-value store.

A plain checkpoint stores one object per shard and per document, which on an FSDP-style layout
is one file per array per rank: millions at scale, each a metadata operation on a parallel file
system and a request on an object store. A packed one stores the same objects (the same keys,
the same bytes) in an OCDBT database instead, the format Orbax uses: each rank writes its share
into a database of its own under ``packs/RRRRR/`` (``PackWriter``: a data file per writing
thread), and rank 0's commit merges the ranks' B-trees into one database at the checkpoint's
root, referring to the ranks' data files where they lie (no byte is copied). Plain
``tensorstore`` opens every array with an ``ocdbt`` kvstore over the checkpoint
(``docs/format.md`` section 3.1).

The commit marker (the root ``zarr.json``) and the per-rank documents stay plain objects beside
the database (``in_pack``), so a checkpoint is found, listed and committed as any other.
"""

from __future__ import annotations

import functools
import math
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import attrs
import tensorstore as ts

from ..base import _faults
from ..base._errors import IntegrityError
from ..base._metrics import InFlight
from ..base._options import IOConfig
from ..base._workers import Workers
from ..format import _ocdbt
from ..layout._plan import Box, shard_cell
from . import _packindex, _shardfile, _store
from ._location import MAX_DOCUMENT_BYTES, LocalDir, read_bounded
from ._packindex import rank_base
from ._readers import BoxReader, PackedFileReader, TensorStoreReader
from ._writers import BoxWriter, Source, staged_size

if TYPE_CHECKING:
    from ..format._format import ArrayMeta, CheckpointMeta
    from ..layout._spec import Mesh
    from ._location import Location

# ``packing="auto"`` packs a checkpoint of more objects than this; a smaller one stays plain
# files, which plain zarr-python reads.
PACK_ABOVE_OBJECTS = 1000


def in_pack(key: str) -> bool:
    """Whether the object at ``key`` lives in the database: every group and array document and
    every shard; not the commit marker nor the per-rank documents (hidden keys)."""
    return key != "zarr.json" and not key.startswith(".")


def database(location: Location, rel: str = "") -> dict[str, Any]:
    """The kvstore spec of the OCDBT database whose files lie at ``rel`` under ``location``."""
    return {"driver": "ocdbt", "base": location.kvstore(rel)}


@attrs.frozen
class PackView:
    """What TensorStore needs of a location to open arrays in a database: ``kvstore``.
    ``writers`` and ``mesh``: the checkpoint's writer rules by array path, and its mesh."""

    location: Location
    base: str = ""
    writers: Mapping[str, tuple[int, int]] = attrs.field(factory=dict, eq=False)
    mesh: Mesh | None = None

    def kvstore(self, rel: str = "") -> dict[str, Any]:
        return {**database(self.location, self.base), "path": rel.rstrip("/") + "/" if rel else ""}

    @functools.cached_property
    def _kv(self) -> ts.KvStore:
        return ts.KvStore.open(self.kvstore(), context=_store.context()).result()

    def read(self, key: str, max_bytes: int = MAX_DOCUMENT_BYTES) -> bytes | None:
        """A document: from the database where ``in_pack`` says so, else a plain object."""
        if not in_pack(key):
            return self.location.read(key, max_bytes)
        try:
            value = read_bounded(self._kv, key, max_bytes)
        except ValueError as err:
            raise _store.as_damage(err, key, self.location.url) from None
        return None if value is None else packed_value(key, value, self.location.url)

    def box_reader(self, where: str, complete: bool, io: IOConfig) -> BoxReader:
        """The reader of the arrays: on a local disk, layoutckpt's own reader of the database's
        data files; elsewhere TensorStore, through the database."""
        through = TensorStoreReader(self, where, complete, io)
        if isinstance(self.location, LocalDir) and not self.base:
            return PackedFileReader(self.location.root, where, complete, io, through, self.writers, self.mesh)
        return through


def packed_value(key: str, value: bytes, url: str) -> bytes:
    """A value read from a packed checkpoint's database, which is never empty: every document
    and every shard holds bytes. TensorStore reads a value whose data file is gone as empty."""
    if not value:
        raise IntegrityError(
            f"checkpoint {url!r}: {key!r} reads as empty: the data file under packs/ that holds it is "
            "missing or cut short; restore the checkpoint from another copy"
        )
    return bytes(value)


def arrays_of(location: Location, meta: CheckpointMeta) -> Location | PackView:
    """Where a checkpoint's arrays and documents are read: ``kvstore``, ``read``, ``box_reader``."""
    if not meta.packed:
        return location
    writers = {meta.arrays[name].path: rule for name, rule in meta.writers.items()}
    return PackView(location, writers=writers, mesh=meta.mesh)


class PackWriter(BoxWriter):
    """This rank's shards and documents into a database of its own, written by layoutckpt
    (``format/_ocdbt`` encodes it). Each of ``io.threads`` threads encodes whole shards and
    appends them to a data file of its own (``_shardfile.DataFile``: past the page cache on a
    local disk), a new one past ``io.pack_bytes``; ``join`` appends the documents and the
    B+tree to one of them and writes the manifest last. So every byte is copied once, as a
    plain save copies it, where TensorStore's OCDBT writer copies each value into its own
    buffer first, and a rank writes about one data file per thread. On an object store a data
    file is collected in memory and stored as one object when full: a save holds up to
    ``io.threads * io.pack_bytes`` there."""

    def __init__(self, staging: Location, rank: int, io: IOConfig, in_flight: InFlight | None = None) -> None:
        super().__init__(io, in_flight)
        self.staging = staging
        self.base = rank_base(rank)
        self._disk = _shardfile.ShardFiles(staging.root, io) if isinstance(staging, LocalDir) else None
        self._lock = threading.Lock()
        self._paths: list[str] = []  # the data file table: file i is ``self._paths[i]``
        self._open: dict[int, tuple[int, _shardfile.DataFile]] = {}  # by thread: (file id, file)
        self._entries: list[tuple[str, _ocdbt.Placed]] = []
        self._documents: list[tuple[str, bytes]] = []
        self._arrays: list[str] = []  # of the shards written
        self._threads = Workers("layoutckpt-pack", io.threads)

    def write(self, meta: ArrayMeta, box: Box, source: Source) -> None:
        cell = shard_cell(box, meta.shape, meta.shard_shape)
        if cell is None:  # internal invariant: a save's plan makes whole shards only
            raise ValueError(f"array {meta.path!r}: the box {list(box)} is not one whole shard")
        self._threads.submit(self._whole, meta, cell, box, source)

    def _whole(self, meta: ArrayMeta, cell: tuple[int, ...], box: Box, source: Source) -> int:
        file_id, file = self._file()
        try:
            data = source.wait()
            nbytes, dtype = staged_size(meta, box, data)
            self.in_flight.start(nbytes)
            offset, length = file.shard(meta, cell, dtype, data)
        finally:
            source.release()  # copied into the file's buffer or written: no longer needed
        self.in_flight.done(nbytes)
        with self._lock:
            self._entries.append((f"{meta.path}/{meta.chunk_key(cell)}", _ocdbt.Placed(file_id, offset, length)))
            self._arrays.append(meta.path)
            full = file.size >= self.io.pack_bytes
            if full:
                del self._open[threading.get_ident()]
        if full:
            self._store(file)
        return nbytes

    def _file(self) -> tuple[int, _shardfile.DataFile]:
        """This thread's data file, made on first need."""
        me = threading.get_ident()
        if me not in self._open:
            name = f"d/{uuid.uuid4().hex}"
            rel = f"{self.base}/{name}"
            file = (
                _shardfile.DataFile.on_disk(self._disk, rel)
                if self._disk
                else _shardfile.DataFile.in_memory(rel, self.io)
            )
            with self._lock:
                self._paths.append(name)
                self._open[me] = (len(self._paths) - 1, file)
        return self._open[me]

    def _store(self, file: _shardfile.DataFile) -> None:
        data = file.close()
        if data is not None:
            self.staging.write(file.rel, data)

    def write_documents(self, items: Iterable[tuple[str, bytes]]) -> None:
        plain = []
        for key, data in items:
            (self._documents if in_pack(key) else plain).append((key, data))
        self.staging.write_many(plain)

    def join(self) -> int:
        written = self._threads.join()
        tree = self._append_tree() if self._entries or self._documents else _ocdbt.encode_tree([], [], 0, 0)
        while self._open:
            self._store(self._open.popitem()[1][1])
        manifest = _ocdbt.encode_manifest(uuid.uuid4().bytes, self._paths, tree, time.time_ns())
        self.staging.write(f"{self.base}/{_packindex.MANIFEST}", manifest)
        for path in self._arrays:
            _faults.point("save.box_written", name=path)
        return written

    def _append_tree(self) -> _ocdbt.Tree:
        """Append the documents and the B+tree to a data file still open (or a new one)."""
        file_id, index = next(iter(self._open.values())) if self._open else self._file()
        entries = [(k, _ocdbt.Placed(file_id, index.value(v), len(v))) for k, v in self._documents]
        entries += self._entries
        tree = _ocdbt.encode_tree(self._paths, ((k.encode(), at) for k, at in entries), file_id, index.size)
        for node in tree.nodes:
            index.value(node)
        return tree

    def close(self) -> None:
        self._threads.close()  # unstarted shards are dropped
        while self._open:
            self._open.popitem()[1][1].close(finish=False)
        if self._disk is not None:
            self._disk.close()


def merge(staging: Location, world: int) -> None:
    """Make one database of the ranks' (rank 0, before the commit marker): their B-trees are
    copied into the root database in one atomic transaction; their data files stay put."""
    ctx = _store.context()
    parent = ts.KvStore.open(database(staging), context=ctx).result()
    txn = ts.Transaction(atomic=True)
    children = [ts.KvStore.open(database(staging, rank_base(r)), context=ctx) for r in range(world)]
    copies = [c.result().experimental_copy_range_to(parent.with_transaction(txn)) for c in children]
    for copy in copies:
        copy.result()
    txn.commit_async().result()


def objects(metas: Iterable[ArrayMeta]) -> int:
    """How many objects a plain checkpoint of these arrays stores: a shard per grid cell and a
    document per array."""
    return sum(math.prod(-(-n // s) for n, s in zip(a.shape, a.shard_shape)) + 1 for a in metas)


def choose(packing: str, metas: Iterable[ArrayMeta]) -> str:
    """The packing of a save asked for ``packing`` (``auto`` packs above ``PACK_ABOVE_OBJECTS``)."""
    if packing != "auto":
        return packing
    return "ocdbt" if objects(metas) > PACK_ABOVE_OBJECTS else "files"
