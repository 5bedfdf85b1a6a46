"""Packed checkpoints: the arrays' objects in TensorStore's OCDBT key-value store.

A plain checkpoint stores one object per shard and per document, which on an FSDP-style layout
is one file per array per rank: millions at scale, each a metadata operation on a parallel file
system and a request on an object store. A packed one stores the same objects (the same keys,
the same bytes) in an OCDBT database instead, the format Orbax uses: each rank writes its share
into a database of its own under ``packs/RRRRR/``, one data file per ``IOConfig.pack_bytes``
of shards, and rank 0's commit merges the ranks' B-trees into one database at the checkpoint's
root, referring to the ranks' data files where they lie (no byte is copied). Plain
``tensorstore`` opens every array with an ``ocdbt`` kvstore over the checkpoint
(``docs/format.md`` section 3.1).

The commit marker (the root ``zarr.json``) and the per-rank documents stay plain objects beside
the database (``in_pack``), so a checkpoint is found, listed and committed as any other.
"""

from __future__ import annotations

import errno
import functools
import math
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import attrs
import tensorstore as ts

from ..base import _faults
from ..base._metrics import InFlight
from ..base._options import IOConfig
from . import _os, _store
from ._location import MAX_DOCUMENT_BYTES, LocalDir
from ._readers import BoxReader, PackedFileReader, TensorStoreReader
from ._writers import ShardObjectWriter

if TYPE_CHECKING:
    from ..format._format import ArrayMeta, CheckpointMeta
    from ._location import Location

# Where rank r's database lies until the commit merges it (its data files stay there).
PACKS = "packs"
# ``packing="auto"`` packs a checkpoint of more objects than this; a smaller one stays plain
# files, which plain zarr-python reads.
PACK_ABOVE_OBJECTS = 1000


def in_pack(key: str) -> bool:
    """Whether the object at ``key`` lives in the database: every group and array document and
    every shard; not the commit marker nor the per-rank documents (hidden keys)."""
    return key != "zarr.json" and not key.startswith(".")


def rank_base(rank: int) -> str:
    return f"{PACKS}/{rank:05d}"


# A rank's shards go into up to this many data files, none smaller than ``MIN_PACK_BYTES``
# unless the rank has less: a transaction's data file is written while the next one fills, so
# all but the last file's writing overlaps the encoding, where one transaction for everything
# would start writing only once every shard is encoded.
PACKS_PER_RANK = 4
MIN_PACK_BYTES = 64 << 20


def pack_io(io: IOConfig, nbytes: int) -> IOConfig:
    """``io`` for a rank packing ``nbytes`` of shards: ``pack_bytes`` lowered to a
    ``PACKS_PER_RANK``-th of them, down to ``MIN_PACK_BYTES``."""
    share = max(MIN_PACK_BYTES, -(-nbytes // PACKS_PER_RANK))
    return io if share >= io.pack_bytes else io.replace(pack_bytes=share)


# The configuration of the ranks' databases: every value out of line, in a data file, so that
# layoutckpt's own reader finds each shard as a byte range (``PackedFileReader``).
OUT_OF_LINE = {"max_inline_value_bytes": 0}


def database(location: Location, rel: str = "", config: dict[str, Any] | None = None) -> dict[str, Any]:
    """The kvstore spec of the OCDBT database whose files lie at ``rel`` under ``location``;
    ``config`` constrains a database being created."""
    return {"driver": "ocdbt", "base": location.kvstore(rel), **({"config": config} if config else {})}


@attrs.frozen
class PackView:
    """What TensorStore needs of a location to open arrays in a database: ``kvstore``."""

    location: Location
    base: str = ""
    config: dict[str, Any] | None = None

    def kvstore(self, rel: str = "") -> dict[str, Any]:
        return {**database(self.location, self.base, self.config), "path": rel.rstrip("/") + "/" if rel else ""}

    @functools.cached_property
    def _kv(self) -> ts.KvStore:
        return ts.KvStore.open(self.kvstore(), context=_store.context()).result()

    def read(self, key: str, max_bytes: int = MAX_DOCUMENT_BYTES) -> bytes | None:
        """A document: from the database where ``in_pack`` says so, else a plain object."""
        if not in_pack(key):
            return self.location.read(key, max_bytes)
        got = _store.read_result(self._kv.read(key), key, self.location.url)
        if got.state != "value":
            return None
        if len(got.value) > max_bytes:
            raise _os.NotRegularFile(errno.EFBIG, f"{len(got.value)} bytes, above the limit of {max_bytes}", key)
        return bytes(got.value)

    def box_reader(self, where: str, complete: bool, io: IOConfig) -> BoxReader:
        """The reader of the arrays: on a local disk, layoutckpt's own reader of the database's
        data files; elsewhere TensorStore, through the database."""
        through = TensorStoreReader(self, where, complete, io)
        if isinstance(self.location, LocalDir) and not self.base:
            return PackedFileReader(self.location.root, where, complete, io, through)
        return through


def arrays_of(location: Location, meta: CheckpointMeta) -> Location | PackView:
    """Where a checkpoint's arrays and documents are read: ``kvstore``, ``read``, ``box_reader``."""
    return PackView(location) if meta.packed else location


class PackWriter(ShardObjectWriter):
    """This rank's shards and documents into its own database: each run of ``io.pack_bytes``
    is one transaction, so one data file. A transaction holds its encoded shards until it
    commits, and one commits at a time: a save holds at most about two transactions' bytes
    (the one committing, the one filling) besides its own."""

    def __init__(self, staging: Location, rank: int, io: IOConfig, in_flight: InFlight | None = None) -> None:
        super().__init__(PackView(staging, rank_base(rank), OUT_OF_LINE), io, in_flight)
        self.staging = staging
        self._data = staging.root / rank_base(rank) / "d" if isinstance(staging, LocalDir) else None
        self._flushing: set[str] = set()  # data files whose writeback was started
        self._txn = _transaction()
        self._txn_bytes = 0
        self._commits: list[Any] = []
        self._writes: list[Any] = []  # into a transaction: done once it commits
        self._paths: list[str] = []  # the arrays of the shards written

    def _store(self, key: str, value: bytearray, nbytes: int, path: str) -> None:
        with self._lock:
            self._writes.append(self._kv.with_transaction(self._txn).write(key, value))
            self._paths.append(path)
            self.in_flight.done(nbytes)  # in the transaction: the source is no longer needed
            self._txn_bytes += len(value)
            if self._txn_bytes >= self.io.pack_bytes:
                self._commit()

    def write_documents(self, items: Iterable[tuple[str, bytes]]) -> None:
        plain = []
        with self._lock:
            kv = self._kv.with_transaction(self._txn)
            for key, data in items:
                if in_pack(key):
                    self._writes.append(kv.write(key, data))
                else:
                    plain.append((key, data))
        self.staging.write_many(plain)

    def _commit(self) -> None:
        # One commit at a time: OCDBT writes commits pending together as one data file, and each
        # one waited for bounds what is held to two transactions (this one, the one filling).
        if self._commits:
            self._commits[-1].result()
            self._start_writeback()
        self._commits.append(self._txn.commit_async())
        self._txn, self._txn_bytes = _transaction(), 0

    def _start_writeback(self) -> None:
        """Ask the kernel to start writing the data files committed so far to a local disk
        (``_os.start_writeback``): TensorStore writes them through the page cache, where the
        save's final sync would find them all still in memory. No commit is in flight here, so
        every file listed is whole."""
        if self._data is None or not self._data.is_dir():
            return
        for name in os.listdir(self._data):
            if name not in self._flushing:
                self._flushing.add(name)
                fd = os.open(self._data / name, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    _os.start_writeback(fd)
                finally:
                    os.close(fd)

    def join(self) -> int:
        written = self._threads.join()
        with self._lock:
            self._commit()
        for c in self._commits:
            c.result()
        for w in self._writes:
            w.result()
        for path in self._paths:
            _faults.point("save.box_written", name=path)
        return written + self._others.join()

    def close(self) -> None:
        self._threads.close()
        with self._lock:
            self._txn.abort()  # what no commit took (nothing after ``join``)
        for c in self._commits:
            try:
                c.result()
            except Exception:  # noqa: BLE001 - join raises the first failure
                pass
        super().close()


def _transaction() -> ts.Transaction:
    # Atomic: OCDBT writes it as one data file at its commit. A plain transaction may be written
    # back in parts as TensorStore's cache fills (and layoutckpt's cache holds nothing), each
    # part a data file of its own.
    return ts.Transaction(atomic=True)


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
