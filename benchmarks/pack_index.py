"""How much of a packed checkpoint's index one loading rank reads, at scale, without the data.

A packed checkpoint (``packing="ocdbt"``) keeps each rank's shards in a database of its own under
``packs/`` and merges their B+trees into the root's at the commit. The merged root orders keys
by array, so a rank's share of an FSDP-style state lies in every one of its leaves; a load that
knows which ranks wrote its shards looks them up in those ranks' databases instead
(``storage/_packindex.Router``, docs/design/packing.md). This script builds such an index for
``--ranks`` ranks and ``--arrays`` arrays with no array data behind it (each rank's database
written by layoutckpt's own encoder, as a save writes it, then merged by TensorStore as a
commit merges it), and times one rank's lookups of its shards both ways, alternated:

- ``fsdp``: every array split over all ranks (``P("dp")``), shard ``r`` written by rank ``r``;
  the root document's writer rule names it;
- ``hsdp``: split over ``dp``, replicated over ``pp`` (4); the save's balance picks the writing
  replica piece by piece (here ``(array + piece) % 4``), so the reader tries the piece's holders.

It prints, per way, the median and spread of the lookups' time and the B+tree nodes read.

    .venv/bin/python benchmarks/pack_index.py --ranks 4096 --layout hsdp
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import layoutckpt as lc
from layoutckpt.format import _ocdbt
from layoutckpt.format._format import ArrayMeta
from layoutckpt.storage import _packindex, _packs
from layoutckpt.storage._location import locate
from layoutckpt.storage._shardread import Files

REPLICAS = 4  # hsdp: the pp replicas of each piece


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4096)
    ap.add_argument("--arrays", type=int, default=347, help="arrays, each split over the ranks (or dp)")
    ap.add_argument("--layout", choices=("fsdp", "hsdp"), default="fsdp")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args(argv)
    pieces = args.ranks // REPLICAS if args.layout == "hsdp" else args.ranks
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="lc-pack-index-") as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        build(root, args.ranks, args.arrays, pieces, args.layout)
        print(f"{args.ranks} ranks' databases of {args.arrays} arrays, merged, in {time.perf_counter() - t0:.1f} s")
        if args.layout == "fsdp":
            mesh = lc.Mesh({"dp": args.ranks})
            rules = {_path(j): (0, 1) for j in range(args.arrays)}
        else:
            mesh, rules = lc.Mesh({"pp": REPLICAS, "dp": pieces}), {}
        spec = lc.P("dp")
        metas = [ArrayMeta(_path(j), (8 * pieces, 8), "float32", (8, 8), (8, 8), spec) for j in range(args.arrays)]
        times: dict[str, list[tuple[float, int]]] = {"merged root": [], "writers' databases": []}
        for rep in range(args.repeats):
            ways = list(times) if rep % 2 == 0 else list(reversed(times))
            piece = (rep * 7919) % pieces
            for way in ways:
                routed = way != "merged root"
                times[way].append(lookups(root, metas, piece, rules if routed else {}, mesh if routed else None))
    for way, got in times.items():
        seconds = [s for s, _ in got]
        print(
            f"{way:19s} one rank's {args.arrays} lookups: median {statistics.median(seconds) * 1e3:.1f} ms "
            f"({min(seconds) * 1e3:.1f}-{max(seconds) * 1e3:.1f}), B+tree nodes read {got[0][1]}"
        )


def _path(j: int) -> str:
    return f"model/layers/{j // 9}/w{j % 9}/weight"


def _writer(layout: str, j: int, piece: int, pieces: int) -> int:
    return piece if layout == "fsdp" else piece + pieces * ((j + piece) % REPLICAS)


def build(root: Path, ranks: int, arrays: int, pieces: int, layout: str) -> None:
    """Each rank's database of the shards it wrote (pointing at a sparse data file), merged."""
    written: dict[int, list[tuple[int, int]]] = {}
    for j in range(arrays):
        for piece in range(pieces):
            written.setdefault(_writer(layout, j, piece, pieces), []).append((j, piece))
    for rank in range(ranks):
        base = root / _packs.rank_base(rank)
        (base / "d").mkdir(parents=True)
        name = f"d/{uuid.uuid4().hex}"
        mine = written.get(rank, [])
        entries = [(f"{_path(j)}/c.{p}.0".encode(), _ocdbt.Placed(0, 4096 * k, 4096)) for k, (j, p) in enumerate(mine)]
        end = 4096 * max(len(mine), 1)
        tree = _ocdbt.encode_tree([name], entries, 0, end)
        with open(base / name, "wb") as f:
            f.truncate(end)
            f.seek(end)
            for node in tree.nodes:
                f.write(node)
        manifest = _ocdbt.encode_manifest(uuid.uuid4().bytes, [name], tree, time.time_ns())
        (base / _packindex.MANIFEST).write_bytes(manifest)
    _packs.merge(locate(str(root)), ranks)


def lookups(root: Path, metas: list[ArrayMeta], piece: int, rules: dict, mesh: lc.Mesh | None) -> tuple[float, int]:
    """Seconds to find shard ``piece`` of every array through a fresh reader's index, and the
    B+tree nodes it read."""
    gc.collect()
    before = sum(_packindex.nodes_read().values())
    files = Files(root)
    t0 = time.perf_counter()
    router = _packindex.Router(root, files, rules, mesh)
    router.expect([(m, ((8 * piece, 8 * piece + 8), (0, 8))) for m in metas])
    found = [router.locate(f"{m.path}/c.{piece}.0") for m in metas]
    seconds = time.perf_counter() - t0
    files.close()
    if any(f is None for f in found):
        sys.exit("a shard was not found")
    return seconds, sum(_packindex.nodes_read().values()) - before


if __name__ == "__main__":
    main()
