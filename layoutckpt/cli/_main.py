"""The ``layoutckpt`` command line: look into, check, read, plan for, export and prune checkpoints.

    layoutckpt ls PATH                         arrays, specs, values, metadata (or a run's steps)
    layoutckpt read PATH NAME [--slice 0:8,:]  one tensor, a slice of it, or a value
    layoutckpt verify PATH                     every checksum, every shard present; exit 1 if not
    layoutckpt plan PATH --spec F --mesh dp=2  what a load under another layout would read
    layoutckpt export PATH DIR                 Hugging Face safetensors files; --to zarr: a packed checkpoint unpacked
    layoutckpt import SRC DST [--from dcp]     a checkpoint from safetensors files or a DCP folder
    layoutckpt gc ROOT --keep-last N           a CheckpointManager's retention, from outside

It needs NumPy and TensorStore only, never torch, so it runs wherever a checkpoint can be
read. Errors are one line on stderr naming the thing and the fix: exit 2 for bad usage, 1 for
what is missing or damaged; ``LAYOUTCKPT_DEBUG=1`` shows the traceback instead. Progress bars
go to stderr when it is a terminal (``--progress``/``--no-progress`` override).

This module builds the parser and maps errors to exit codes; each command lives in its own
module (see the package's docstring), which parses and prints while library functions do the
work: ``_verify.verify``, ``_readplan.plan_reads`` (pure), ``export_safetensors``, ``export_zarr`` and
``_retention.collect_garbage``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ..base._errors import (
    CheckpointNotFoundError,
    FormatError,
    IntegrityError,
    LayoutError,
    ManagerLockedError,
)
from ..base._version import __version__
from ._common import PROG, NotFound, UsageError
from ._export import EXPORT_FORMATS, cmd_export, parse_size
from ._import import add_arguments as import_arguments
from ._import import cmd_import
from ._ls import cmd_ls
from ._plan import cmd_plan
from ._read import cmd_read
from ._root import cmd_gc, positive_int
from ._verify import cmd_verify


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Look into, check, read, plan for, export and prune layoutckpt checkpoints."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    bars = argparse.ArgumentParser(add_help=False)
    bars.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="show a progress bar on stderr (default: when stderr is a terminal)",
    )
    bars.add_argument("-q", "--quiet", dest="progress", action="store_false", help="no progress bar")

    def command(name: str, run: Callable[[argparse.Namespace], int], help: str, *parents: Any) -> Any:  # noqa: A002
        p = commands.add_parser(name, help=help, description=help, parents=list(parents))
        p.set_defaults(run=run)
        return p

    p = command("ls", cmd_ls, "arrays (shape, dtype, size, saved spec), values and metadata; or a run's steps")
    p.add_argument("path", help="a checkpoint, or a CheckpointManager root (step_* folders)")
    p.add_argument("--flat", action="store_true", help="one global name per line instead of a tree")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = command("read", cmd_read, "print one array (or a slice of it), or a value; or save it as .npy", bars)
    p.add_argument("path")
    p.add_argument("name", help="the array's or value's global name, e.g. model.embed.weight")
    p.add_argument("--slice", help="NumPy indexing per dimension, e.g. '0:8,:' or '...,-1'")
    p.add_argument("--out", help="save to this .npy file instead of printing")
    p.add_argument("--astype", help="cast to this dtype first, e.g. float32")
    p.add_argument("--full", action="store_true", help="print every element, not a summary")

    p = command("verify", cmd_verify, "check every checksum and that every shard is present; exit 1 if not", bars)
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = command("plan", cmd_plan, "which chunks and bytes each rank of a target layout would read (reads no data)")
    p.add_argument("path")
    p.add_argument("--spec", help="a TOML layout (see specs/); default: every array whole on every rank")
    p.add_argument("--mesh", help="the target mesh, e.g. dp=2,tp=4 (default: the spec file's [mesh])")
    p.add_argument("--rank", type=int, help="show this rank's reads array by array")
    p.add_argument("--select", help="only the names this regex finds")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = command(
        "export",
        cmd_export,
        "write the arrays as Hugging Face safetensors files, or a packed checkpoint as plain Zarr",
        bars,
    )
    p.add_argument("path")
    p.add_argument(
        "--to",
        choices=EXPORT_FORMATS,
        default="safetensors",
        help="safetensors (the default): Hugging Face files; zarr: a packed checkpoint as a plain one (a file per shard)",
    )
    p.add_argument("out", help="the folder to write (best empty); with --to zarr, the checkpoint to write (any path)")
    p.add_argument("--select", help="safetensors: only the arrays this regex finds")
    p.add_argument("--max-shard-bytes", type=parse_size, help="safetensors: per file, e.g. 5GB (default 5 GiB)")
    p.add_argument("--prefix", help="safetensors: file name stem (default: model)")
    p.add_argument("--overwrite", action="store_true", help="zarr: replace a committed checkpoint at OUT")

    import_arguments(command("import", cmd_import, "write a checkpoint from safetensors files or a PyTorch DCP folder"))

    p = command("gc", cmd_gc, "apply retention to a CheckpointManager root: leftovers and old steps go")
    p.add_argument("root")
    p.add_argument("--keep-last", type=positive_int, required=True, help="keep the N newest committed steps")
    p.add_argument("--keep-every", type=positive_int, help="also keep every step divisible by K")
    p.add_argument("--dry-run", action="store_true", help="only say what would go")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


USAGE_ERRORS = (UsageError, LayoutError, argparse.ArgumentTypeError)
NOT_FOUND_OR_DAMAGED = (NotFound, CheckpointNotFoundError, FormatError, IntegrityError, ManagerLockedError, OSError)


AS_FLAGS = {"pass overwrite=True": "pass --overwrite", "trust_pickle=True": "--trust"}


def _glued(argv: list[str]) -> list[str]:
    """``--slice X`` as ``--slice=X``: argparse takes a value starting with ``-`` (``-2:``,
    ``-1,::-1``) for an option of its own."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] == "--slice":
            out[-1] = f"--slice={arg}"
        else:
            out.append(arg)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; the exit status (0 ok, 1 missing or damaged, 2 bad usage)."""
    parser = build_parser()
    try:
        args = parser.parse_args(_glued(sys.argv[1:] if argv is None else list(argv)))
    except SystemExit as exit_:  # --help, --version (0) or a usage error (2), already printed
        return exit_.code if isinstance(exit_.code, int) else 0 if exit_.code is None else 2
    try:
        return int(args.run(args))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader of our output went away (`| head`): stop quietly, as a pipe expects.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except Exception as err:
        if os.environ.get("LAYOUTCKPT_DEBUG"):
            raise
        code = 2 if isinstance(err, USAGE_ERRORS) else 1
        known = isinstance(err, USAGE_ERRORS + NOT_FOUND_OR_DAMAGED + (ValueError, TypeError))
        message = str(err) if known else f"unexpected {type(err).__name__}: {err}"
        if isinstance(err, OSError) and err.strerror and not isinstance(err, CheckpointNotFoundError):
            message = f"{err.strerror}: {err.filename!r}" if err.filename else err.strerror
        for keyword, flag in AS_FLAGS.items():  # the library's fixes, as this command's options
            message = message.replace(keyword, flag)
        hint = "" if known else " (LAYOUTCKPT_DEBUG=1 shows the traceback)"
        print(f"{PROG} {args.command}: error: {' '.join(message.split())}{hint}", file=sys.stderr)
        return code
