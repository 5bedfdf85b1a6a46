"""Held memory: a checkpoint kept in this process as the host arrays it was written from.

A multi-tier manager's ``memory://`` fast tier registers its root here (``register``); from
then on ``locate`` gives a ``HeldPrefix`` for that root and every URL under it, so ``lc.load``,
``lc.open`` and ``Reader`` take a piece's URL as they take any other. Nothing is encoded:
documents are kept as bytes, and an array as a reference to the host array its writer was
given (a lent ``HeldArray``: no copy at all) or, from any other source, as one copy of it. A
read copies the requested box straight out of that array into the destination
(``HeldReader``), one copy in all; TensorStore's ``memory://`` store would encode every save
and decode every restore.

A lent array stays its lender's until the checkpoint holding it is retired or discarded; then
its ``release`` gives it back (to the tier's buffer pool, for the next save). A read that
overlaps the retirement of its array cannot trust what it copied, and raises rather than
return bytes that a later save may have overwritten.

The commit is ``KvPrefix``'s: a save writes in place under a pending marker, the root
``zarr.json`` last; retire deletes the marker first. Other ``memory://`` URLs still go to
TensorStore's memory store. What is held is gone when the process ends.
"""

from __future__ import annotations

import errno
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

import attrs
import numpy as np

from ..base import _faults
from ..base._errors import CheckpointExistsError
from ..base._metrics import InFlight
from ..base._options import IOConfig
from ..format._dtypes import numpy_dtype
from ..layout._plan import Box, box_shape, box_view, row_pieces
from . import _os, _store
from ._location import MARKER, MAX_DOCUMENT_BYTES, PENDING, MarkerCommit
from ._readers import BoxReader, Lease
from ._writers import BoxWriter, Source

if TYPE_CHECKING:
    from ..format._format import ArrayMeta

SCHEME = "memory://"


class Lender(Protocol):
    def give_back(self, lent: HeldArray) -> None:
        """``lent`` is released: the first call for it counts, later ones do nothing."""


class HeldArray:
    """One stored array: its elements and, where they were lent (``lender``), who gets them
    back once the array is dropped (``release``). Given to a writer as its source, a lent array
    is kept as it is; one that is copied instead is released at once. One small object per
    array: a lock, a callback or a second object each would be objects that live as long as the
    piece, which the garbage collector promotes (``HostBuffers.view``)."""

    __slots__ = ("alive", "data", "lender")

    def __init__(self, data: np.ndarray, lender: Lender | None = None) -> None:
        self.data = data
        self.lender = lender
        self.alive = True  # False from the moment it is dropped: a read overlapping that fails

    def wait(self) -> np.ndarray:
        return self.data

    def release(self) -> None:
        if self.lender is not None:
            self.lender.give_back(self)


class HeldRoot:
    """Everything stored under one registered root, by key relative to it; thread-safe.

    Keys are kept by their first segment (a step's folder, ``step_00000001``), then the rest:
    retiring a step and listing one touch that step's keys only, not every step's."""

    def __init__(self, path: str) -> None:
        self.path = path  # "run/0": the root's URL without its scheme
        self._lock = threading.Lock()
        self._docs: dict[str, dict[str, bytes]] = {}
        self._arrays: dict[str, dict[str, HeldArray]] = {}  # array paths: "step_00000001" -> "model/w"

    def read(self, key: str) -> bytes | None:
        top, rest = _split(key)
        return self._docs.get(top, {}).get(rest)

    def write(self, key: str, data: bytes) -> None:
        top, rest = _split(key)
        with self._lock:
            self._docs.setdefault(top, {})[rest] = bytes(data)

    def array(self, key: str) -> HeldArray | None:
        top, rest = _split(key)
        return self._arrays.get(top, {}).get(rest)

    def put_array(self, key: str, array: HeldArray) -> None:
        top, rest = _split(key)
        with self._lock:
            folder = self._arrays.setdefault(top, {})
            old = folder.pop(rest, None)
            folder[rest] = array
        _drop([old] if old is not None else [])

    def keys(self, prefix: str) -> list[str]:
        """Every key under ``prefix`` (documents, and array paths), relative to the root."""
        with self._lock:
            found = _matching(self._docs, prefix) + _matching(self._arrays, prefix)
        return sorted(found)

    def delete(self, prefix: str, keep: str | None = None) -> None:
        """Drop everything under ``prefix`` but the document ``keep``; lent arrays go back."""
        with self._lock:
            for k in _matching(self._docs, prefix):
                if k != keep:
                    top, rest = _split(k)
                    del self._docs[top][rest]
            dropped = []
            for k in _matching(self._arrays, prefix):
                top, rest = _split(k)
                dropped.append(self._arrays[top].pop(rest))
            for store in (self._docs, self._arrays):
                for top in [t for t, folder in store.items() if not folder]:
                    del store[top]
        _drop(dropped)

    def delete_document(self, key: str) -> None:
        top, rest = _split(key)
        with self._lock:
            self._docs.get(top, {}).pop(rest, None)


def _split(key: str) -> tuple[str, str]:
    top, _, rest = key.partition("/")
    return top, rest


def _matching(store: dict[str, dict[str, Any]], prefix: str) -> list[str]:
    """The keys of ``store`` (by first segment) that start with ``prefix``."""
    top, slash, rest = prefix.partition("/")
    if slash:
        return [f"{top}/{r}" for r in store.get(top, {}) if r and r.startswith(rest)]
    return [f"{t}/{r}" if r else t for t, folder in store.items() if t.startswith(prefix) for r in folder]


def _drop(arrays: list[HeldArray]) -> None:
    """Mark ``arrays`` dropped, then give lent ones back: outside the root's lock, since a
    release may run the lender's code (a pool's condition)."""
    for a in arrays:
        a.alive = False
    for a in arrays:
        a.release()


# The registered roots, by path ("run/0"): process-wide, as the memory they hold is.
_ROOTS: dict[str, HeldRoot] = {}
_ROOTS_LOCK = threading.Lock()


def register(url: str) -> HeldRoot:
    """Hold everything saved under ``url`` (``memory://...``) as host arrays from now on; the
    root already registered there, if any (a later manager restores what an earlier one held)."""
    path = _path_of(url)
    if not path:
        raise ValueError(f"{url!r} names no prefix; a memory tier needs one, such as memory://run/{{rank}}")
    with _ROOTS_LOCK:
        root = _ROOTS.get(path)
        if root is not None:
            return root
        clash = [p for p in _ROOTS if _under(path, p) or _under(p, path)]
        if clash:
            raise ValueError(
                f"{url!r} would hold, or lie inside, the memory tier {SCHEME + clash[0]!r}; give each tier a "
                "prefix of its own, such as memory://run/{rank}"
            )
        root = _ROOTS[path] = HeldRoot(path)
        return root


def held_at(url: str) -> HeldPrefix | None:
    """The held location of ``url``, or None where no registered root holds it (``locate``)."""
    path = _path_of(url)
    with _ROOTS_LOCK:
        root = next((r for p, r in _ROOTS.items() if path == p or _under(path, p)), None)
    if root is None:
        return None
    rel = path[len(root.path) :].strip("/")
    return HeldPrefix(root, rel + "/" if rel else "", SCHEME + path)


def _path_of(url: str) -> str:
    return url.removeprefix(SCHEME).strip("/")


def _under(path: str, root: str) -> bool:
    return path.startswith(root + "/")


@attrs.frozen(eq=False)
class HeldPrefix(MarkerCommit):
    """A key prefix of a registered root (``HeldRoot``); commit by marker, as ``KvPrefix``."""

    root: HeldRoot
    prefix: str  # "" for the root itself, else "step_00000001/"
    url: str

    @property
    def is_local(self) -> bool:
        return False  # every process holds its own: no rank sees another's

    def kvstore(self, rel: str = "") -> dict[str, Any]:
        raise ValueError(
            f"{self.url!r} is held as host arrays in this process (a memory tier), not as TensorStore "
            "keys; read it with lc.load or Reader.read, or save it elsewhere for a TensorStore view"
        )

    def read(self, key: str, max_bytes: int = MAX_DOCUMENT_BYTES) -> bytes | None:
        data = self.root.read(self.prefix + key)
        if data is not None and len(data) > max_bytes:
            raise _os.NotRegularFile(errno.EFBIG, f"{len(data)} bytes, above the limit of {max_bytes}", key)
        return data

    def write(self, key: str, data: bytes) -> None:
        self.root.write(self.prefix + key, data)

    def write_many(self, items: Iterable[tuple[str, bytes]]) -> None:
        for key, data in items:
            self.write(key, data)

    def keys(self, prefix: str = "") -> list[str]:
        """The keys under this prefix (relative to it), or those starting with ``prefix``."""
        return [k[len(self.prefix) :] for k in self.root.keys(self.prefix + prefix)]

    def exists(self) -> bool:
        return bool(self.root.keys(self.prefix))

    def committed(self) -> bool:
        return self.read(MARKER) is not None

    def missing_hint(self) -> str:
        if self.read(PENDING) is not None:
            return " (the prefix holds an unfinished save: it has no commit marker)"
        return " (a memory tier holds only what this process saved there; it is gone once the process ends)"

    def box_reader(self, where: str, complete: bool, io: IOConfig) -> BoxReader:
        return HeldReader(self, where, complete, io)

    def box_writer(self, io: IOConfig, in_flight: InFlight | None = None) -> BoxWriter:
        return HeldWriter(self, io, in_flight)

    def array(self, meta: ArrayMeta) -> HeldArray | None:
        return self.root.array(self.prefix + meta.path)

    def put_array(self, meta: ArrayMeta, array: HeldArray) -> None:
        self.root.put_array(self.prefix + meta.path, array)

    # -- the save's life cycle (as KvPrefix's) ---------------------------------------------
    def check_destination(self, overwrite: bool) -> None:
        if self.committed():
            if not overwrite:
                raise CheckpointExistsError(
                    f"a committed checkpoint already exists at {self.url!r}; save to a new path, or retire it first"
                )
            raise CheckpointExistsError(
                f"a committed checkpoint exists at {self.url!r}, in a memory tier, which writes in place: "
                "save to a new prefix and delete the old one after"
            )
        if self.exists() and self.read(PENDING) is None:
            raise CheckpointExistsError(f"{self.url!r} holds data that is not a layoutckpt checkpoint")

    def make_durable(self) -> None:
        """Nothing to do: held memory is as durable as this process."""

    def drop_pending(self) -> None:
        self.root.delete_document(self.prefix + PENDING)

    def retire(self) -> None:
        """Delete a committed checkpoint: the marker first, so it is never listed half deleted."""
        self.root.delete_document(self.prefix + MARKER)
        self.write(PENDING, b"layoutckpt deleting this checkpoint\n")
        self.discard()

    def discard(self) -> None:
        # The pending marker goes last, as on an object store.
        self.root.delete(self.prefix, keep=self.prefix + PENDING)
        self.root.delete_document(self.prefix + PENDING)


class HeldWriter(BoxWriter):
    """Keeps each box's array: a lent one as it is (released when dropped), any other copied
    once (released at once). A box that is part of an array is copied into a whole array."""

    def __init__(self, location: HeldPrefix, io: IOConfig, in_flight: InFlight | None = None) -> None:
        super().__init__(io, in_flight)
        self.location = location
        self._bytes = 0

    def write(self, meta: ArrayMeta, box: Box, source: Source) -> None:
        data = source.wait()
        shape, dtype = tuple(meta.shape), numpy_dtype(meta.dtype)
        whole = box_shape(box) == shape and all(a == 0 for a, _ in box)
        if callable(data):
            data = data(box)
        data = np.asarray(data)
        self.in_flight.start(data.nbytes)
        if whole and isinstance(source, HeldArray) and data.dtype == dtype and data.shape == shape:
            self.location.put_array(meta, source)  # released when dropped
        else:
            try:
                self._copy(meta, box, data, shape, dtype, whole)
            finally:
                source.release()
        self.in_flight.done(data.nbytes)
        self._bytes += data.nbytes
        _faults.point("save.box_written", name=meta.path)

    def _copy(
        self, meta: ArrayMeta, box: Box, data: np.ndarray, shape: tuple[int, ...], dtype: np.dtype, whole: bool
    ) -> None:
        held = None if whole else self.location.array(meta)
        if held is None:
            held = HeldArray(np.zeros(shape, dtype))
            self.location.put_array(meta, held)
        np.copyto(box_view(held.data, box), data.reshape(box_shape(box)), casting="no")

    def write_documents(self, items: Iterable[tuple[str, bytes]]) -> None:
        self.location.write_many(items)

    def join(self) -> int:
        return self._bytes

    def close(self) -> None:
        """Nothing under way: every write finished in ``write``."""


class HeldReader(BoxReader):
    """Copies boxes out of held arrays, on the read engine's threads (large boxes in pieces, so
    that several threads copy one array)."""

    blocking = True

    def __init__(self, location: HeldPrefix, where: str, complete: bool, io: IOConfig) -> None:
        super().__init__(where, complete, io)
        self.location = location

    def pieces(self, meta: ArrayMeta, box: Box, *, stream: bool) -> list[tuple[Box, bool]]:
        itemsize = numpy_dtype(meta.dtype).itemsize
        return [(piece, False) for piece in row_pieces(box, 1, itemsize, self.io.piece_bytes)]

    def read(self, name: str, meta: ArrayMeta, box: Box, out: np.ndarray, *, prefetch: bool = False) -> int:
        held = self.location.array(meta)
        if held is None:
            raise self._damaged(name, missing=True, detail="the array is not held (retired, or never written)")
        if held.data.shape != tuple(meta.shape) or held.data.dtype != out.dtype:
            detail = f"held as {held.data.dtype}{list(held.data.shape)}, saved as {meta.dtype}{list(meta.shape)}"
            raise self._damaged(name, missing=False, detail=detail)
        np.copyto(out, box_view(held.data, box), casting="no")
        if not held.alive:  # retired while we copied: a later save may have overwritten it
            raise self._damaged(name, missing=True, detail="the piece was retired while it was being read")
        return out.nbytes

    def lend(self, name: str, meta: ArrayMeta, box: Box) -> Lease | None:
        """The held array's box itself: a GPU copies it straight from the pinned buffer a save
        staged it in, with no copy into a buffer of the read's own."""
        held = self.location.array(meta)
        if held is None or held.data.shape != tuple(meta.shape) or held.data.dtype != numpy_dtype(meta.dtype):
            return None  # the read reports what is wrong

        def check() -> None:
            if not held.alive:
                raise self._damaged(name, missing=True, detail="the piece was retired while it was being read")

        return Lease(box_view(held.data, box), check)

    def _damaged(self, name: str, *, missing: bool, detail: str) -> Exception:
        return _store.damaged(name, self.where, missing=missing, detail=detail)
