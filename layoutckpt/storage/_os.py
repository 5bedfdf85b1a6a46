"""Every operating-system-specific call layoutckpt makes, each falling back cleanly elsewhere.

Linux offers calls that make checkpoint I/O cheaper (``O_DIRECT``, ``preadv2(RWF_NOWAIT)``,
``syncfs``, ``sync_file_range``, ``malloc_trim``); other systems, or older kernels and some file
systems, lack them. Each function here says what it does where the call is missing, so the rest
of the library never asks which platform it runs on.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import os
import stat
import sys
from pathlib import Path
from typing import Any

import numpy as np


def linux_call(name: str, *argtypes: Any) -> Any:
    """The C library's function ``name`` (with ``argtypes`` where given), or None off Linux or
    where the library lacks it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True), name)
    except (OSError, AttributeError):
        return None
    if argtypes:
        fn.argtypes = argtypes
    return fn


_RENAMEAT2 = linux_call("renameat2", ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def exchange(a: Path, b: Path) -> bool:
    """Swap the names ``a`` and ``b`` in one step (``renameat2(RENAME_EXCHANGE)``); False where
    the system or the file system cannot, and nothing was done."""
    if _RENAMEAT2 is None:
        return False
    if _RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), os.fspath(a), None, os.fspath(b))


# ---------------------------------------------------------------------------------------- writing

_O_DIRECT = getattr(os, "O_DIRECT", 0)  # Linux and a few others; macOS has none
# Buffer addresses, file offsets and lengths of O_DIRECT writes are multiples of this: the
# logical block size is 512 or 4096 bytes on the devices Linux supports.
DIRECT_ALIGN = 4096


def create_file(path: Path, *, direct: bool = False) -> int:
    """Open ``path`` for writing, truncated, creating it and any missing parent directories;
    with ``direct``, past the page cache (``O_DIRECT``) where the file system allows it, and
    through it where not (``is_direct`` tells which).

    The open is tried first and the directories made only where it fails: ``mkdir`` of a
    directory that exists is still a system call under its parent's lock, and the writer
    threads of every rank make hundreds of files in a few directories.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
    if direct and _O_DIRECT:
        try:
            return _open(path, flags | _O_DIRECT)
        except OSError as err:
            if err.errno != errno.EINVAL:  # tmpfs before Linux 6.6, some FUSE file systems
                raise
    return _open(path, flags)


def _open(path: Path, flags: int) -> int:
    try:
        return os.open(path, flags, 0o644)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(path, flags, 0o644)


def is_direct(fd: int) -> bool:
    """Whether the open file ``fd`` bypasses the page cache (always False without ``O_DIRECT``)."""
    return bool(_O_DIRECT) and bool(fcntl.fcntl(fd, fcntl.F_GETFL) & _O_DIRECT)


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A byte array of ``nbytes`` whose address is a multiple of ``DIRECT_ALIGN``, as an
    ``O_DIRECT`` write needs."""
    raw = np.empty(nbytes + DIRECT_ALIGN, np.uint8)
    skip = -raw.ctypes.data % DIRECT_ALIGN
    return raw[skip : skip + nbytes]


def write_direct(fd: int, buffer: np.ndarray, offset: int) -> None:
    """Write all of ``buffer`` (aligned, a whole number of blocks) at ``offset`` of the file
    ``fd``; where the file system refuses it past the page cache, through the page cache."""
    done, cleared = 0, False
    while done < len(buffer):
        try:
            more = os.pwrite(fd, buffer[done:], offset + done)
        except OSError as err:
            if err.errno != errno.EINVAL or cleared:
                raise
            # The file system took O_DIRECT at open but not this write (its blocks are larger,
            # it wants no O_DIRECT at all, or a short write left the rest unaligned): go on
            # through the page cache. (Another block's thread may have cleared it already.)
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT)
            cleared = True
            continue
        if more == 0:
            raise OSError(errno.EIO, f"a write at byte {offset + done} of a shard file wrote nothing")
        done += more


def write_all(fd: int, parts: list[Any], total: int | None = None) -> None:
    """``writev`` until every byte of ``parts`` (byte buffers) is written: a regular file may
    take fewer. ``total``, their byte count where the caller knows it, spares the common case
    of one complete ``writev`` any work per part."""
    done = os.writev(fd, parts)
    if done == total:
        return
    views = [memoryview(p).cast("B") for p in parts]
    while True:
        while views and done >= len(views[0]):
            done -= len(views.pop(0))
        if not views:
            return
        views[0] = views[0][done:]
        done = os.writev(fd, views)


def write_file(path: Path, data: bytes, *, sync: bool = True) -> None:
    """Write ``data`` as the file ``path`` (made with its parents where missing); with ``sync``,
    durable on return."""
    with open(create_file(path), "wb", closefd=True) as f:
        f.write(data)
        if sync:
            f.flush()
            os.fsync(f.fileno())


_SYNC_FILE_RANGE = linux_call("sync_file_range", ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint)
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int) -> None:
    """Ask the kernel to start writing the open file's dirty pages to storage now, without
    waiting for them (Linux ``sync_file_range``; elsewhere nothing).

    Linux keeps written pages in memory until a tenth of it is dirty, so a save that syncs only
    at the end leaves the disk idle while it encodes, then waits for all of it. Started file by
    file, the disk works while the next shards are encoded, and the final sync has little left.
    This makes nothing durable: ``fsync_tree`` still does that before the commit.
    """
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


def fsync_dir(path: Path) -> None:
    """Make the entries of the directory ``path`` (names created, renamed, removed) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_SYNCFS = linux_call("syncfs")


def fsync_tree(root: Path) -> None:
    """Make every file and directory this process wrote under ``root`` durable, in one call.

    Files are written without a sync each (hundreds of small documents and shards would cost
    one fsync apiece); Linux's ``syncfs`` then flushes the whole file system at once, data and
    directory entries. Elsewhere, or where ``syncfs`` fails, every file and directory under
    ``root`` is fsynced.
    """
    if _SYNCFS is not None:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            if _SYNCFS(fd) == 0:
                return
        finally:
            os.close(fd)
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


# ---------------------------------------------------------------------------------------- reading


class NotRegularFile(OSError):
    """A checkpoint's file is a symbolic link, lies behind one, or is not a regular file (a
    FIFO, a device): a reader opens none of these."""


# Opened without following a symbolic link as the last part, and without blocking where the file
# is a FIFO with no writer (``fstat`` then refuses it).
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
_SYS_OPENAT2 = 437  # the same number on every Linux architecture (a syscall added after 5.1)
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
_SYSCALL = linux_call("syscall")


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_openat2_works = _SYSCALL is not None


def _openat2(dir_fd: int, rel: str) -> int | None:
    """``openat2`` of ``rel`` under ``dir_fd``, refusing symbolic links on the way and any path
    leaving the directory; None where the kernel lacks the call (Linux before 5.6)."""
    global _openat2_works
    how = _OpenHow(_READ_FLAGS, 0, _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS)
    fd = _SYSCALL(_SYS_OPENAT2, dir_fd, os.fsencode(rel), ctypes.byref(how), ctypes.sizeof(how))
    if fd >= 0:
        return int(fd)
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EPERM):  # no openat2, or a seccomp filter that refuses it
        _openat2_works = False
        return None
    raise OSError(err, os.strerror(err), rel)


def _open_walk(dir_fd: int, rel: str) -> int:
    """``rel`` under ``dir_fd`` opened one part at a time, none of them followed if a symbolic link."""
    parts = rel.split("/")
    fd = os.dup(dir_fd)
    try:
        for part in parts[:-1]:
            if part in ("", ".", ".."):
                raise OSError(errno.EXDEV, "the path leaves the checkpoint", rel)
            nxt = os.open(part, _READ_FLAGS | getattr(os, "O_DIRECTORY", 0), dir_fd=fd)
            os.close(fd)
            fd = nxt
        if parts[-1] in ("", ".", ".."):
            raise OSError(errno.EXDEV, "the path leaves the checkpoint", rel)
        return os.open(parts[-1], _READ_FLAGS, dir_fd=fd)
    finally:
        os.close(fd)


def open_regular(root: Path, rel: str) -> int:
    """Open the file ``rel`` (a relative path with ``/``) under the directory ``root`` for
    reading, only if it is a regular file inside ``root`` reached through no symbolic link.

    ``root`` itself may be a link (the user named it). Raises ``FileNotFoundError`` where the file
    is absent and ``NotRegularFile`` where it is a link, lies behind one, or is a FIFO, a device
    or a directory. ``O_NONBLOCK`` keeps a FIFO from blocking the open; it changes nothing for
    a regular file.
    """
    root_fd = open_dir(root)
    try:
        return open_regular_at(root_fd, rel)[0]
    finally:
        os.close(root_fd)


def open_dir(root: Path) -> int:
    """The directory ``root`` opened, for ``open_regular_at``."""
    return os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))


def open_regular_at(root_fd: int, rel: str) -> tuple[int, int]:
    """``open_regular`` under a directory already open (a reader of many files opens it once):
    the file and its size."""
    try:
        fd = _openat2(root_fd, rel) if _openat2_works else None
        if fd is None:
            fd = _open_walk(root_fd, rel)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.EXDEV, errno.ENOTDIR):
            raise NotRegularFile(err.errno, "a symbolic link or a path leaving the checkpoint", rel) from None
        raise
    try:
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise NotRegularFile(errno.EINVAL, f"not a regular file (mode {stat.filemode(st.st_mode)})", rel)
    return fd, st.st_size


def read_regular(root: Path, rel: str, max_bytes: int) -> bytes:
    """The bytes of the regular file ``rel`` under ``root`` (as ``open_regular`` opens it);
    ``NotRegularFile`` above ``max_bytes``, before reading any."""
    fd = open_regular(root, rel)
    try:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise NotRegularFile(errno.EFBIG, f"{size} bytes, above the limit of {max_bytes} for this document", rel)
        chunks = []
        total = 0
        while total <= size:  # to the end, though the file may have changed since ``fstat``
            chunk = os.read(fd, max(size - total, 0) + 1)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > max_bytes:
                raise NotRegularFile(errno.EFBIG, f"more than {max_bytes} bytes", rel)
        return b"".join(chunks)
    finally:
        os.close(fd)


_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)  # Linux 4.14 and later


def read_cached(fd: int, view: np.ndarray, offset: int) -> int:
    """Read into ``view`` from ``offset`` of ``fd`` what the page cache holds from there on, up
    to ``view``'s length, without waiting for the device (``RWF_NOWAIT``); return the bytes read.
    0 where the cache holds none of it, or where the system cannot tell (no ``RWF_NOWAIT``;
    tmpfs answers EOPNOTSUPP)."""
    if not _RWF_NOWAIT:
        return 0
    try:
        return os.preadv(fd, [view], offset, _RWF_NOWAIT)
    except OSError as err:
        if err.errno in (errno.EAGAIN, errno.EOPNOTSUPP, errno.EINVAL):
            return 0
        raise


_MALLOC_TRIM = linux_call("malloc_trim", ctypes.c_size_t)


def release_free_memory() -> None:
    """Hand the C allocator's free memory back to the system (glibc's ``malloc_trim(0)``;
    elsewhere nothing).

    Freed read buffers stay in the allocator's per-thread arenas, where the next reads do not
    always reuse them, so a process that loads again and again grows by its freed buffers unless
    they are handed back.
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
