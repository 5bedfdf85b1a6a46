"""Options as frozen values: every I/O knob in ``IOConfig``, and what one save or load was asked for.

Knobs are passed in, never patched: a test or a user who wants other threads, pieces or budgets
makes an ``IOConfig`` and hands it to the verb (``io=``), and the value travels down to the code
that uses it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, TypedDict

import attrs


def _positive(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"IOConfig.{attribute.name} must be a positive int, got {value!r}")


def _default_threads() -> int:
    # Shard files are read and written with copies, checksums and system calls, all outside the
    # GIL, so about one thread per core; more only contend for the cores.
    return max(2, min(4, os.cpu_count() or 1))


def _default_retries() -> int:
    return int(os.environ.get("LAYOUTCKPT_MAX_RETRIES", 16))


@attrs.frozen(kw_only=True)
class IOConfig:
    """How layoutckpt moves bytes; the defaults suit local disks and object stores alike.

    - ``concurrency``: storage requests in flight through TensorStore (file operations, S3/GCS
      requests).
    - ``threads``: threads that read or write a local checkpoint's shard files.
    - ``direct_io``: write uncompressed shards of at least ``direct_bytes`` past the page cache
      (``O_DIRECT``) where the file system allows it. It spares the page cache for what training
      reads, and on hosts slow to hand out page-cache pages it writes faster. Such a shard is
      written in blocks of ``direct_bytes`` rounded up to a multiple of 4 KiB.
    - ``group_bytes``: inner chunks gathered per ``writev`` (small enough to stay in L2 cache).
    - ``read_run_bytes``: adjacent wanted inner chunks fetched by one ``preadv``.
    - ``prefetch_depth``: runs read ahead of the checks in a large read of one shard file.
    - ``large_read_bytes``: a box at least this large is read shard file by shard file, each as
      one sequential read-ahead stream, up to ``read_streams`` files at once.
    - ``piece_bytes`` and ``budget_bytes``: a read through TensorStore larger than
      ``piece_bytes`` goes in pieces of whole inner-chunk rows, with at most ``budget_bytes``
      in flight, so no read holds a large shard twice over.
    - ``trim_bytes``: freed read buffers are handed back to the system after this many bytes.
    - ``retries``: how often a failed object-store request is retried (``LAYOUTCKPT_MAX_RETRIES``
      sets the default).
    - ``pack_bytes``: in a packed save (``packing="ocdbt"``) each writing thread appends its
      shards to a data file of its own and starts a new one past this many bytes. On an object
      store a data file is held in memory until it is stored: up to ``threads`` of them.
    """

    concurrency: int = attrs.field(default=32, validator=_positive)
    threads: int = attrs.field(factory=_default_threads, validator=_positive)
    direct_io: bool = True
    direct_bytes: int = attrs.field(default=8 << 20, validator=_positive)
    group_bytes: int = attrs.field(default=256 << 10, validator=_positive)
    read_run_bytes: int = attrs.field(default=256 << 10, validator=_positive)
    prefetch_depth: int = attrs.field(default=4, validator=_positive)
    large_read_bytes: int = attrs.field(default=8 << 20, validator=_positive)
    read_streams: int = attrs.field(default=4, validator=_positive)
    piece_bytes: int = attrs.field(default=16 << 20, validator=_positive)
    budget_bytes: int = attrs.field(default=96 << 20, validator=_positive)
    trim_bytes: int = attrs.field(default=64 << 20, validator=_positive)
    retries: int = attrs.field(factory=_default_retries)
    pack_bytes: int = attrs.field(default=1 << 30, validator=_positive)

    def replace(self, **changes: Any) -> IOConfig:
        """A copy with ``changes``, like ``attrs.evolve``."""
        return attrs.evolve(self, **changes)


DEFAULT_IO = IOConfig()

# Ten minutes, NCCL's default collective timeout: a dead rank is reported in minutes, and ranks
# whose writes finish minutes apart still commit.
DEFAULT_SAVE_TIMEOUT = 600.0


def _positive_seconds(instance: Any, attribute: attrs.Attribute, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"{attribute.name}= must be a positive number of seconds, got {value!r}")


def _step(instance: Any, attribute: attrs.Attribute, value: int | None) -> None:
    # The reader refuses any other step, so the save must not commit one (``format._format``).
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"step= takes an int or None, got {type(value).__name__} {value!r}; pass int(step)")
    if not 0 <= value < 2**63:
        raise ValueError(f"step= must be an int from 0 to 2**63 - 1, got {value}")


# How a save may compress its inner chunks (``format._shard``): not at all, or one of these.
COMPRESSIONS = (None, "zstd", "blosc")


def _compression(instance: Any, attribute: attrs.Attribute, value: str | None) -> None:
    if value not in COMPRESSIONS:
        raise ValueError(f"compression= must be one of {COMPRESSIONS}, got {value!r}")


def _packing(instance: Any, attribute: attrs.Attribute, value: str) -> None:
    if value not in ("auto", "files", "ocdbt"):
        raise ValueError(
            f"packing= must be 'auto', 'files' (plain zarr) or 'ocdbt' (a few files per rank), got {value!r}"
        )


def _flag(instance: Any, attribute: attrs.Attribute, value: bool) -> None:
    # A string such as "no" is true: refused, where it would silently mean the opposite.
    if not isinstance(value, bool):
        raise TypeError(f"{attribute.name}= takes True or False, got {type(value).__name__} {value!r}")


def _chunk_bytes(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"inner_chunk_bytes= must be a positive int (bytes; 2 MiB by default), got {value!r}")


def io_config(io: IOConfig | None) -> IOConfig:
    """``io``, or the defaults; anything else is a ``TypeError`` that says what to pass."""
    if io is None:
        return DEFAULT_IO
    if not isinstance(io, IOConfig):
        raise TypeError(f"io= takes an lc.IOConfig, got {type(io).__name__}; e.g. io=lc.IOConfig(concurrency=8)")
    return io


@attrs.frozen(kw_only=True)
class SaveOptions:
    """Everything one ``save`` or ``save_async`` call was asked for besides path, state and layout."""

    step: int | None = attrs.field(default=None, validator=_step)
    metadata: Mapping[str, Any] | None = None
    rank_state: Any = None
    overwrite: bool = attrs.field(default=False, validator=_flag)
    group: Any = None
    inner_chunk_bytes: int = attrs.field(default=2 << 20, validator=_chunk_bytes)
    compression: str | None = attrs.field(default=None, validator=_compression)
    # How the objects are stored: "files" (plain zarr), "ocdbt" (a few files per rank), or
    # "auto": "ocdbt" above a thousand objects (``storage._packs``).
    packing: str = attrs.field(default="auto", validator=_packing)
    # save_async only: return before the copy is done; cap the staging buffers.
    lazy: bool = attrs.field(default=False, validator=_flag)
    host_memory_budget: int | None = None
    io: IOConfig = attrs.field(default=DEFAULT_IO, converter=io_config)
    # How long a rank waits for the others at each agreement of a save's commit. A per-call
    # choice about peers, not about moving bytes (so not IOConfig): a job sets it from how far
    # apart its ranks may finish writing, and a final save before exit may want it longer.
    timeout: float = attrs.field(default=DEFAULT_SAVE_TIMEOUT, validator=_positive_seconds)


@attrs.frozen(kw_only=True)
class LoadOptions:
    """Everything one ``load`` or ``load_async`` call was asked for besides path and layout."""

    like: Any = None
    select: Any = None
    strict: bool = attrs.field(default=True, validator=_flag)
    inplace: bool = attrs.field(default=False, validator=_flag)
    group: Any = None
    io: IOConfig = attrs.field(default=DEFAULT_IO, converter=io_config)
    share_reads: bool = attrs.field(default=False, validator=_flag)


class SaveKeywords(TypedDict, total=False):
    """The keywords ``save`` takes (``save_async`` takes ``SaveAsyncKeywords``), as one type."""

    step: int | None
    metadata: Mapping[str, Any] | None
    rank_state: Any
    overwrite: bool
    group: Any
    inner_chunk_bytes: int
    compression: str | None
    packing: str
    io: IOConfig | None
    timeout: float


class SaveAsyncKeywords(SaveKeywords, total=False):
    """``save``'s keywords, and how ``save_async`` stages."""

    lazy: bool
    host_memory_budget: int | None


class LoadKeywords(TypedDict, total=False):
    """The keywords ``load`` and ``load_async`` take, as one type."""

    like: Any
    select: Any
    strict: bool
    inplace: bool
    group: Any
    io: IOConfig | None
    share_reads: bool


def options_of(cls: type, keywords: Mapping[str, Any], verb: str, allowed: type) -> Any:
    """``cls(**keywords)`` for a verb that takes the keywords of the TypedDict ``allowed``; an
    unknown keyword is the ``TypeError`` Python gives, with the keywords the verb does take."""
    unknown = sorted(set(keywords) - set(allowed.__annotations__))
    if unknown:
        raise TypeError(
            f"{verb}() got an unexpected keyword argument {unknown[0]!r}; it takes {', '.join(allowed.__annotations__)}"
        )
    return cls(**keywords)
