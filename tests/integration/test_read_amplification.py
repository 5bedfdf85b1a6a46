"""Reads touch only the inner chunks they need; saves read nothing.

Bytes are counted by TensorStore's own file-kvstore counter, ``/tensorstore/kvstore/file/bytes_read``
(per process: multi-rank numbers are measured inside each rank and sent back). Two bounds:

* exact accounting: a read fetches at most the inner chunks its box overlaps (each stored with a
  4-byte crc32c) plus the index of every shard it touches (16 bytes per inner chunk + crc32c),
  whatever chunk shape the planner chose;
* for boxes aligned to the inner chunks, at most 1.25x the bytes the box holds.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import tensorstore as ts
import torch

import layoutckpt as lc
from tests.support.counters import bytes_read
from tests.support.oracle import mesh_coords
from tests.support.paths import GOLDEN as GOLDENS

BOUND = 1.25
GOLDEN = GOLDENS / "v2" / "basic"
CRC = 4  # crc32c after every inner chunk and after each shard index
INDEX_ENTRY = 16  # (offset, length) as two uint64 per inner chunk
BINDING = 32  # the binding block read with each shard's index (format version 6, section 5.4)


def full_array(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)


def box_of(shape: tuple[int, ...], spec: tuple, axes: dict[str, int], rank: int) -> tuple[tuple[int, int], ...]:
    """This rank's (start, stop) per dim, as torch.chunk cuts them (never empty here)."""
    coords = mesh_coords(axes, rank)
    entries = list(spec) + [None] * (len(shape) - len(spec))
    box = []
    for n, entry in zip(shape, entries):
        names = () if entry is None else (entry,) if isinstance(entry, str) else entry
        k, i = 1, 0
        for a in names:
            k, i = k * axes[a], i * axes[a] + coords[a]
        piece = torch.arange(n).chunk(k)[i]
        box.append((int(piece[0]), int(piece[-1]) + 1))
    return tuple(box)


def chunk_accounting(info: lc.ArrayInfo, box) -> int:
    """The most a read of ``box`` may fetch: the inner chunks it overlaps, and the whole index
    of each shard it overlaps. Computed from the stored chunking alone."""
    shard, inner = info.shard_shape, info.inner_chunk_shape
    itemsize = info.dtype.itemsize
    chunk_bytes = itemsize * math.prod(inner) + CRC
    index_bytes = INDEX_ENTRY * math.prod(s // c for s, c in zip(shard, inner)) + CRC + BINDING
    total = 0
    ranges = [range(a // s, -(-b // s)) for (a, b), s in zip(box, shard)]
    for cell in itertools.product(*ranges):
        sub = [(max(a, i * s), min(b, (i + 1) * s)) for (a, b), i, s in zip(box, cell, shard)]
        chunks = math.prod((hi - 1) // c - lo // c + 1 for (lo, hi), c in zip(sub, inner))
        total += chunks * chunk_bytes + index_bytes
    return total


def aligned(info: lc.ArrayInfo, box) -> bool:
    return all(a % c == 0 and (b % c == 0 or b == n) for (a, b), c, n in zip(box, info.inner_chunk_shape, info.shape))


def check(info: lc.ArrayInfo, box, fetched: int, what: object) -> None:
    needed = math.prod(b - a for a, b in box) * info.dtype.itemsize
    allowed = chunk_accounting(info, box)
    assert needed <= fetched <= allowed, (what, fetched, needed, allowed, info)
    if aligned(info, box):
        assert fetched <= BOUND * needed, (what, fetched, needed, info)


# ----------------------------------------------------------------------------- rank functions


def _save(rank, group, path, shape, axes, spec, inner):
    layout = lc.Layout(lc.Mesh(axes), [(r"^w$", lc.P(*spec))])
    full = full_array(shape)
    box = box_of(shape, spec, axes, rank)
    state = {"w": full[tuple(slice(a, b) for a, b in box)]}
    before = bytes_read()
    lc.save(path, state, layout, group=group, inner_chunk_bytes=inner)
    return bytes_read() - before


def _load(rank, group, path, shape, axes, spec):
    layout = lc.Layout(lc.Mesh(axes), [(r"^w$", lc.P(*spec))])
    before = bytes_read()
    out = lc.load(path, layout, group=group)
    fetched = bytes_read() - before
    box = box_of(shape, spec, axes, rank)
    assert torch.equal(out["w"], full_array(shape)[tuple(slice(a, b) for a, b in box)])
    return fetched


# ----------------------------------------------------------------------------- (a) partial reads


def middle_chunks(info: lc.ArrayInfo) -> tuple[tuple[int, int], ...]:
    """The middle half of the inner-chunk grid along every dim: an aligned box of many chunks."""
    box = []
    for n, c in zip(info.shape, info.inner_chunk_shape):
        count = -(-n // c)
        lo, hi = count // 4, max(count // 4 + 1, 3 * count // 4)
        box.append((lo * c, min(hi * c, n)))
    return tuple(box)


@pytest.mark.parametrize(
    "index",
    [..., np.s_[100:2900, 64:2000], np.s_[:, :1024]],
    ids=["whole", "box", "columns"],
)
def test_a_large_read_in_one_shard_streams_through_it_into_the_result(tmp_path, index, monkeypatch):
    """A read of 8 MiB or more that lies in one shard is one prefetching read of that shard
    file, straight into the result: the same array, and no chunk fetched twice."""
    reads = _record_reads(monkeypatch)

    path = str(tmp_path / "ck")
    full = full_array((3072, 2048))  # 24 MiB, one shard
    lc.save(path, {"w": full}, lc.Layout.replicated())
    rd = lc.open(path)
    info = rd.info("w")
    view = full.numpy()[index]
    assert view.nbytes >= lc.IOConfig().large_read_bytes

    before = bytes_read()
    got = rd.read("w", index)
    fetched = bytes_read() - before

    assert got.tobytes() == view.tobytes() and got.shape == view.shape
    box = (
        tuple((0, n) for n in info.shape)
        if index is Ellipsis
        else tuple((sl.start or 0, n if sl.stop is None else sl.stop) for sl, n in zip(index, info.shape))
    )
    assert len(reads) == 1 and reads[0][0] == box and reads[0][1] is got and reads[0][2] == {"prefetch": True}
    index_bytes = INDEX_ENTRY * math.prod(s // c for s, c in zip(info.shard_shape, info.inner_chunk_shape)) + CRC
    index_bytes += BINDING
    assert view.nbytes <= fetched <= chunk_accounting(info, box) + index_bytes

    # An object store (memory:// stands for one): TensorStore copies each piece into its rows of the result.
    targets = []
    array = ts.array
    monkeypatch.setattr(ts, "array", lambda *a, **k: targets.append(a[0]) or array(*a, **k))
    remote = f"memory://{tmp_path.name}/ck"
    lc.save(remote, {"w": full}, lc.Layout.replicated())
    got = lc.open(remote).read("w", index)
    assert got.tobytes() == view.tobytes() and targets and all(np.shares_memory(t, got) for t in targets)


def _record_reads(monkeypatch) -> list:
    """Every shard-file read of the read engine, as (box, out, keywords)."""
    from layoutckpt.storage._readers import ShardFileReader

    calls = []
    read = ShardFileReader.read

    def recorded(self, name, meta, box, out, **k):
        calls.append((box, out, k))
        return read(self, name, meta, box, out, **k)

    monkeypatch.setattr(ShardFileReader, "read", recorded)
    return calls


# Every read from 1 byte on counts as large: read shard by shard, each as one stream.
LARGE = lc.IOConfig(large_read_bytes=1)


def test_a_large_read_over_several_shards_reads_each_shard_as_one_stream(monkeypatch):
    """A large read over several shard files goes shard by shard, each part read front to back
    with prefetch straight into its rows of the result, the parts covering the box once (the
    golden checkpoint's embedding: 5 rows in shards of 3 and 2, with the threshold lowered)."""
    pieces = _record_reads(monkeypatch)
    rd = lc.open(GOLDEN, io=LARGE)
    info = rd.info("model.embed.weight")
    assert info.shard_shape[0] < info.shape[0]

    got = rd.read("model.embed.weight")

    assert got.tobytes() == rd.tensorstore("model.embed.weight").read().result().tobytes()
    assert len(pieces) == -(-info.shape[0] // info.shard_shape[0])
    assert all(np.shares_memory(out, got) and k == {"prefetch": True} for _, out, k in pieces)
    assert [p[1:] for p, _, _ in pieces] == [((0, info.shape[1]),)] * len(pieces)
    rows = sorted(p[0] for p, _, _ in pieces)
    assert rows[0][0] == 0 and rows[-1][1] == info.shape[0]
    assert all(a[1] == b[0] == b[0] // info.shard_shape[0] * info.shard_shape[0] for a, b in itertools.pairwise(rows))


def _save_then_read(ranks, path: str, shape, axes, spec, box, io=None) -> tuple[lc.ArrayInfo, np.ndarray]:
    """``full_array(shape)`` saved by 4 ranks, then ``box`` of it read by this process: equal
    to the source, and no more bytes fetched than the chunks it overlaps and their indexes."""
    assert ranks.run(_save, 4, path, shape, axes, spec, 1024) == [0] * 4
    rd = lc.open(path, io=io)
    info = rd.info("w")
    index = tuple(slice(a, b) for a, b in box)
    before = bytes_read()
    got = rd.read("w", index)
    fetched = bytes_read() - before
    assert np.array_equal(got, full_array(shape).numpy()[index])
    check(info, box, fetched, index)
    return info, got


def test_a_large_read_over_a_2d_shard_grid_reads_each_shard_once(ranks, tmp_path, monkeypatch):
    """A box over 2 x 2 shards (rows by dp, columns by tp) is read as 4 parts, each into its
    block of the result (not contiguous in it), bit-exact and with only the chunks it needs."""
    pieces = _record_reads(monkeypatch)
    box = ((16, 48), (24, 72))
    info, got = _save_then_read(ranks, str(tmp_path / "ck"), (64, 96), {"dp": 2, "tp": 2}, ("dp", "tp"), box, LARGE)
    assert info.shard_shape == (32, 48)
    assert sorted(p for p, _, _ in pieces) == [
        ((16, 32), (24, 48)),
        ((16, 32), (48, 72)),
        ((32, 48), (24, 48)),
        ((32, 48), (48, 72)),
    ]
    assert all(np.shares_memory(out, got) and k == {"prefetch": True} for _, out, k in pieces)


@pytest.mark.parametrize(
    ("shape", "inner"),
    [((512, 256), 8192), ((256, 1024), 1024), ((16, 64, 64), 4096), ((4096,), 512)],
)
def test_partial_read_fetches_only_the_chunks_it_needs(tmp_path, shape, inner):
    path = str(tmp_path / "ck")
    full = full_array(shape)
    lc.save(path, {"w": full}, lc.Layout.replicated(), inner_chunk_bytes=inner)
    rd = lc.open(path)
    info = rd.info("w")
    assert math.prod(info.inner_chunk_shape) * 4 <= inner
    box = middle_chunks(info)
    index = tuple(slice(a, b) for a, b in box)

    before = bytes_read()
    got = rd.read("w", index)
    fetched = bytes_read() - before

    assert np.array_equal(got, full.numpy()[index])
    assert aligned(info, box)
    check(info, box, fetched, index)
    # Far from reading the whole (single-shard) array: the box is at most half of it.
    assert fetched < 0.6 * full.numel() * 4


def test_partial_read_of_a_multi_rank_checkpoint_reads_only_the_shards_it_needs(ranks, tmp_path):
    # Rows 64..192 straddle shards 0 and 1 (of 4): only those two indexes and their chunks.
    box = ((64, 192), (256, 768))
    info, _ = _save_then_read(ranks, str(tmp_path / "ck"), (512, 1024), {"tp": 4}, ("tp", None), box)
    assert info.shard_shape == (128, 1024)


# ----------------------------------------------------------------------------- (b) resharded loads


SAVES = {
    # 4 ranks, row-sharded, shards (128, 1024) in inner chunks of at most 1 KiB.
    "rows4": (4, (512, 1024), {"tp": 4}, ("tp", None)),
    # 2 ranks, column-sharded, shards (256, 512) in inner chunks of at most 1 KiB.
    "cols2": (2, (256, 1024), {"tp": 2}, (None, "tp")),
}
LOADS = [
    ("rows4", 2, {"tp": 2}, (None, "tp")),  # rows -> columns, on fewer ranks
    ("rows4", 2, {"tp": 2}, ("tp", None)),  # another tp on another number of ranks
    ("rows4", 4, {"dp": 2, "tp": 2}, (None, ("dp", "tp"))),  # 2-D mesh, columns by both axes
    ("rows4", 1, {"dp": 1}, (None, None)),  # everything on one rank
    ("rows4", 3, {"tp": 3}, ("tp", None)),  # uneven: 171/171/170 rows
    ("cols2", 4, {"dp": 2, "tp": 2}, ("tp", None)),  # columns -> rows, dp replicas
    ("cols2", 3, {"tp": 3}, (None, "tp")),  # uneven columns: 342/342/340
]


@pytest.mark.parametrize(("save", "m", "axes", "spec"), LOADS)
def test_resharded_load_fetches_about_what_each_rank_needs(ranks, tmp_path, save, m, axes, spec):
    k, shape, save_axes, save_spec = SAVES[save]
    path = str(tmp_path / save)
    # (c) along the way: a save reads nothing back, on any rank.
    assert ranks.run(_save, k, path, shape, save_axes, save_spec, 1024) == [0] * k
    info = lc.open(path).info("w")
    assert math.prod(info.inner_chunk_shape) * 4 <= 1024

    for rank, fetched in enumerate(ranks.run(_load, m, path, shape, axes, spec)):
        check(info, box_of(shape, spec, axes, rank), fetched, (rank, axes, spec))


# ----------------------------------------------------------------------------- (c) saves read nothing


@pytest.mark.parametrize("compression", [None, "zstd", "blosc"])
def test_save_reads_zero_bytes(tmp_path, compression):
    path = str(tmp_path / "ck")
    state = {"w": full_array((128, 256)), "b": torch.ones(7, dtype=torch.bfloat16), "step": 1}
    before = bytes_read()
    lc.save(path, state, lc.Layout.replicated(), inner_chunk_bytes=4096, compression=compression)
    # Replacing a committed checkpoint writes a new one beside it: still nothing read.
    lc.save(path, state, lc.Layout.replicated(), inner_chunk_bytes=4096, compression=compression, overwrite=True)
    assert bytes_read() - before == 0
    assert torch.equal(lc.load(path)["w"], state["w"])


def test_multi_rank_save_with_replicas_reads_zero_bytes(ranks, tmp_path):
    path = str(tmp_path / "ck")
    # dp replicas of each tp shard: only one of them writes it, and no one reads.
    assert ranks.run(_save, 4, path, (64, 96), {"dp": 2, "tp": 2}, ("tp", None), 2048) == [0] * 4
    assert torch.equal(lc.load(path)["w"], full_array((64, 96)))


def test_large_read_of_a_damaged_chunk_raises_integrity_error(tmp_path):
    path = tmp_path / "ck"
    lc.save(path, {"w": full_array((3072, 2048))}, lc.Layout.replicated())
    (shard,) = [f for f in (path / "w").rglob("*") if f.is_file() and f.name != "zarr.json"]
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(lc.IntegrityError, match="array 'w'"):
        lc.open(path).read("w")


# ----------------------------------------------------------------------------- (d) fused and padded

# Saved at TP=2, loaded under other degrees: each loading rank needs rows of several stored
# arrays (the parts of a fused tensor; the logical rows of its piece of a padded one) and must
# fetch nothing else. 12 query groups (4 q, 2 k, 2 v rows each) split 1, 2, 3 or 4 ways.
GROUPS, PER_GROUP, FFN, VOCAB, HIDDEN = 12, {"q": 4, "k": 2, "v": 2}, 96, 250, 64
VIEW_INNER = 1024


def view_layout(tp: int) -> lc.Layout:
    return lc.Layout(
        lc.Mesh({"tp": tp}),
        [
            (r"^qkv$", lc.Fused(lc.P("tp", None), list(PER_GROUP.items()), groups=GROUPS)),
            (r"^fc1$", lc.Fused(lc.P("tp", None), [("gate", FFN), ("up", FFN)])),
            (r"^embed$", lc.Padded(lc.P("tp", None), VOCAB)),
        ],
    )


def view_arrays() -> dict[str, torch.Tensor]:
    """The stored arrays: distinct values everywhere, so a misplaced row would show."""
    shapes = {**{p: (GROUPS * n, HIDDEN) for p, n in PER_GROUP.items()}, "gate": (FFN, HIDDEN), "up": (FFN, HIDDEN)}
    shapes["embed"] = (VOCAB, HIDDEN)
    out, offset = {}, 0
    for name, shape in shapes.items():
        out[name] = full_array(shape) + offset
        offset += math.prod(shape)
    return out


def view_boxes(tp: int, rank: int, pad_rows: int) -> dict[str, tuple[tuple[int, int], ...]]:
    """The rows of each stored array that rank ``rank`` of TP=``tp`` needs: its groups of the
    qkv parts, its torch.chunk rows of gate and up, its logical rows of the padded vocabulary."""
    g = GROUPS // tp
    boxes = {p: ((rank * g * n, (rank + 1) * g * n), (0, HIDDEN)) for p, n in PER_GROUP.items()}
    f = FFN // tp
    boxes.update({p: ((rank * f, (rank + 1) * f), (0, HIDDEN)) for p in ("gate", "up")})
    boxes["embed"] = ((min(rank * pad_rows, VOCAB), min((rank + 1) * pad_rows, VOCAB)), (0, HIDDEN))
    return boxes


def view_state(tp: int, rank: int, pad_rows: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s fused and padded tensors, assembled from the boxes above."""
    full, boxes = view_arrays(), view_boxes(tp, rank, pad_rows)
    rows = {name: full[name][slice(*box[0])] for name, box in boxes.items()}
    g = GROUPS // tp
    qkv = torch.cat([rows[p].reshape(g, n, HIDDEN) for p, n in PER_GROUP.items()], dim=1).reshape(-1, HIDDEN)
    embed = torch.zeros(pad_rows, HIDDEN)
    embed[: len(rows["embed"])] = rows["embed"]
    return {"qkv": qkv, "fc1": torch.cat([rows["gate"], rows["up"]]), "embed": embed}


def _save_views(rank, group, path):
    before = bytes_read()
    lc.save(path, view_state(2, rank, 128), view_layout(2), group=group, inner_chunk_bytes=VIEW_INNER)
    return bytes_read() - before


def _load_views(rank, group, path, tp, pad_rows):
    want = view_state(tp, rank, pad_rows)
    like = {name: torch.empty_like(t, device="meta") for name, t in want.items()}
    before = bytes_read()
    got = lc.load(path, view_layout(tp), like=like, group=group)
    fetched = bytes_read() - before
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), (rank, name)
    return fetched


@pytest.mark.parametrize(
    ("tp", "pad_rows"),
    [(4, 64), (4, 128), (3, 84), (1, 256)],
    # tp4-wide: ranks 2 and 3 hold only padding rows of the vocabulary, and read none of it.
    ids=["tp4", "tp4-wide", "tp3", "tp1"],
)
def test_resharded_load_of_fused_and_padded_arrays_fetches_only_the_chunks_it_needs(ranks, tmp_path, tp, pad_rows):
    path = str(tmp_path / "views")
    assert ranks.run(_save_views, 2, path) == [0, 0]
    rd = lc.open(path)
    infos = {name: rd.info(name) for name in ("qkv.q", "qkv.k", "qkv.v", "fc1.gate", "fc1.up", "embed")}
    # The padded vocabulary is stored in shards of the 128 rows each saving rank held.
    assert infos["embed"].shard_shape == (128, HIDDEN) and infos["embed"].shape == (VOCAB, HIDDEN)
    # Several inner chunks per shard (of about VIEW_INNER bytes, or the planner's smallest).
    assert all(math.prod(s // c for s, c in zip(i.shard_shape, i.inner_chunk_shape)) > 1 for i in infos.values())

    for rank, fetched in enumerate(ranks.run(_load_views, tp, path, tp, pad_rows)):
        boxes = view_boxes(tp, rank, pad_rows)
        parts = [(infos[name], boxes[name.rpartition(".")[2]]) for name in infos]
        needed = sum(math.prod(b - a for a, b in box) * i.dtype.itemsize for i, box in parts)
        allowed = sum(chunk_accounting(i, box) for i, box in parts if all(b > a for a, b in box))
        assert needed <= fetched <= allowed, (rank, tp, fetched, needed, allowed)
        # Exactly: each inner chunk its rows overlap, once, and the index of each shard they lie
        # in; no chunk of another rank's groups or rows, none of a padding row.
        assert fetched / allowed == 1.0, (rank, tp, fetched, needed, allowed)
        if all(aligned(i, box) for i, box in parts):
            assert fetched <= BOUND * needed, (rank, tp, fetched, needed)
