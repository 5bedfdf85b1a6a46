"""``layoutckpt export``: ``--to safetensors`` (the default) writes Hugging Face files, by
``export_safetensors``, with a progress bar that watches the files grow; ``--to zarr`` writes a
packed checkpoint as a plain one (a file per shard, what plain zarr reads), by ``export_zarr``,
whose progress callback moves the bar."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import threading
from collections.abc import Iterator
from typing import Any

from ._common import NotFound, UsageError, name_regex, open_checkpoint
from ._text import human, progress

EXPORT_FORMATS = ("safetensors", "zarr")
# What only --to safetensors takes, by option: given with --to zarr, it is a usage error.
SAFETENSORS_ONLY = {"select": "--select", "max_shard_bytes": "--max-shard-bytes", "prefix": "--prefix"}
MAX_SHARD_BYTES = 5 * 2**30

SIZE_UNITS = {
    "": 1,
    **{p: 1000 ** (i + 1) for i, p in enumerate("kmgt")},
    **{p + "i": 1024 ** (i + 1) for i, p in enumerate("kmgt")},
}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 5GB, 500MiB or 1000000")
    size = int(float(m.group(1)) * SIZE_UNITS[(m.group(2) or "").lower()])
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is under one byte; a file must hold at least one")
    return size


def cmd_export(args: argparse.Namespace) -> int:
    if args.prefix is not None and (not args.prefix or "/" in args.prefix or os.sep in args.prefix):
        raise UsageError(f"--prefix {args.prefix!r} must be a plain file name stem such as 'model'")
    if args.to == "zarr":
        return to_zarr(args)
    if args.overwrite:
        raise UsageError(
            "--overwrite is for --to zarr; a safetensors export replaces an earlier export of its --prefix"
        )
    return to_safetensors(args)


def to_zarr(args: argparse.Namespace) -> int:
    from .._unpack import export_zarr

    given = [flag for attr, flag in SAFETENSORS_ONLY.items() if getattr(args, attr) is not None]
    if given:
        raise UsageError(f"{', '.join(given)}: for --to safetensors only; --to zarr copies the whole checkpoint")
    bar = None

    def advance(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:  # the total is known once the export has read the source's metadata
            bar = progress(args, total, "export")
        bar.update(done - bar.n)

    try:
        copied = export_zarr(args.path, args.out, overwrite=args.overwrite, progress=advance)
    finally:
        if bar is not None:
            bar.close()
    print(f"{args.out}  {human(copied)} (plain zarr, a file per shard)")
    return 0


def to_safetensors(args: argparse.Namespace) -> int:
    from .._safetensors import export_safetensors

    max_shard_bytes = MAX_SHARD_BYTES if args.max_shard_bytes is None else args.max_shard_bytes
    prefix = "model" if args.prefix is None else args.prefix
    # A missing checkpoint: one clear line before anything is made.
    with open_checkpoint(args.path) as rd:
        regex = name_regex(args.select) if args.select else None
        total = sum(rd.info(n).nbytes for n in rd.keys() if regex is None or regex.search(n))
    with progress(args, total, "export") as bar, watch_folder(args.out, prefix, bar):
        try:
            written = export_safetensors(
                args.path, args.out, select=args.select, max_shard_bytes=max_shard_bytes, prefix=prefix
            )
        except KeyError as err:
            raise NotFound(str(err.args[0])) from None
    for path in written:
        print(f"{path}  {human(os.path.getsize(path))}")
    return 0


@contextlib.contextmanager
def watch_folder(folder: str, prefix: str, bar: Any, every: float = 0.2) -> Iterator[None]:
    """Move ``bar`` to the bytes of the files named ``prefix``* that appear in ``folder``.

    ``export_safetensors`` takes no progress callback; the files it writes (under temporary
    names, then renamed) grow as it goes, so their sizes say how far it is.
    """
    if bar.disable:
        yield
        return

    def files() -> dict[tuple[str, int], int]:
        try:
            entries = list(os.scandir(folder))
        except FileNotFoundError:
            return {}
        found = {}
        for e in entries:
            if e.name.lstrip(".").startswith(prefix):
                with contextlib.suppress(FileNotFoundError):
                    stat = e.stat()
                    found[(e.name, stat.st_ino)] = stat.st_size
        return found

    before = set(files())
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(every):
            done = sum(size for key, size in files().items() if key not in before)
            bar.update(max(0, min(done, bar.total) - bar.n))

    thread = threading.Thread(target=watch, name="layoutckpt-export-progress", daemon=True)
    thread.start()
    try:
        yield
        bar.update(bar.total - bar.n)
    finally:
        stop.set()
        thread.join()
