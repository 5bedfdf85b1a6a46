"""``layoutckpt import SRC DST``: a checkpoint from Hugging Face safetensors files
(``import_safetensors``) or from a PyTorch DCP folder (``import_dcp``, only with ``--trust``:
DCP's metadata is a pickle).

``--from`` may be left out: a folder holding DCP's ``.metadata`` is DCP, anything else
safetensors. ``--spec``/``--mesh`` chunk the arrays as a save under that layout would. DCP needs
torch, whose classes its metadata is made of; safetensors needs only NumPy.
"""

from __future__ import annotations

import argparse
import os

from ._common import NotFound, UsageError
from ._plan import target_layout
from ._text import human, plural

FORMATS = ("safetensors", "dcp")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "src", help="a .safetensors file, an *.safetensors.index.json, or a folder of either; or a DCP folder"
    )
    p.add_argument("dst", help="the checkpoint to write (a local directory)")
    p.add_argument(
        "--from",
        dest="source",
        choices=FORMATS,
        help="the input format (default: dcp for a folder holding DCP's .metadata, else safetensors)",
    )
    p.add_argument("--trust", action="store_true", help="DCP only: unpickle its .metadata (see docs/howto/from-dcp.md)")
    p.add_argument("--spec", help="a TOML layout to chunk the arrays by (default: every array whole)")
    p.add_argument("--mesh", help="the layout's mesh, e.g. dp=2,tp=4 (default: the spec file's [mesh])")
    p.add_argument("--step", type=int, help="the step to record in the checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace a committed checkpoint at DST")


def source_format(args: argparse.Namespace) -> str:
    if args.source:
        return args.source
    return "dcp" if os.path.isfile(os.path.join(args.src, ".metadata")) else "safetensors"


def cmd_import(args: argparse.Namespace) -> int:
    layout, _ = target_layout(args)
    kind = source_format(args)
    if kind == "safetensors":
        from .._safetensors import import_safetensors

        if args.trust:
            raise UsageError("--trust is for --from dcp; safetensors files hold no pickle")
        import_safetensors(args.src, args.dst, layout, step=args.step, overwrite=args.overwrite)
        skipped: tuple[str, ...] = ()
    else:
        from .._dcp import METADATA_FILE, TrustRequiredError, import_dcp

        if not os.path.isfile(os.path.join(args.src, METADATA_FILE)):
            raise NotFound(
                f"no DCP checkpoint at {args.src!r}: it has no {METADATA_FILE} file (dcp.save writes one, last)"
            )
        try:
            done = import_dcp(
                args.src, args.dst, layout, trust_pickle=args.trust, step=args.step, overwrite=args.overwrite
            )
        except TrustRequiredError:
            raise UsageError(
                f"{os.path.join(args.src, METADATA_FILE)} is a Python pickle, and unpickling a file runs what it "
                "says; add --trust if you trust where this checkpoint came from (even then only DCP's own "
                "metadata classes are admitted, and any other class is refused unrun)"
            ) from None
        skipped = done.skipped
    from .._reader import Reader

    with Reader(args.dst) as rd:
        names = list(rd.keys())
        total = sum(rd.info(n).nbytes for n in names)
    print(f"{args.dst}  {plural(len(names), 'array')}, {human(total)} (from {kind})")
    for name in skipped:
        print(f"skipped {name}: its pickle holds more than plain values")
    return 0
