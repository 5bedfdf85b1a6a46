"""How a box of an array is written, behind one interface (``BoxWriter``).

A location says which writer it needs (``Location.box_writer``). Every box that is one whole
shard, as a save's plan makes them, is encoded by layoutckpt itself (``_shardfile``) on
``io.threads`` threads. A local directory's writer writes it as a shard file: a chunk goes from
the source's memory to the file, a large shard goes past the page cache (``io.direct_io``), and
every file's writeback starts as it is closed. On any other store (object stores, ``memory://``,
a packed checkpoint's database) the shard is one value of a TensorStore key-value store. A box
that is part of a shard is written by TensorStore's zarr driver, which cannot add a binding
block: only arrays whose shards are not bound to a save take such boxes. All write the same
bytes (``docs/format.md`` section 5.4).
"""

from __future__ import annotations

import abc
import math
import threading
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import tensorstore as ts

from ..base import _faults
from ..base._metrics import InFlight
from ..base._options import IOConfig
from ..base._workers import Workers
from ..format._dtypes import numpy_dtype
from ..layout._plan import Box, box_shape, shard_cell
from . import _shardfile, _store

if TYPE_CHECKING:
    from ..format._format import ArrayMeta


class Source(Protocol):
    """What a box is written from. ``wait()`` gives the box's elements as an array, or a
    function ``read(box)`` that gives those of any box of the array; ``release()`` says the
    writer is done with them (a staging buffer goes back to its pool at once: the next shard's
    staging may be waiting for exactly this one)."""

    def wait(self) -> np.ndarray | Callable[[Box], np.ndarray]: ...

    def release(self) -> None: ...


class BoxWriter(abc.ABC):
    """Writes boxes of one checkpoint's arrays; ``in_flight`` counts the writes under way."""

    def __init__(self, io: IOConfig, in_flight: InFlight | None = None) -> None:
        self.io = io
        self.in_flight = in_flight if in_flight is not None else InFlight()

    @abc.abstractmethod
    def write(self, meta: ArrayMeta, box: Box, source: Source) -> None:
        """Start writing ``box`` of the array ``meta`` from ``source``, released once written.
        May wait for ``source``; a failure here or in a write under way is raised by ``join``."""

    @abc.abstractmethod
    def join(self) -> int:
        """Wait for every write; the bytes of the boxes written. Raises the first failure."""

    @abc.abstractmethod
    def write_documents(self, items: Iterable[tuple[str, bytes]]) -> None:
        """Write the small documents ``(key, bytes)`` of this rank's share (``hierarchy``)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Drop the writes not started and wait for those under way; always called last, after
        ``join`` or after a failure (a source still waited for must fail first)."""

    def __enter__(self) -> BoxWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def box_nbytes(meta: ArrayMeta, box: Box) -> int:
    return numpy_dtype(meta.dtype).itemsize * math.prod(box_shape(box))


class TensorStoreWriter(BoxWriter):
    """Through TensorStore, onto any key-value store: every write in flight at once, bounded by
    ``io.concurrency`` requests."""

    def __init__(self, location: Any, io: IOConfig, in_flight: InFlight | None = None) -> None:
        super().__init__(io, in_flight)
        self.location = location
        self._ctx = _store.context(io.concurrency, io.retries)
        self._opened: dict[str, Any] = {}
        self._pending: list[tuple[Any, str]] = []  # (write, array path)
        self._bytes = 0

    def write(self, meta: ArrayMeta, box: Box, source: Source) -> None:
        if meta.bound_to is not None:
            # Internal invariant: a save's plan makes whole shards only, which layoutckpt encodes.
            raise ValueError(
                f"array {meta.path!r}: the box {list(box)} would be written by TensorStore's zarr driver "
                "(it is not one whole shard), which cannot add the binding block its shards need (they "
                "are bound to their save); write whole shards of shard_shape "
                f"{list(meta.shard_shape)}, or an unbound array"
            )
        if meta.path not in self._opened:
            self._opened[meta.path] = _store.open_array(self._ctx, self.location, meta)
        store = self._opened[meta.path].result()
        data = source.wait()
        if callable(data):
            data = data(box)  # TensorStore stores a shard as one value: the box is read whole
        target = store[tuple(slice(a, b) for a, b in box)] if box else store
        self.in_flight.start(data.nbytes)
        # The write may keep the source until it is stored (no copy): it goes back at the commit.
        w = target.write(data, can_reference_source_data_indefinitely=True)

        def settled(_: Any, nbytes: int = data.nbytes) -> None:
            self.in_flight.done(nbytes)
            source.release()

        w.commit.add_done_callback(settled)
        self._pending.append((w, meta.path))
        self._bytes += data.nbytes

    def write_documents(self, items: Iterable[tuple[str, bytes]]) -> None:
        self.location.write_many(items)

    def join(self) -> int:
        for w, name in self._pending:
            w.result()
            _faults.point("save.box_written", name=name)
        return self._bytes

    def close(self) -> None:
        for w, _ in self._pending:
            try:
                w.result()
            except Exception:  # noqa: BLE001 - join raises the first failure
                pass
        self._pending = []
        self._opened.clear()


class _WholeShards(BoxWriter):
    """A writer that writes each box that is one whole shard itself, on one of ``io.threads``
    threads (``_whole``), and hands every other box to TensorStore."""

    def __init__(self, name: str, location: Any, io: IOConfig, in_flight: InFlight | None) -> None:
        super().__init__(io, in_flight)
        self._threads = Workers(name, io.threads)
        self._others = TensorStoreWriter(location, io, self.in_flight)

    def write(self, meta: ArrayMeta, box: Box, source: Source) -> None:
        cell = shard_cell(box, meta.shape, meta.shard_shape)
        if cell is None:
            self._others.write(meta, box, source)
        else:
            self._threads.submit(self._whole, meta, box, cell, source)

    def _whole(self, meta: ArrayMeta, box: Box, cell: tuple[int, ...], source: Source) -> int:
        """Write one whole shard; the array bytes written."""
        raise NotImplementedError

    def write_documents(self, items: Iterable[tuple[str, bytes]]) -> None:
        self._others.write_documents(items)


def staged_size(meta: ArrayMeta, box: Box, data: Any) -> tuple[int, np.dtype]:
    """The array bytes and dtype of a box's staged ``data`` (an array, or a function of it)."""
    if isinstance(data, np.ndarray):
        return data.nbytes, data.dtype
    return box_nbytes(meta, box), numpy_dtype(meta.dtype)


class ShardFileWriter(_WholeShards):
    """A local directory: a box that is one whole shard becomes its shard file
    (``_shardfile``), written on one of ``io.threads`` threads; other boxes go to TensorStore."""

    def __init__(self, root: Path, location: Any, io: IOConfig, in_flight: InFlight | None = None) -> None:
        self._files = _shardfile.ShardFiles(root, io)
        super().__init__("layoutckpt-write", location, io, in_flight)

    def _whole(self, meta: ArrayMeta, box: Box, cell: tuple[int, ...], source: Source) -> int:
        try:
            data = source.wait()
            nbytes, dtype = staged_size(meta, box, data)
            self.in_flight.start(nbytes)
            self._files.write(meta, cell, dtype, data, start_writeback=True)
            self.in_flight.done(nbytes)
            _faults.point("save.box_written", name=meta.path)
            return nbytes
        finally:
            source.release()

    def join(self) -> int:
        return self._others.join() + self._threads.join()

    def close(self) -> None:
        self._others.close()
        # Unstarted shards are dropped; a thread may still be writing from a staged buffer.
        self._threads.close()
        self._files.close()


class ShardObjectWriter(_WholeShards):
    """A key-value store: a box that is one whole shard is encoded on one of ``io.threads``
    threads and stored as one value; other boxes go to TensorStore. TensorStore's zarr driver
    would open each array first (a cost that dominates saves of many small arrays) and copy
    each chunk into a buffer of its own before assembling the shard; here the source goes back
    once encoded, and at most ``io.budget_bytes`` of encoded shards wait for their store."""

    def __init__(self, location: Any, io: IOConfig, in_flight: InFlight | None = None) -> None:
        # The store first: a store that does not open leaves no threads behind.
        self._ctx = _store.context(io.concurrency, io.retries)
        self._kv = ts.KvStore.open(location.kvstore(), context=self._ctx).result()
        super().__init__("layoutckpt-encode", location, io, in_flight)
        self.location = location
        self._lock = threading.Lock()
        # (write, array bytes, encoded bytes, array path), oldest first
        self._stores: deque[tuple[Any, int, int, str]] = deque()
        self._waiting = 0  # encoded bytes whose store is under way

    def _whole(self, meta: ArrayMeta, box: Box, cell: tuple[int, ...], source: Source) -> int:
        try:
            data = source.wait()
            nbytes, dtype = staged_size(meta, box, data)
            self.in_flight.start(nbytes)
            value = _shardfile.shard_value(meta, cell, dtype, data, self.io.group_bytes)
        finally:
            source.release()
        self._store(f"{meta.path}/{meta.chunk_key(cell)}", value, nbytes, meta.path)
        return nbytes

    def _store(self, key: str, value: bytearray, nbytes: int, path: str) -> None:
        """Put one encoded shard in flight (TensorStore copies the value); wait for the oldest
        while the bytes under way exceed the budget."""
        with self._lock:
            self._stores.append((self._kv.write(key, value), nbytes, len(value), path))
            self._waiting += len(value)
            while self._waiting > self.io.budget_bytes and len(self._stores) > 1:
                self._settle_oldest()

    def _settle_oldest(self) -> None:
        write, nbytes, encoded, path = self._stores.popleft()
        try:
            write.result()
        finally:
            self._waiting -= encoded
            self.in_flight.done(nbytes)
        _faults.point("save.box_written", name=path)

    def join(self) -> int:
        written = self._threads.join()
        with self._lock:
            while self._stores:
                self._settle_oldest()
        return written + self._others.join()

    def close(self) -> None:
        self._others.close()
        self._threads.close()  # unstarted shards are dropped
        with self._lock:
            stores, self._stores = self._stores, deque()
        for write, *_ in stores:
            try:
                write.result()
            except Exception:  # noqa: BLE001 - join raises the first failure
                pass
