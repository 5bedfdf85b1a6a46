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
    try:
        done = os.pwrite(fd, buffer, offset)
    except OSError as err:
        if err.errno != errno.EINVAL:
            raise
        # The file system took O_DIRECT at open but not these writes (its blocks are larger,
        # or it wants no O_DIRECT at all): go on through the page cache.
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT)
        done = os.pwrite(fd, buffer, offset)
    while done < len(buffer):
        more = os.pwrite(fd, buffer[done:], offset + done)
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

_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)  # Linux 4.14 and later


def read_if_cached(fd: int, view: np.ndarray, offset: int) -> bool:
    """Read ``view``'s length at ``offset`` of ``fd`` into it only if the page cache holds all of
    it (``RWF_NOWAIT``: no wait for the device). False where it does not, or where the system
    cannot tell (no ``RWF_NOWAIT``; tmpfs answers EOPNOTSUPP)."""
    if not _RWF_NOWAIT:
        return False
    try:
        return os.preadv(fd, [view], offset, _RWF_NOWAIT) == len(view)
    except OSError as err:
        if err.errno in (errno.EAGAIN, errno.EOPNOTSUPP, errno.EINVAL):
            return False
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
