"""Planning at scale: what one rank's save and load plans cost for a 70B model on 16,384 ranks.

    .venv/bin/python benchmarks/plan_scale.py [--quick] [--scenario NAME ...] [--repeats 3] [--json out.json]

Every rank plans alone (no gather or scatter of plans), so one rank's plan must stay cheap
however many ranks there are. In one process, for a Llama-3-70B-like training state (vocab
128256, hidden 8192, 80 layers, 64 heads / 8 kv heads of 128, intermediate 28672, RMSNorms;
bfloat16 weights and two float32 AdamW moments: 3 arrays per parameter), this measures:

- **save plan, one rank**: what ``_save._plan_globally`` computes after its collectives (rule lookup,
  spec check, global shape, shard and inner chunk shapes, ``ArrayMeta``, the rank's own box
  check, the writer rules, ``CheckpointMeta``, ``_plan.writes_of``), timed with ``time.perf_counter`` (median
  over ``--repeats`` ranks), its peak Python allocation (``tracemalloc``) and the growth of the
  process's peak RSS (``VmHWM``, reset through ``/proc/self/clear_refs``);
- **load plan, one rank**: for every array, the rule lookup, spec check and ``shard_box`` on the
  load mesh, and the stored shards and inner chunks the box touches (``_plan.chunks_touched``);
  opening (parsing the root document) is timed on its own;
- **all ranks**: every rank's save plan, as a cluster computes it (world x one rank), and as one
  process computes them in a loop (sampled ranks, extrapolated, unless the mesh is small);
- **objects and metadata**: shard files (non-empty grid cells), ``zarr.json`` documents, inner
  chunks; the root document's size (the one read that opening a checkpoint needs) and the
  per-array ``zarr.json`` sizes.

Scenarios (``--scenario``; default all), each saved on ``Mesh({"pp": 4, "dp": 512, "tp": 8})``
(tp innermost, as on clusters; rank order does not change the cost):

- ``stacked-tp``: each layer parameter is one array with a leading layer dimension of 80 split
  over ``pp`` (a layoutckpt save needs every rank to hold the same names), Megatron-style
  tensor parallelism, data-parallel replicas; loaded on ``{"pp": 4, "dp": 256, "tp": 16}``;
- ``stacked-fsdp``: the same, with FSDP sharding the TP-local tensors' first dimension over
  ``dp`` (``P("pp", ("tp", "dp"), None)``, ...); loaded on ``{"pp": 4, "dp": 1024, "tp": 4}``;
- ``unstacked-tp`` / ``unstacked-fsdp``: 80 per-layer arrays per parameter, ``pp`` one more
  replica axis; the latter, with 5.7 million shard files, is the stress case of the planner;
- ``pipeline-tp``: real pipeline stages. Each stage holds only its own 20 layers under local
  names (``layers.0`` to ``layers.19``), declared with ``names=[Renumber(..., "pp", per=20)]``,
  the embedding on the first stage and the final norm and output on the last; Megatron TP and
  dp replicas as in ``unstacked-tp``. A rank's plan here is what ``lc.save`` runs: flatten,
  ``localize`` (local names made global), the stage exchange merged (``_stages.join``: one
  speaker's document per stage, every rank receives all of them), then ``_save._plan_globally``
  with the stage-held arrays' writers restricted to their stage. The collectives are a stand-in
  that returns what the process group would (the speakers' documents, built by the speakers'
  own code path, and the sums and extremes of the local shapes); the bytes each rank receives
  in the exchange are reported. Loaded on ``{"pp": 8, "dp": 256, "tp": 8}`` (10 layers a
  stage), each rank planning only its own stage's names.

``--quick`` plans the same model on 64-rank meshes (seconds; ``pipeline-tp`` on 2 stages,
loaded on 4).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import re
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from layoutckpt import IOConfig, Layout, Mesh, P, Renumber, _save, _stages
from layoutckpt._pieces import localize, pieces_of, tie, tree_nodes
from layoutckpt.format._format import ArrayMeta, CheckpointMeta, parse_root_document, root_document
from layoutckpt.layout import _plan
from layoutckpt.layout._names import to_global
from layoutckpt.layout._spec import check_spec
from layoutckpt.layout._tree import flatten, name_to_path

KB, MB = 1 << 10, 1 << 20
INNER_CHUNK_BYTES = 2 << 20  # layoutckpt's default
TARGET_SECONDS, TARGET_BYTES = 1.0, 200 * MB

LLAMA3_70B = dict(vocab=128256, hidden=8192, layers=80, heads=64, kv_heads=8, head_dim=128, intermediate=28672)

FULL_MESHES = (Mesh({"pp": 4, "dp": 512, "tp": 8}), Mesh({"pp": 4, "dp": 256, "tp": 16}))
FSDP_LOAD_MESH = Mesh({"pp": 4, "dp": 1024, "tp": 4})
SCENARIOS = ("stacked-tp", "stacked-fsdp", "unstacked-tp", "unstacked-fsdp", "pipeline-tp")
QUICK_MESHES = (Mesh({"pp": 2, "dp": 8, "tp": 4}), Mesh({"pp": 2, "dp": 4, "tp": 8}))
# pipeline-tp: saved on 4 stages of 20 layers, loaded on 8 of 10 (quick: 2 of 40, then 4 of 20).
PIPELINE_MESHES = (Mesh({"pp": 4, "dp": 512, "tp": 8}), Mesh({"pp": 8, "dp": 256, "tp": 8}))
QUICK_PIPELINE_MESHES = (Mesh({"pp": 2, "dp": 8, "tp": 4}), Mesh({"pp": 4, "dp": 4, "tp": 4}))
# The layer number of a parameter and of its optimizer moments ("optim.exp_avg.model.layers.3.").
LAYER_NUMBER = r"(?:^|\.)layers\.(\d+)\."
PIPELINE_LOOP_SAMPLE = 8
# The writing threads of a packed save on a node of 4 cores or more (``IOConfig.threads``).
PACK_THREADS = 4

# Per role, the spec of the unstacked parameter: Megatron TP (column-parallel split by output
# rows, row-parallel by input columns, vocab-parallel embedding and head), and the same with
# FSDP sharding the TP-local tensor's first dimension over dp.
SPECS = {
    "tp": {"col": P("tp", None), "row": P(None, "tp"), "vocab": P("tp", None), "norm": P()},
    "fsdp": {"col": P(("tp", "dp"), None), "row": P("dp", "tp"), "vocab": P(("tp", "dp"), None), "norm": P("dp")},
}
PATTERNS = {
    "vocab": r"(tok_embeddings|output)\.weight$",
    "col": r"layers\.(\d+\.)?(attention\.w[qkv]|feed_forward\.w[13])\.weight$",
    "row": r"layers\.(\d+\.)?(attention\.wo|feed_forward\.w2)\.weight$",
    "layer_norm": r"layers\.(\d+\.)?\w+_norm\.weight$",
}


@attrs.frozen
class Leaf:
    name: str
    shape: tuple[int, ...]
    dtype: str
    itemsize: int


def parameters(cfg: dict[str, int], stacked: bool) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter; stacked layers carry a leading layer dimension."""
    h, kv, inter = cfg["hidden"], cfg["kv_heads"] * cfg["head_dim"], cfg["intermediate"]
    assert cfg["heads"] * cfg["head_dim"] == h
    per_layer = [
        ("attention.wq.weight", (h, h)),
        ("attention.wk.weight", (kv, h)),
        ("attention.wv.weight", (kv, h)),
        ("attention.wo.weight", (h, h)),
        ("feed_forward.w1.weight", (inter, h)),
        ("feed_forward.w2.weight", (h, inter)),
        ("feed_forward.w3.weight", (inter, h)),
        ("attention_norm.weight", (h,)),
        ("ffn_norm.weight", (h,)),
    ]
    layers = cfg["layers"]
    if stacked:
        body = [(f"layers.{n}", (layers, *s)) for n, s in per_layer]
    else:
        body = [(f"layers.{i}.{n}", s) for i in range(layers) for n, s in per_layer]
    return [
        ("tok_embeddings.weight", (cfg["vocab"], h)),
        *body,
        ("norm.weight", (h,)),
        ("output.weight", (cfg["vocab"], h)),
    ]


def training_state(params: list[tuple[str, tuple[int, ...]]]) -> list[Leaf]:
    """bfloat16 weights and two float32 AdamW moments of the same shapes."""
    leaves = [Leaf(f"model.{n}", s, "bfloat16", 2) for n, s in params]
    for moment in ("exp_avg", "exp_avg_sq"):
        leaves += [Leaf(f"optim.{moment}.model.{n}", s, "float32", 4) for n, s in params]
    return leaves


def layout_for(style: str, stacked: bool, mesh: Mesh) -> Layout:
    specs = SPECS[style]

    def layer(spec: P) -> P:
        return P("pp", *spec.entries) if stacked else spec

    return Layout(
        mesh,
        [
            (PATTERNS["vocab"], specs["vocab"]),
            (PATTERNS["col"], layer(specs["col"])),
            (PATTERNS["row"], layer(specs["row"])),
            (PATTERNS["layer_norm"], layer(specs["norm"])),
            (r".*", specs["norm"]),
        ],
    )


def tree_of(leaves: list[Leaf]) -> Any:
    """The checkpoint's tree, as ``flatten`` builds it from the nested state."""
    state: dict[str, Any] = {}
    for leaf in leaves:
        node = state
        *parents, last = leaf.name.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = np.empty(0)
    return flatten(state)[0]


def pipeline_layout(mesh: Mesh) -> Layout:
    """Megatron TP on pipeline stages that number their layers from 0: ``layers.i`` on stage
    ``c`` is stored as ``layers.{i + c * per}``; ``pp`` is a stage axis (the Renumber's)."""
    per = LLAMA3_70B["layers"] // mesh.axis_size("pp")
    return Layout(mesh, layout_for("tp", False, mesh).rules, names=[Renumber(LAYER_NUMBER, "pp", per=per)])


@attrs.frozen
class Scenario:
    name: str
    leaves: list[Leaf]
    save: Layout
    load: Layout
    tree: Any
    stages: bool = False  # ranks hold their pipeline stage's arrays only, under local names


def scenarios(quick: bool) -> list[Scenario]:
    save_mesh, load_mesh = QUICK_MESHES if quick else FULL_MESHES
    fsdp_load = QUICK_MESHES[1] if quick else FSDP_LOAD_MESH
    pipe_save, pipe_load = QUICK_PIPELINE_MESHES if quick else PIPELINE_MESHES
    leaves = training_state(parameters(LLAMA3_70B, stacked=False))
    pipeline = Scenario(
        "pipeline-tp", leaves, pipeline_layout(pipe_save), pipeline_layout(pipe_load), None, stages=True
    )
    out = []
    for name, style, stacked, to in [
        ("stacked-tp", "tp", True, load_mesh),
        ("stacked-fsdp", "fsdp", True, fsdp_load),
        ("unstacked-tp", "tp", False, load_mesh),
        ("unstacked-fsdp", "fsdp", False, fsdp_load),
    ]:
        leaves = training_state(parameters(LLAMA3_70B, stacked))
        out.append(
            Scenario(
                name, leaves, layout_for(style, stacked, save_mesh), layout_for(style, stacked, to), tree_of(leaves)
            )
        )
    return [*out, pipeline]


# ----------------------------------------------------------------------------- the plans


@attrs.frozen
class Collected:
    """What the save's collectives give every rank: sums, maxima and minima of local shapes."""

    sums: list[list[int]]
    mins: list[list[int]]
    maxs: list[list[int]]


def collectives(s: Scenario) -> Collected:
    mesh = s.save.mesh
    sums, mins, maxs = [], [], []
    for leaf in s.leaves:
        spec = s.save.spec_for(leaf.name)
        assert isinstance(spec, P)
        counts = _plan.split_counts(len(leaf.shape), spec, mesh)
        lengths = [
            [stop - start for start, stop in (_plan.split_range(n, k, i) for i in range(k))]
            for n, k in zip(leaf.shape, counts)
        ]
        sums.append([sum(ls) * (mesh.size // k) for ls, k in zip(lengths, counts)])
        mins.append([min(ls) for ls in lengths])
        maxs.append([max(ls) for ls in lengths])
    return Collected(sums, mins, maxs)


def save_plan(s: Scenario, got: Collected, rank: int) -> tuple[CheckpointMeta, list[tuple[int, _plan.Box]]]:
    """One rank's save plan, as ``_save._plan_globally`` computes it once the collectives are done."""
    mesh = s.save.mesh
    plan_arrays: list[_plan.ArraySpec] = []
    for leaf, sums, mins, maxs in zip(s.leaves, got.sums, got.mins, got.maxs):
        spec = s.save.spec_for(leaf.name)
        assert isinstance(spec, P)
        check_spec(spec, mesh, len(leaf.shape), leaf.name, leaf.shape)
        shape = _plan.global_shape_from_sums(leaf.name, spec, mesh, sums, mins, maxs)
        plan_arrays.append(_plan.ArraySpec(leaf.name, shape, spec, leaf.itemsize))
    metas: dict[str, ArrayMeta] = {}
    for leaf, pa, outer in zip(s.leaves, plan_arrays, _plan.stored_shards(plan_arrays, mesh)):
        inner = _plan.chunk_shape_for(outer, leaf.itemsize, INNER_CHUNK_BYTES)
        metas[leaf.name] = ArrayMeta(name_to_path(leaf.name), pa.shape, leaf.dtype, outer, inner, pa.spec)
    for pa in plan_arrays:  # the rank checks its own shard against the plan
        _plan.box_shape(_plan.shard_box(pa.shape, pa.spec, mesh, rank))
    rules = _plan.writer_rules(plan_arrays, mesh)  # what a packed checkpoint records
    writers = {pa.name: rule for pa, rule in zip(plan_arrays, rules) if rule is not None}
    meta = CheckpointMeta(metas, s.tree, mesh, s.save.spec_rules, step=1000, all_chunks_stored=True, writers=writers)
    return meta, _plan.writes_of(plan_arrays, mesh, rank)


def load_plan(
    meta: CheckpointMeta, layout: Layout, rank: int, local_names: list[str] | None = None
) -> list[tuple[str, _plan.Box, int, int]]:
    """(name, box, stored shards touched, inner chunks touched) of every array, for one rank;
    with ``local_names`` (what a pipeline stage holds), of those, made global by the layout."""
    names: Any = meta.arrays
    if local_names is not None:
        names = to_global(layout.names, local_names, layout.mesh.coords(rank)).values()
    out = []
    for name in names:
        a = meta.arrays[name]
        spec = layout.spec_for(name)
        assert isinstance(spec, P)
        check_spec(spec, layout.mesh, len(a.shape), name, a.shape)
        box = _plan.shard_box(a.shape, spec, layout.mesh, rank)
        out.append(
            (name, box, _plan.chunks_touched(box, a.shard_shape), _plan.chunks_touched(box, a.inner_chunk_shape))
        )
    return out


def forget_writers() -> None:
    """Drop the planner's cached global writer assignment (and any other of its caches), so a
    plan is computed from scratch as on a rank that plans alone."""
    for value in list(vars(_plan).values()):
        if callable(getattr(value, "cache_clear", None)):
            value.cache_clear()


# ----------------------------------------------------------------------------- pipeline stages


def stage_names(s: Scenario, layout: Layout, rank: int) -> dict[str, tuple[Leaf, tuple[int, ...]]]:
    """{local name: (global leaf, local shape)} of what ``rank`` holds on its pipeline stage: the
    stage's layers numbered from 0, the embedding on the first stage, the final norm and the
    output on the last; of each, the rank's tensor-parallel piece."""
    mesh = layout.mesh
    stages, stage = mesh.axis_size("pp"), mesh.coords(rank)["pp"]
    per = LLAMA3_70B["layers"] // stages
    out = {}
    for leaf in s.leaves:
        match = re.search(LAYER_NUMBER, leaf.name)
        if match is not None:
            number = int(match.group(1))
            if number // per != stage:
                continue
            local = f"{leaf.name[: match.start(1)]}{number - stage * per}{leaf.name[match.end(1) :]}"
        elif stage != (0 if "tok_embeddings" in leaf.name else stages - 1):
            continue
        else:
            local = leaf.name
        spec = layout.spec_for(leaf.name)
        assert isinstance(spec, P)
        out[local] = (leaf, _plan.box_shape(_plan.shard_box(leaf.shape, spec, mesh, rank)))
    return out


def stage_state(s: Scenario, rank: int) -> dict[str, Any]:
    """The nested state ``rank`` passes to ``lc.save``: its local names, torch tensors of its
    pieces' shapes (each its own element, broadcast: no memory; not tied to one another)."""
    import torch

    dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    state: dict[str, Any] = {}
    for local, (leaf, shape) in stage_names(s, s.save, rank).items():
        node = state
        *parents, last = local.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = torch.zeros((), dtype=dtypes[leaf.dtype]).expand(shape)
    return state


class _Told(Exception):
    """How a speaker's document is caught on its way into the stage exchange."""

    def __init__(self, data: bytes) -> None:
        super().__init__("broadcast")
        self.data = data


@attrs.define
class Collectives:
    """The process group as one rank sees it: every collective returns what the real one would,
    computed beforehand (the speakers' documents of the stage exchange; the sums and extremes of
    every rank's local shapes). Without documents, the exchange's broadcast raises ``_Told``
    with this rank's own document."""

    rank: int
    world: int
    told: list[bytes] = attrs.field(factory=list)
    sums: list[int] = attrs.field(factory=list)
    extremes: list[int] = attrs.field(factory=list)  # the maxima, then the minima negated

    @property
    def global_ranks(self) -> list[int]:
        return list(range(self.world))

    def broadcast_many(self, sources: list[int], data: bytes | None) -> list[bytes]:
        if not self.told:
            raise _Told(data or b"")
        assert len(sources) == len(self.told)
        return list(self.told)

    def all_reduce(self, values: list[int], op: str) -> list[int]:
        out = self.sums if op == "sum" else self.extremes
        assert len(out) == len(values), (op, len(out), len(values))
        return list(out)

    def all_max_min(self, values: list[int]) -> tuple[list[int], list[int]]:
        return list(values), list(values)


def stage_checked(layout: Layout, state: Any, comm: Collectives) -> Any:
    """What ``_save._check_locally`` makes of one rank's state: its pieces under global names,
    each checked against its spec, and the stored tree's leaves."""
    mesh = layout.mesh
    structure, leaves = tie(*flatten(state))
    pieces = localize(pieces_of(leaves), layout, mesh, comm.rank)
    arrays, shardings, flats = _save._shardings(comm, pieces, layout, mesh)
    nodes = tree_nodes(structure, pieces, flats, layout, mesh, comm.rank)
    return _save._Checked(mesh, structure=structure, arrays=arrays, shardings=shardings, flats=flats, nodes=nodes)


class Pipeline:
    """One rank's save and load plans in ``pipeline-tp``, as ``lc.save`` and a load compute them."""

    def __init__(self, s: Scenario) -> None:
        self.s, self.layout, self.mesh = s, s.save, s.save.mesh
        self._states: dict[int, Any] = {}
        # Each stage's speaker builds its document as every rank does (and is caught broadcasting it).
        self.told = [self._document(rank) for rank in _stages.speakers(self.mesh, self.layout.stage_axes)]
        self.sums: list[int] = []
        self.extremes: list[int] = []
        # The sums and extremes of the local shapes, in the order of the joined arrays (the same on
        # every rank); a rank outside an array's stages holds none of it (a stand-in of no size).
        comm = self.comm(0)
        joined = _save._with_views(comm, stage_checked(self.layout, self.state(0), comm), self.layout)
        assert joined.error is None and joined.holders is not None, joined.error
        shapes = {leaf.name: leaf.shape for leaf in s.leaves}
        coordinates = math.prod(self.mesh.axis_size(a) for a in self.layout.stage_axes)
        mins, maxs = [], []
        for a, (m, spec), held in zip(joined.arrays, joined.shardings, joined.holders):
            holders = len(held) * m.size // coordinates
            shape = shapes[a.name]
            for n, k in zip(shape, _plan.split_counts(len(shape), spec, m)):
                lengths = [stop - start for start, stop in (_plan.split_range(n, k, i) for i in range(k))]
                self.sums.append(sum(lengths) * holders // k)
                mins.append(min(lengths))
                maxs.append(max(lengths))
        self.extremes = [*maxs, *(-v for v in mins)]

    def state(self, rank: int) -> Any:
        """The state ``rank`` holds (made once: it exists before a save)."""
        if rank not in self._states:
            self._states[rank] = stage_state(self.s, rank)
        return self._states[rank]

    def comm(self, rank: int) -> Collectives:
        return Collectives(rank, self.mesh.size, self.told, self.sums, self.extremes)

    def _document(self, rank: int) -> bytes:
        comm = Collectives(rank, self.mesh.size)
        # The save holds a failure of the exchange as this rank's error: here, the broadcast caught.
        told = _save._with_views(comm, stage_checked(self.layout, self.state(rank), comm), self.layout).error
        assert isinstance(told, _Told), told
        return told.data

    def _to_plan(self, rank: int) -> tuple[Collectives, Any, Any]:
        comm = self.comm(rank)
        checked = _save._with_views(comm, stage_checked(self.layout, self.state(rank), comm), self.layout)
        if checked.error is not None:
            raise checked.error
        stages = _save._stage_plan(checked, self.layout)
        what = _save._ToPlan(
            mesh=self.mesh,
            arrays=checked.arrays,
            shardings=checked.shardings,
            flats=checked.flats,
            inner_chunk_bytes=INNER_CHUNK_BYTES,
            compression=None,
            stages=stages,
        )
        return comm, checked, what

    def save(self, rank: int) -> tuple[CheckpointMeta, list[tuple[int, _plan.Box]]]:
        """One rank's save from its state to its writes: flatten, localize, the stage exchange
        merged, the plan (global shapes, array documents, shard checks, writes)."""
        comm, checked, what = self._to_plan(rank)
        planned = _save._plan_globally(comm, what, 0)
        meta = CheckpointMeta(
            dict(planned.metas), checked.structure, self.mesh, self.layout.spec_rules, step=1000, all_chunks_stored=True
        )
        return meta, [(index, box) for index, box, *_ in planned.regular]

    def merge(self, rank: int) -> Callable[[], Any]:
        """The stage exchange's merge alone for ``rank``: ``_save._with_views`` past the broadcasts
        (``_stages.join``: the documents parsed and merged, stand-ins made; the stored tree built)."""
        comm = self.comm(rank)
        checked = stage_checked(self.layout, self.state(rank), comm)
        return lambda: _save._with_views(comm, checked, self.layout)

    def plan_arrays(self) -> list[_plan.ArraySpec]:
        comm, _, what = self._to_plan(0)
        return _save._array_metas(comm, what)[1]

    def load_names(self, rank: int) -> list[str]:
        """The local names ``rank`` of the load mesh holds (its own stage's)."""
        return list(stage_names(self.s, self.s.load, rank))


# ----------------------------------------------------------------------------- measuring


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * KB
    return 0


def measure(fn: Callable[[], Any]) -> tuple[float, int, int]:
    """(seconds, tracemalloc peak bytes, peak RSS growth bytes) of one call, from a cold cache."""
    gc.collect()
    forget_writers()
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    gc.collect()
    forget_writers()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        before = _rss("VmRSS")
    except OSError:
        before = None
    fn()
    grown = _rss("VmHWM") - before if before is not None else -1
    forget_writers()
    tracemalloc.start()
    fn()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    forget_writers()
    return seconds, peak, grown


def box_bytes(a: _plan.ArraySpec, mesh: Mesh) -> np.ndarray:
    """The bytes of every rank's box, for all ranks at once."""
    coords = np.indices([size for _, size in mesh.axes]).reshape(len(mesh.axes), mesh.size)
    out = np.full(mesh.size, a.itemsize, dtype=np.int64)
    for n, entry in zip(a.shape, a.spec.padded(len(a.shape))):
        k, i = 1, np.zeros(mesh.size, dtype=np.int64)
        for axis in (entry,) if isinstance(entry, str) else entry or ():
            k, i = k * mesh.axis_size(axis), i * mesh.axis_size(axis) + coords[mesh.axis_names.index(axis)]
        piece = -(-n // k)
        out *= np.minimum((i + 1) * piece, n) - np.minimum(i * piece, n)
    return out


def write_loads(arrays: list[_plan.ArraySpec], mesh: Mesh) -> np.ndarray:
    """The bytes every rank writes. A piece stored as one shard has one writer per rank (the
    rank's own piece's); where the planner stores a piece as several shards, each written by
    another replica, every piece's shards are counted once, from the first rank holding it."""
    loads = np.zeros(mesh.size, dtype=np.int64)
    everyone = np.arange(mesh.size)
    shards = _plan.stored_shards(arrays, mesh)
    for a, writers, shard in zip(arrays, _plan.assign_writers(arrays, mesh), shards):
        if writers.ndim == 1:
            writes = writers == everyone
            loads[writes] += box_bytes(a, mesh)[writes]
            continue
        # Rows of one piece are equal (its shards' writers); the pieces' replica sets are disjoint.
        _, first = np.unique(writers, axis=0, return_index=True)
        for rank in first.tolist():
            box = _plan.shard_box(a.shape, a.spec, mesh, rank, a.piece)
            for writer, part in zip(writers[rank].tolist(), _plan.shard_pieces(box, shard)):
                if writer >= 0:
                    loads[writer] += _plan.box_size(part) * a.itemsize
    return loads


def exchange(pipe: Pipeline, ranks: list[int]) -> dict[str, Any]:
    """What the stage exchange costs one rank: the bytes it receives (every speaker's document,
    after one all-reduce of their lengths, an int64 each), and the merge (``Pipeline.merge``),
    timed and measured as the plan is."""
    sizes = [len(doc) for doc in pipe.told]
    r: dict[str, Any] = {
        "exchange_documents": len(sizes),
        "exchange_document_bytes": (min(sizes), max(sizes)),
        "exchange_received_bytes": sum(sizes),
        "exchange_lengths_bytes": 8 * len(sizes),
    }
    timings = [measure(pipe.merge(rank)) for rank in ranks]
    r["merge_seconds"] = statistics.median(t for t, _, _ in timings)
    r["merge_tracemalloc_peak"] = max(p for _, p, _ in timings)
    r["merge_rss_growth"] = max(g for _, _, g in timings)
    held = [len(flatten(pipe.state(rank))[1]) for rank in ranks]
    r["rank_arrays"] = (min(held), max(held))
    return r


def sample_ranks(world: int, n: int) -> list[int]:
    return sorted({round(i * (world - 1) / max(1, n - 1)) for i in range(n)})


def run(s: Scenario, repeats: int, loop_sample: int) -> dict[str, Any]:
    save_mesh, load_mesh = s.save.mesh, s.load.mesh
    world = save_mesh.size
    r: dict[str, Any] = {"scenario": s.name, "save_mesh": repr(save_mesh), "load_mesh": repr(load_mesh)}
    r["arrays"] = len(s.leaves)
    r["parameters"] = sum(math.prod(leaf.shape) for leaf in s.leaves if leaf.name.startswith("model."))
    r["state_bytes"] = sum(math.prod(leaf.shape) * leaf.itemsize for leaf in s.leaves)
    pipe = Pipeline(s) if s.stages else None
    if pipe is not None:
        save_of: Callable[[int], tuple[CheckpointMeta, list[tuple[int, _plan.Box]]]] = pipe.save
        held_of: Callable[[int], list[str] | None] = pipe.load_names
    else:
        got = collectives(s)

        def save_of(rank: int) -> tuple[CheckpointMeta, list[tuple[int, _plan.Box]]]:
            return save_plan(s, got, rank)

        def held_of(rank: int) -> list[str] | None:
            return None

    # (a) one rank's save plan, over several ranks, each from a cold cache.
    ranks = sample_ranks(world, repeats)
    timings = []
    for rank in ranks:
        seconds, peak, grown = measure(lambda rank=rank: save_of(rank))
        timings.append((seconds, peak, grown))
    r["save_seconds"] = statistics.median(t for t, _, _ in timings)
    r["save_seconds_max"] = max(t for t, _, _ in timings)
    r["save_tracemalloc_peak"] = max(p for _, p, _ in timings)
    r["save_rss_growth"] = max(g for _, _, g in timings)
    meta, mine = save_of(ranks[0])
    arrays = {name: a for name, a in meta.arrays.items()}
    r["save_writes_one_rank"] = len(mine)
    if pipe is not None:
        r.update(exchange(pipe, ranks))

    # (b) one rank's load plan on the other mesh, and opening.
    raw = root_document(meta)
    t0 = time.perf_counter()
    opened = parse_root_document(raw, "bench")
    r["open_seconds"] = time.perf_counter() - t0
    load_ranks = sample_ranks(load_mesh.size, repeats)
    held = {rank: held_of(rank) for rank in load_ranks}
    timings = [measure(lambda rank=rank: load_plan(opened, s.load, rank, held[rank])) for rank in load_ranks]
    r["load_seconds"] = statistics.median(t for t, _, _ in timings)
    r["load_tracemalloc_peak"] = max(p for _, p, _ in timings)
    r["load_rss_growth"] = max(g for _, _, g in timings)
    reads = load_plan(opened, s.load, load_ranks[0], held[load_ranks[0]])
    r["load_shards_touched"] = sum(shards for *_, shards, _ in reads)
    r["load_inner_chunks_touched"] = sum(inner for *_, inner in reads)
    r["load_bytes"] = sum(_plan.box_size(box) * arrays[n].itemsize for n, box, *_ in reads)

    # (c) all ranks: a cluster runs world independent plans; one process can share the global
    # writer assignment between ranks (it is the same for all).
    r["all_ranks_cluster_cpu_seconds"] = world * r["save_seconds"]
    # A pipeline rank's plan is mostly its own (its state, the exchange's merge): fewer are sampled.
    sample = loop_sample if pipe is None else min(loop_sample, PIPELINE_LOOP_SAMPLE)
    loop = list(range(world)) if world <= sample else sample_ranks(world, sample)
    if pipe is not None:
        for rank in loop:
            pipe.state(rank)  # each rank's state exists before its save
    forget_writers()
    t0 = time.perf_counter()
    save_of(loop[0])
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for rank in loop[1:]:
        save_of(rank)
    rest = (time.perf_counter() - t0) / max(1, len(loop) - 1)
    r["all_ranks_one_process_seconds"] = first + (world - 1) * rest
    r["all_ranks_extrapolated"] = len(loop) < world

    # Balance of the writes over ranks (bytes each rank writes).
    if pipe is not None:
        plan_arrays = pipe.plan_arrays()
    else:
        plan_arrays = [_plan.ArraySpec(n, a.shape, a.spec, a.itemsize) for n, a in arrays.items()]
    loads = write_loads(plan_arrays, save_mesh)
    r["write_bytes_max"], r["write_bytes_mean"] = int(loads.max()), float(loads.mean())
    r["writers"] = int(np.count_nonzero(loads))
    forget_writers()

    # (d) stored objects.
    shards = sum(
        math.prod(-(-n // c) for n, c in zip(a.shape, a.shard_shape)) for a in arrays.values() if 0 not in a.shape
    )
    inner = sum(
        math.prod(-(-n // c) for n, c in zip(a.shape, a.inner_chunk_shape)) for a in arrays.values() if 0 not in a.shape
    )
    groups = {"/".join(a.path.split("/")[:i]) for a in arrays.values() for i in range(1, a.path.count("/") + 1)}
    r["shard_files"], r["inner_chunks"] = shards, inner
    r["zarr_json_documents"] = len(arrays) + len(groups) + 1
    r["stored_objects"] = shards + r["zarr_json_documents"]
    # Packed (``packing="ocdbt"``, what "auto" picks above 1,000 objects): a writing rank's
    # data files (one per writing thread, a new one past ``pack_bytes``; at most this many) and
    # its manifest, and the root database's manifest.
    threads, pack = PACK_THREADS, IOConfig().pack_bytes
    data_files = np.where(loads > 0, threads * np.ceil(loads / (threads * pack)), 0)
    r["packed_files_per_rank_max"] = int(data_files.max())
    r["packed_files"] = int(data_files.sum() + np.count_nonzero(loads)) + 1

    # (e) metadata.
    per_array = [len(json.dumps(a.zarr_metadata()).encode()) for a in arrays.values()]
    r["root_document_bytes"] = len(raw)
    r["root_document_compact_bytes"] = len(json.dumps(json.loads(raw), separators=(",", ":")).encode())
    r["array_document_bytes"] = (min(per_array), max(per_array), sum(per_array))
    return r


# ----------------------------------------------------------------------------- report


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", MB), ("KiB", KB)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,.0f} B"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms"


def _check(value: str, target: str, ok: bool) -> tuple[str, str, str]:
    return value, target, "PASS" if ok else "MISS"


def misses(r: dict[str, Any]) -> list[str]:
    """The targets this scenario missed: one rank's plan in under 1 s and 200 MiB."""
    out = [k for k in ("save_seconds_max", "load_seconds") if r[k] >= TARGET_SECONDS]
    memory = ("save_tracemalloc_peak", "save_rss_growth", "load_tracemalloc_peak", "load_rss_growth")
    return out + [k for k in memory if r[k] >= TARGET_BYTES]


def table(r: dict[str, Any]) -> str:
    lo, hi, total = r["array_document_bytes"]
    extrapolated = " (extrapolated)" if r["all_ranks_extrapolated"] else ""
    compact = ""
    if r["root_document_compact_bytes"] < r["root_document_bytes"]:
        compact = f" ({_bytes(r['root_document_compact_bytes'])} as compact JSON)"
    rows = [
        ("arrays (3 per parameter)", f"{r['arrays']:,}", "", ""),
        ("parameters / state", f"{r['parameters'] / 1e9:.1f} B / {r['state_bytes'] / 1e9:.0f} GB", "", ""),
        (
            "save plan, one rank: time (median, max)",
            *_check(
                f"{_ms(r['save_seconds'])}, {_ms(r['save_seconds_max'])}",
                "< 1 s",
                r["save_seconds_max"] < TARGET_SECONDS,
            ),
        ),
        (
            "save plan, one rank: tracemalloc peak / RSS growth",
            *_check(
                f"{_bytes(r['save_tracemalloc_peak'])} / {_bytes(r['save_rss_growth'])}",
                "< 200 MiB",
                max(r["save_tracemalloc_peak"], r["save_rss_growth"]) < TARGET_BYTES,
            ),
        ),
        ("load plan, one rank: time", *_check(_ms(r["load_seconds"]), "< 1 s", r["load_seconds"] < TARGET_SECONDS)),
        (
            "load plan, one rank: tracemalloc peak / RSS growth",
            *_check(
                f"{_bytes(r['load_tracemalloc_peak'])} / {_bytes(r['load_rss_growth'])}",
                "< 200 MiB",
                max(r["load_tracemalloc_peak"], r["load_rss_growth"]) < TARGET_BYTES,
            ),
        ),
        (
            "open: reads / root document / parse",
            *_check(
                f"1 read / {_bytes(r['root_document_bytes'])}{compact} / {_ms(r['open_seconds'])}",
                f"1 read of {r['root_document_bytes'] / KB:,.0f} KiB",
                True,
            ),
        ),
        ("per-array zarr.json: min / max / total", f"{lo:,} B / {hi:,} B / {_bytes(total)}", "not read to open", ""),
        ("shards one rank writes", f"{r['save_writes_one_rank']:,}", "", ""),
        (
            "one rank reads (load)",
            f"{r['load_shards_touched']:,} shards, {r['load_inner_chunks_touched']:,} inner chunks, "
            f"{_bytes(r['load_bytes'])}",
            "",
            "",
        ),
        (
            "bytes written per rank: max / mean (ranks that write)",
            f"{_bytes(r['write_bytes_max'])} / {_bytes(r['write_bytes_mean'])} ({r['writers']:,})",
            "",
            "",
        ),
        ("all ranks: cluster CPU (world x one rank)", f"{r['all_ranks_cluster_cpu_seconds']:,.1f} s", "", ""),
        (
            f"all ranks: one process, assignment shared{extrapolated}",
            f"{r['all_ranks_one_process_seconds']:,.1f} s",
            "",
            "",
        ),
        ("stored objects: shard files + zarr.json", f"{r['shard_files']:,} + {r['zarr_json_documents']:,}", "", ""),
        (
            "packed: files, most data files per rank",
            f"{r['packed_files']:,}, {r['packed_files_per_rank_max']}",
            "a few per rank",
            "PASS" if r["packed_files_per_rank_max"] <= 4 else "MISS",
        ),
        ("inner chunks", f"{r['inner_chunks']:,}", "", ""),
    ]
    if "exchange_documents" in r:
        lo_doc, hi_doc = r["exchange_document_bytes"]
        lo_held, hi_held = r["rank_arrays"]
        rows[2:2] = [
            ("arrays one rank holds (its stage's, local names)", f"{lo_held:,} to {hi_held:,}", "", ""),
            (
                "stage exchange, bytes each rank receives",
                f"{_bytes(r['exchange_received_bytes'])}: {r['exchange_documents']} documents of "
                f"{_bytes(lo_doc)} to {_bytes(hi_doc)}, after a {r['exchange_lengths_bytes']} B all-reduce",
                "",
                "",
            ),
            (
                "stage exchange merge, one rank: time / tracemalloc peak / RSS growth",
                f"{_ms(r['merge_seconds'])} / {_bytes(r['merge_tracemalloc_peak'])} / {_bytes(r['merge_rss_growth'])}",
                "in the save plan",
                "",
            ),
        ]
    out = [
        f"### {r['scenario']}: save on {r['save_mesh']}, load on {r['load_mesh']}",
        "",
        "| metric | value | target | |",
        "| --- | --- | --- | --- |",
    ]
    return "\n".join(out + [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows])


def summary(results: list[dict[str, Any]]) -> str:
    out = [
        "| scenario | arrays | save plan, one rank | load plan, one rank | stored objects | root document | |",
        "| --- | ---: | --- | --- | ---: | ---: | --- |",
    ]
    for r in results:
        save = f"{_ms(r['save_seconds'])}, {_bytes(max(r['save_tracemalloc_peak'], r['save_rss_growth']))}"
        load = f"{_ms(r['load_seconds'])}, {_bytes(max(r['load_tracemalloc_peak'], r['load_rss_growth']))}"
        objects = r["shard_files"] + r["zarr_json_documents"]
        verdict = "PASS" if not misses(r) else "MISS"
        out.append(
            f"| {r['scenario']} | {r['arrays']:,} | {save} | {load} | {objects:,} | {_bytes(r['root_document_bytes'])} "
            f"| {verdict} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="64-rank meshes instead of 16,384")
    parser.add_argument("--scenario", action="append", choices=SCENARIOS, help="repeatable; default: all")
    parser.add_argument("--repeats", type=int, default=3, help="ranks timed for one rank's plan (median)")
    parser.add_argument("--loop-sample", type=int, default=64, help="ranks timed in the all-ranks loop, then scaled")
    parser.add_argument("--json", help="write every number to this file")
    args = parser.parse_args(argv)
    results = []
    for s in scenarios(args.quick):
        if args.scenario and s.name not in args.scenario:
            continue
        results.append(run(s, args.repeats, args.loop_sample))
        print(table(results[-1]), "\n", flush=True)
    print(summary(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    missed = {r["scenario"]: misses(r) for r in results if misses(r)}
    print(f"\ntargets missed: {missed}" if missed else "\none rank's plan is within the targets in every scenario")
    return 0


if __name__ == "__main__":
    sys.exit(main())
