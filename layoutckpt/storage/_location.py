"""Where a checkpoint lives: a local directory, or a key prefix of an object store.

Arrays go through TensorStore (except whole shards a save writes to a local directory, which
``_shardfile`` writes, byte for byte as TensorStore would); a location only says which key-value
store (``file``, ``s3``, ``gcs``, ``memory``) holds them, and owns the few small documents and the
commit.

The commit differs because the stores differ. A local save writes a hidden sibling directory
and renames it into place: the rename is atomic, so ``overwrite=True`` is crash-safe too. Object
stores have no rename, so a save writes in place, the root ``zarr.json`` last: until that
marker exists the prefix is not a checkpoint, and a crash before it leaves nothing a reader
would take for one. A ``.layoutckpt-pending`` object, written first and deleted last, marks
the prefix as an unfinished save of ours, so the next save may clear it; a prefix holding
anything else is never touched.

Paths: ``/local/dir`` or ``file:///local/dir``; ``s3://bucket/prefix`` (endpoint from
``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``, region from ``AWS_REGION`` or
``AWS_DEFAULT_REGION``, credentials from TensorStore's usual AWS chain: the ``AWS_*``
variables, ``~/.aws``, instance metadata); ``gs://bucket/prefix`` (Google's default
credentials); ``memory://prefix`` (this process's memory, for tests and notebooks); or a
TensorStore kvstore JSON spec as a dict, for anything else those drivers accept.
"""

from __future__ import annotations

import abc
import errno
import functools
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs
import tensorstore as ts

from ..base import _faults
from ..base._errors import CheckpointExistsError, CheckpointNotFoundError, FormatError, SaveError
from ..base._metrics import InFlight, logger
from ..base._options import IOConfig
from ..base._workers import Workers
from ..format._format import MAX_ROOT_DOCUMENT_BYTES
from . import _commit, _os
from ._readers import BoxReader, ShardFileReader, TensorStoreReader
from ._writers import BoxWriter, ShardFileWriter, ShardObjectWriter

MARKER = "zarr.json"
# The largest group or array document a reader takes (the root document has its own limit).
MAX_DOCUMENT_BYTES = 64 << 20
PENDING = ".layoutckpt-pending"
SCHEMES = ("file", "s3", "gs", "memory")


@functools.cache
def shared_context() -> ts.Context:
    """The process-wide parent of every context layoutckpt makes: ``memory://`` data lives in
    a context's memory store, so saves and loads must share one for it to outlive a call."""
    return ts.Context()


def locate(path: str | os.PathLike[str] | Mapping[str, Any] | Location) -> Location:
    """The location a user's path names (see the module docstring for the forms)."""
    if isinstance(path, Location):
        return path
    if isinstance(path, Mapping):
        spec = dict(path)
        if "driver" not in spec:
            raise ValueError(f"a kvstore spec needs a 'driver' member, got {spec!r}")
        if spec["driver"] == "file":
            return _file_spec(spec)
        spec["path"] = _as_prefix(spec.get("path", ""))
        return KvPrefix(spec, _url_of(spec))
    text = os.fspath(path)
    scheme, sep, rest = text.partition("://")
    if not sep or scheme == "file":
        return LocalDir(_local_root(rest if sep else text))
    if scheme == "memory":
        from ._held import held_at  # a memory tier's root holds host arrays (``_held``)

        held = held_at(text)
        if held is not None:
            return held
        return KvPrefix({"driver": "memory", "path": _as_prefix(rest)}, text)
    if scheme in ("s3", "gs"):
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise ValueError(f"{text!r} names no bucket; write {scheme}://BUCKET/PREFIX")
        spec = {"driver": "s3" if scheme == "s3" else "gcs", "bucket": bucket, "path": _as_prefix(prefix)}
        if scheme == "s3":
            endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
            region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
            if endpoint:
                spec["endpoint"] = endpoint
            if region:
                spec["aws_region"] = region
        return KvPrefix(spec, text)
    raise ValueError(
        f"unsupported storage {scheme + '://'!r} in {text!r}; use a local path, file://, s3://, gs://, "
        "memory://, or a TensorStore kvstore spec (a dict)"
    )


def _file_spec(spec: dict[str, Any]) -> LocalDir:
    """A ``file`` kvstore spec names a local directory, saved and read as the path itself is."""
    if set(spec) != {"driver", "path"} or not isinstance(spec["path"], str) or not spec["path"]:
        raise ValueError(
            f"a 'file' kvstore spec takes a non-empty 'path' and nothing else, got {spec!r}; pass the "
            "directory's path itself"
        )
    return LocalDir(_local_root(spec["path"]))


def _local_root(text: str) -> Path:
    """The absolute path ``text`` names. A ``..`` is resolved as the kernel resolves it (through
    any link before it), since TensorStore's file driver refuses paths that hold one."""
    path = Path(text).absolute()
    if ".." not in path.parts:
        return path
    if path.name == "..":
        return path.resolve()
    return path.parent.resolve() / path.name


def _as_prefix(path: str) -> str:
    path = path.strip("/")
    return path + "/" if path else ""


def _url_of(spec: Mapping[str, Any]) -> str:
    scheme = {"gcs": "gs", "file": "file"}.get(spec["driver"], spec["driver"])
    bucket = spec.get("bucket")
    return f"{scheme}://{bucket + '/' if bucket else ''}{spec['path']}".rstrip("/")


class Location(abc.ABC):
    """Where a checkpoint lives: the one storage interface every backend implements.

    A location reads and writes the small documents (``read``, ``write``, ``write_many``), says
    how its arrays are opened by TensorStore (``kvstore``) and how boxes of them are read
    (``box_reader``), and carries a save through its life cycle: ``check_destination``,
    ``prepare``, ``staging``, ``make_durable``, ``commit``, ``discard``. Nothing outside this
    module asks which kind of location it holds. ``tests/unit/test_storage.py`` is the
    conformance suite every backend passes.
    """

    url: str

    @property
    @abc.abstractmethod
    def is_local(self) -> bool:
        """Whether every rank sees the same files (a local or shared file system)."""

    @abc.abstractmethod
    def kvstore(self, rel: str = "") -> dict[str, Any]:
        """The TensorStore kvstore spec of ``rel`` under this location."""

    @abc.abstractmethod
    def read(self, key: str, max_bytes: int = MAX_DOCUMENT_BYTES) -> bytes | None:
        """The bytes stored at ``key``, or None where there are none. ``_os.NotRegularFile``
        where they are more than ``max_bytes``, or (on a file system) not a regular file inside
        the checkpoint reached through no symbolic link."""

    @abc.abstractmethod
    def write(self, key: str, data: bytes) -> None:
        """Store ``data`` at ``key`` (durable only after ``make_durable``)."""

    @abc.abstractmethod
    def write_many(self, items: Iterable[tuple[str, bytes]]) -> None:
        """``write`` of many small documents, several at once."""

    @abc.abstractmethod
    def exists(self) -> bool:
        """Whether anything is stored here."""

    @abc.abstractmethod
    def committed(self) -> bool:
        """Whether a committed checkpoint is here (its marker exists)."""

    @abc.abstractmethod
    def missing_hint(self) -> str:
        """Why no checkpoint is found here, for an error message (empty if nothing to add)."""

    @abc.abstractmethod
    def box_reader(self, where: str, complete: bool, io: IOConfig) -> BoxReader:
        """The reader of this checkpoint's arrays (``_readers``); ``where`` names it in errors."""

    @abc.abstractmethod
    def box_writer(self, io: IOConfig, in_flight: InFlight | None = None) -> BoxWriter:
        """The writer of boxes of arrays here (``_writers``); ``in_flight`` counts its writes."""

    def child(self, name: str) -> Location:
        """The location ``name`` under this one (a manager's step, a tier's replica), on the same
        storage: every member of a kvstore spec carries over, not only what the URL says."""
        return locate(f"{self.url}/{name}")

    @abc.abstractmethod
    def check_destination(self, overwrite: bool) -> None:
        """Raise ``CheckpointExistsError`` unless a save may write here."""

    @abc.abstractmethod
    def prepare(self) -> None:
        """Claim the destination before any rank writes (rank 0 only)."""

    @abc.abstractmethod
    def staging(self, token: int) -> Location:
        """Where the save with ``token`` writes before its commit."""

    @abc.abstractmethod
    def claim(self, staging: Location, save_id: str) -> None:
        """Mark ``staging`` as the save ``save_id``'s (one process, before its commit)."""

    @abc.abstractmethod
    def make_durable(self) -> None:
        """Make everything this process wrote here durable."""

    @abc.abstractmethod
    def commit(self, staging: Location, marker: bytes, *, overwrite: bool, save_id: str) -> None:
        """Write the commit marker and make ``staging`` the checkpoint here, atomically; a
        ``SaveError`` where ``staging`` no longer holds the claim of ``save_id``: another
        process removed it (``layoutckpt gc``, a deleted parent directory) or another save to
        the same prefix took it over, so what it holds is not all this save wrote."""

    @abc.abstractmethod
    def retire(self) -> None:
        """Delete the committed checkpoint here so that it is never listed while partly deleted."""

    @abc.abstractmethod
    def discard(self) -> None:
        """Delete what is stored here."""


@attrs.frozen
class LocalDir(Location):
    """A directory of the local (or a mounted shared) file system; commit by rename."""

    root: Path

    @property
    def url(self) -> str:
        return os.fspath(self.root)

    @property
    def is_local(self) -> bool:
        return True

    def kvstore(self, rel: str = "") -> dict[str, Any]:
        return {"driver": "file", "path": os.fspath(self.root / rel) + "/"}

    def read(self, key: str, max_bytes: int = MAX_DOCUMENT_BYTES) -> bytes | None:
        # Only a regular file inside the checkpoint, of bounded size: a document linked to
        # another checkpoint, to /dev/zero or made a FIFO is refused rather than read.
        try:
            return _os.read_regular(self.root, key, max_bytes)
        except (FileNotFoundError, NotADirectoryError):
            return None

    def write(self, key: str, data: bytes) -> None:
        # No fsync per file: ``make_durable`` syncs the whole tree at once before the commit.
        _os.write_file(self.root / key, data, sync=False)

    def write_many(self, items: Iterable[tuple[str, bytes]]) -> None:
        # Creating a file costs milliseconds of metadata latency, so many are created at once.
        items = list(items)
        workers = Workers("layoutckpt-docs", max(1, min(16, len(items))))
        try:
            for key, data in items:
                workers.submit(self.write, key, data)
            workers.join()
        finally:
            workers.close()

    def exists(self) -> bool:
        return self.root.exists()

    def committed(self) -> bool:
        return (self.root / MARKER).is_file()

    def missing_hint(self) -> str:
        return _local_hint(self.root)

    def box_reader(self, where: str, complete: bool, io: IOConfig) -> BoxReader:
        return ShardFileReader(self.root, where, complete, io)

    def box_writer(self, io: IOConfig, in_flight: InFlight | None = None) -> BoxWriter:
        return ShardFileWriter(self.root, self, io, in_flight)

    # -- the save's life cycle ------------------------------------------------------------
    def check_destination(self, overwrite: bool) -> None:
        check_outside_checkpoints(self.root, "a checkpoint")
        if self.committed() and not overwrite:
            raise _exists(self.url)
        if self.exists() and not self.committed():
            # Never replace what is not ours, even with overwrite=True: a checkpoint is only
            # ever renamed into place whole, so anything else at the path is someone else's.
            raise CheckpointExistsError(
                f"{self.url!r} exists and is not a committed layoutckpt checkpoint; remove it "
                "yourself or save to a new path (overwrite=True only replaces checkpoints)"
            )

    def prepare(self) -> None:
        """Nothing to do: the staging directory is new."""

    def staging(self, token: int) -> LocalDir:
        return LocalDir(_commit.temp_path(self.root, token))

    def claim(self, staging: Location, save_id: str) -> None:
        assert isinstance(staging, LocalDir)
        staging.root.mkdir(parents=True, exist_ok=True)
        # Not made durable: it only has to last as long as this process, and goes before the commit.
        staging.write(PENDING, claim_text(save_id))

    def make_durable(self) -> None:
        if self.root.exists():  # absent when this rank had nothing to write
            _os.fsync_tree(self.root)

    def commit(self, staging: Location, marker: bytes, *, overwrite: bool, save_id: str) -> None:
        assert isinstance(staging, LocalDir)
        # A writer that finds its folder gone makes it again: only the claim tells that it is
        # not the folder the save began, and that files written before are missing.
        check_claim(staging, self.url, save_id)
        (staging.root / PENDING).unlink()
        # Every rank made its part durable before it reported success; the marker is synced,
        # then the whole directory renamed into place (``_commit.publish``).
        _faults.point("commit.marker", staging=staging.url, final=self.url)
        _os.write_file(staging.root / MARKER, marker)
        # The marker's name too, before the rename: else a power loss could keep the renamed
        # directory without it, a complete checkpoint that reads as never committed.
        _os.fsync_dir(staging.root)
        _commit.publish(staging.root, self.root, overwrite=overwrite)

    def retire(self) -> None:
        """Delete a committed checkpoint: renamed aside first, so it is never seen half deleted."""
        _commit.retire(self.root)

    def discard(self) -> None:
        _commit.remove_tree(self.root)


def read_bounded(kv: ts.KvStore, key: str, max_bytes: int) -> bytes | None:
    """The value at ``key`` of ``kv``, None where there is none; ``NotRegularFile`` (EFBIG) for one
    past ``max_bytes``, known from the byte past the limit before the value is downloaded: a
    key-value store tells no size before a read, and a range past the end is OUT_OF_RANGE."""
    try:
        past = kv.read(key, byte_range=slice(max_bytes, max_bytes + 1)).result()
    except ValueError as err:
        if "OUT_OF_RANGE" not in str(err):
            raise
    else:
        if past.state != "value":
            return None
        raise _os.NotRegularFile(errno.EFBIG, f"more than {max_bytes} bytes, the limit", key)
    got = kv.read(key).result()
    if got.state != "value":
        return None
    if len(got.value) > max_bytes:  # written meanwhile
        raise _os.NotRegularFile(errno.EFBIG, f"{len(got.value)} bytes, above the limit of {max_bytes}", key)
    return bytes(got.value)


def check_outside_checkpoints(path: Path, what: str, *, itself: bool = False) -> None:
    """Refuse to write ``what`` at ``path`` inside a committed checkpoint (or any Zarr group),
    through links too: its files would become members that plain zarr lists, and that
    ``verify`` reports as files the format does not know. ``itself``: ``path`` may not be one
    either (a save replaces one there whole; other writers would add to it)."""
    real = Path(os.path.realpath(path))
    for parent in [real, *real.parents] if itself else real.parents:
        if (parent / MARKER).is_file():
            raise CheckpointExistsError(
                f"{os.fspath(path)!r} lies inside the checkpoint (or Zarr group) {os.fspath(parent)!r}; "
                f"writing {what} there would change that one: name a path outside it"
            )


def claim_text(save_id: str) -> bytes:
    """The pending marker of the save ``save_id``: what ``commit`` finds there if no other
    process took its staging area away meanwhile."""
    return f"layoutckpt save {save_id} in progress; no commit marker yet\n".encode()


def check_claim(staging: Location, final: str, save_id: str) -> None:
    """Raise ``SaveError`` unless ``staging`` still holds the claim of ``save_id``."""
    if staging.read(PENDING) == claim_text(save_id):
        return
    raise SaveError(
        f"saving {final!r}: its staging area {staging.url!r} no longer holds this save's claim, so some "
        "of what the save wrote is gone: another process removed it (`layoutckpt gc`, or a parent "
        "directory deleted) or started another save to the same path; nothing was committed, save again "
        "once no other process writes there"
    )


class MarkerCommit(Location):
    """The commit of a store without renames: a save writes in place under a pending marker,
    and the root ``zarr.json``, written last, is the commit."""

    def prepare(self) -> None:
        """Clear the leftovers of a save that never committed here, then claim the prefix."""
        self.discard()
        self.write(PENDING, b"layoutckpt save in progress; no commit marker yet\n")

    def staging(self, token: int) -> MarkerCommit:
        return self  # no rename: the save writes in place, invisible until the marker exists

    def claim(self, staging: Location, save_id: str) -> None:
        assert staging is self
        self.write(PENDING, claim_text(save_id))

    def commit(self, staging: Location, marker: bytes, *, overwrite: bool, save_id: str) -> None:
        assert staging is self and not overwrite
        # Another save to this prefix that started meanwhile cleared it and claimed it: both
        # wrote the same keys, so neither save's objects are whole.
        check_claim(self, self.url, save_id)
        _faults.point("commit.marker", staging=self.url, final=self.url)
        if not self.write_new(MARKER, marker):
            raise CheckpointExistsError(
                f"another save committed a checkpoint at {self.url!r} while this one wrote there; "
                "this save committed nothing: save to a new prefix"
            )
        _faults.point("commit.published", final=self.url)
        try:
            self.drop_pending()
        except Exception as err:  # noqa: BLE001 - committed: a failure now must not undo it
            # The marker is stored, so the checkpoint is committed and readable; a pending marker
            # left beside it changes nothing but a later save's leftovers check, which refuses
            # to replace a committed prefix anyway.
            logger.warning("layoutckpt: %s is committed, but its pending marker stays: %s", self.url, err)

    @abc.abstractmethod
    def drop_pending(self) -> None:
        """Remove the pending marker of a save that has just committed."""

    def write_new(self, key: str, data: bytes) -> bool:
        """Store ``data`` at ``key`` unless a value is there; False where one is."""
        if self.read(key) is not None:
            return False
        self.write(key, data)
        return True


@attrs.frozen(eq=False)
class KvPrefix(MarkerCommit):
    """A key prefix of a TensorStore key-value store (s3, gcs, memory, ...); commit by marker."""

    spec: dict[str, Any]
    url: str

    @property
    def is_local(self) -> bool:
        return False

    def kvstore(self, rel: str = "") -> dict[str, Any]:
        return {**self.spec, "path": self.spec["path"] + _as_prefix(rel)}

    def child(self, name: str) -> KvPrefix:
        return KvPrefix(self.kvstore(name), f"{self.url}/{name}")

    @functools.cached_property
    def _kv(self) -> ts.KvStore:
        return ts.KvStore.open(self.spec, context=shared_context()).result()

    def read(self, key: str, max_bytes: int = MAX_DOCUMENT_BYTES) -> bytes | None:
        return read_bounded(self._kv, key, max_bytes)

    def write(self, key: str, data: bytes) -> None:
        self._kv.write(key, data).result()

    def write_new(self, key: str, data: bytes) -> bool:
        # Conditional on the generation read: where the store honours conditions (S3's
        # If-None-Match, GCS preconditions), two saves can never both write ``key``.
        found = self._kv.read(key).result()
        if found.state == "value":
            return False
        return bool(self._kv.write(key, data, if_equal=found.stamp.generation).result().generation)

    def write_many(self, items: Iterable[tuple[str, bytes]]) -> None:
        # Object stores take many requests at once; TensorStore bounds them by its concurrency.
        for f in [self._kv.write(key, data) for key, data in items]:
            f.result()

    def keys(self, prefix: str = "") -> list[str]:
        """The keys under this prefix (relative to it), or those starting with ``prefix``."""
        if not prefix:
            return [k.decode() for k in self._kv.list().result()]
        within = ts.KvStore.KeyRange(prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1))
        return [k.decode() for k in self._kv.list(within).result()]

    def exists(self) -> bool:
        return bool(self.keys())

    def committed(self) -> bool:
        return self.read(MARKER) is not None

    def box_reader(self, where: str, complete: bool, io: IOConfig) -> BoxReader:
        return TensorStoreReader(self, where, complete, io)

    def box_writer(self, io: IOConfig, in_flight: InFlight | None = None) -> BoxWriter:
        return ShardObjectWriter(self, io, in_flight)

    def missing_hint(self) -> str:
        if self.read(PENDING) is not None:
            return " (the prefix holds an unfinished save: it has no commit marker)"
        return ""

    # -- the save's life cycle ------------------------------------------------------------
    def check_destination(self, overwrite: bool) -> None:
        if self.committed():
            if not overwrite:
                raise _exists(self.url)
            raise CheckpointExistsError(
                f"a committed checkpoint exists at {self.url!r}, and an object store cannot replace it "
                "safely: with no atomic rename, a crash midway would leave neither the old checkpoint "
                "nor the new one; save to a new prefix (CheckpointManager makes one per step) and "
                "delete the old one after"
            )
        if self.exists() and self.read(PENDING) is None:
            raise CheckpointExistsError(
                f"{self.url!r} holds objects that are not a layoutckpt checkpoint; remove them "
                "yourself or save to a new prefix"
            )

    def make_durable(self) -> None:
        """Nothing to do: a PUT is durable when it returns."""

    def drop_pending(self) -> None:
        self._kv.delete_range(ts.KvStore.KeyRange(PENDING, PENDING + "\0")).result()

    def retire(self) -> None:
        """Delete a committed checkpoint: the marker first, so it is never listed half deleted;
        the pending marker before it, so a crash midway leaves a prefix the next save clears."""
        self.write(PENDING, b"layoutckpt deleting this checkpoint\n")
        self._kv.delete_range(ts.KvStore.KeyRange(MARKER, MARKER + "\0")).result()
        self.discard()

    def discard(self) -> None:
        # The pending marker goes last, so a crash midway leaves a prefix the next save may clear.
        everything_else = [ts.KvStore.KeyRange("", PENDING), ts.KvStore.KeyRange(PENDING + "\0", "")]
        for f in [self._kv.delete_range(r) for r in everything_else]:
            f.result()
        self._kv.delete_range(ts.KvStore.KeyRange(PENDING, PENDING + "\0")).result()


def _exists(url: str) -> CheckpointExistsError:
    return CheckpointExistsError(
        f"a committed checkpoint already exists at {url!r}; pass overwrite=True to replace it, or save to a new path"
    )


def _local_hint(root: Path) -> str:
    """What ``root`` is instead of a checkpoint, from a bounded look at two levels below it: a
    file, a folder of checkpoints (a run root), the arrays of a checkpoint without its marker,
    or something else."""
    if not root.exists():
        return ""
    if not root.is_dir():
        return " (it is a file; a checkpoint is a directory)"
    level = [root]
    for _ in range(2):
        level = [d / name for d in level for name in sorted(_subdirs(d), reverse=True)[:_LOOK_AT]]
        marked = [d for d in level if (d / MARKER).is_file()]
        roots = [d for d in marked if _is_checkpoint_root(d)]
        if roots:
            return f" (the directory holds checkpoints, not one: name one of them, e.g. {os.fspath(roots[0])!r})"
        if marked:
            return (
                " (the directory holds Zarr arrays but no commit marker zarr.json at its top: "
                "a save or copy that never finished)"
            )
    return " (the directory is not a checkpoint: it holds no commit marker zarr.json and no Zarr arrays)"


# How many subdirectories of each directory ``_local_hint`` looks into: enough for the cases it
# tells apart, few enough that the hint costs no noticeable time on a huge directory.
_LOOK_AT = 16
# A checkpoint's root document: a Zarr group whose attributes hold the library's metadata (an
# array's document has node_type "array"; a group inside a checkpoint has no such attribute).
_ROOT_DOCUMENT = (re.compile(rb'"node_type"\s*:\s*"group"'), re.compile(rb'"layoutckpt"\s*:'))


def _subdirs(folder: Path) -> list[str]:
    names = []
    try:
        with os.scandir(folder) as entries:
            for e in entries:
                # A save's staging directory or a checkpoint set aside is no checkpoint to name.
                if e.is_dir() and not _commit.LEFTOVER.match(e.name):
                    names.append(e.name)
                if len(names) >= 256:
                    break
    except OSError:
        return []
    return names


def _is_checkpoint_root(folder: Path) -> bool:
    """Whether ``folder/zarr.json`` opens as a checkpoint's root document: its first 4 KiB name a
    group with layoutckpt metadata (the whole document can be megabytes)."""
    try:
        with (folder / MARKER).open("rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return all(pattern.search(head) for pattern in _ROOT_DOCUMENT)


def read_marker(loc: Location) -> bytes:
    """The commit marker's bytes; ``CheckpointNotFoundError`` when there is none."""
    try:
        raw = loc.read(MARKER, MAX_ROOT_DOCUMENT_BYTES)
    except _os.NotRegularFile as err:
        raise FormatError(
            f"{loc.url}: its commit marker zarr.json cannot be read safely ({err.strerror}); layoutckpt "
            "reads only regular files inside a checkpoint, through no symbolic link: replace it with the file itself"
        ) from None
    if raw is None:
        raise CheckpointNotFoundError(
            errno.ENOENT, f"no committed layoutckpt checkpoint at {loc.url!r}{loc.missing_hint()}", loc.url
        )
    return raw
