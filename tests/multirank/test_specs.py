"""The layout files under ``specs/``: they parse, map Llama names as documented, and round-trip.

Each rank's local shards are cut here with ``torch.chunk`` from a deterministic global state (not
with the library's planner), saved under the spec file's layout, and must come back bit for bit:
under the same layout, under the other spec files on other meshes, and whole in one process.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

import layoutckpt as lc
from layoutckpt.layout._layout import parse_spec
from layoutckpt.layout._names import to_global
from tests.support.oracle import local_shard as oracle_shard
from tests.support.paths import SPECS

P = lc.P

VOCAB, HIDDEN, FFN, KV, LAYERS, ROPE = 11, 8, 12, 4, 2, 4

# ---------------------------------------------------------------------------------------------
# A tiny Llama-like state: Hugging Face names, bf16 parameters with q/k/v biases (Qwen-style),
# fp32 Adam moments as a parallel tree under optim.exp_avg, a 0-d optimizer step, JSON leaves.


def _values(shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    n = math.prod(shape)
    return ((torch.arange(n, dtype=torch.float64) % 61 - 30) * 0.125 + seed).reshape(shape).to(dtype)


def _params(dtype: torch.dtype, seed: int) -> dict[str, Any]:
    counter = iter(range(seed, seed + 1000))

    def t(*shape: int) -> torch.Tensor:
        return _values(shape, next(counter), dtype)

    def layer() -> dict[str, Any]:
        return {
            "self_attn": {
                "q_proj": {"weight": t(HIDDEN, HIDDEN), "bias": t(HIDDEN)},
                "k_proj": {"weight": t(KV, HIDDEN), "bias": t(KV)},
                "v_proj": {"weight": t(KV, HIDDEN), "bias": t(KV)},
                "o_proj": {"weight": t(HIDDEN, HIDDEN)},
            },
            "mlp": {
                "gate_proj": {"weight": t(FFN, HIDDEN)},
                "up_proj": {"weight": t(FFN, HIDDEN)},
                "down_proj": {"weight": t(HIDDEN, FFN)},
            },
            "input_layernorm": {"weight": t(HIDDEN)},
            "post_attention_layernorm": {"weight": t(HIDDEN)},
        }

    return {
        "model": {
            "embed_tokens": {"weight": t(VOCAB, HIDDEN)},
            "layers": [layer() for _ in range(LAYERS)],
            "norm": {"weight": t(HIDDEN)},
        },
        "lm_head": {"weight": t(VOCAB, HIDDEN)},
    }


def llama_state() -> dict[str, Any]:
    state = _params(torch.bfloat16, 0)
    state["model"]["rotary_emb"] = {"inv_freq": 1 / 10000 ** (torch.arange(ROPE, dtype=torch.float32) / ROPE)}
    state["optim"] = {"exp_avg": _params(torch.float32, 500), "step": torch.tensor(41, dtype=torch.int64)}
    state["train"] = {"tokens_seen": 123456, "loader": {"epoch": 1, "shard": "part-3"}}
    return state


def flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{dotted name: leaf}, written here independently of the library's flatten."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else None
    if items is None:
        return {prefix: tree}
    out: dict[str, Any] = {}
    for k, v in items:
        out.update(flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def local_shard(full: torch.Tensor, spec: lc.P, axes: dict[str, int], rank: int) -> torch.Tensor:
    return oracle_shard(full, spec, axes, rank).clone()


def cut(tree: Any, layout: lc.Layout, axes: dict[str, int], rank: int, prefix: str = "") -> Any:
    if isinstance(tree, dict):
        return {k: cut(v, layout, axes, rank, f"{prefix}.{k}" if prefix else k) for k, v in tree.items()}
    if isinstance(tree, list):
        return [cut(v, layout, axes, rank, f"{prefix}.{i}") for i, v in enumerate(tree)]
    if isinstance(tree, torch.Tensor):
        return local_shard(tree, layout.spec_for(prefix), axes, rank)
    return tree


def assert_same(got: Any, want: Any) -> None:
    """Same tree, same JSON leaves, tensors of the same dtype and shape with the same bits."""
    got_flat, want_flat = flat(got), flat(want)
    assert list(got_flat) == list(want_flat)
    for name, w in want_flat.items():
        g = got_flat[name]
        if isinstance(w, torch.Tensor):
            assert isinstance(g, torch.Tensor) and g.dtype == w.dtype and g.shape == w.shape, (name, g, w)
            width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[w.element_size()]
            assert torch.equal(g.contiguous().view(width), w.contiguous().view(width)), name
        else:
            assert type(g) is type(w) and g == w, (name, g, w)


def layout_for(spec_file: str, axes: dict[str, int]) -> lc.Layout:
    return lc.Layout.from_file(SPECS / spec_file, lc.Mesh(axes))


# ---------------------------------------------------------------------------------------------
# Parsing and the name -> spec mapping each file documents.

COL, ROW, VOCAB_SPLIT, REPL, DP = P("tp", None), P(None, "tp"), P("tp", None), P(), P("dp")
FSDP_COL, FSDP_ROW = P(("tp", "dp"), None), P("dp", "tp")

# spec file -> the mesh axes used to parse it
MESHES = {
    "dp_replicated.toml": {"dp": 4},
    "fsdp.toml": {"dp": 4},
    "llama_tp.toml": {"tp": 4},
    "llama_dp_tp.toml": {"dp": 2, "tp": 4},
}

# name -> its spec under dp_replicated.toml, fsdp.toml, llama_tp.toml, llama_dp_tp.toml
EXPECTED = {
    "model.embed_tokens.weight": (REPL, DP, VOCAB_SPLIT, FSDP_COL),
    "model.layers.0.self_attn.q_proj.weight": (REPL, DP, COL, FSDP_COL),
    "model.layers.0.self_attn.k_proj.weight": (REPL, DP, COL, FSDP_COL),
    "model.layers.0.self_attn.v_proj.weight": (REPL, DP, COL, FSDP_COL),
    "model.layers.0.self_attn.q_proj.bias": (REPL, DP, P("tp"), P(("tp", "dp"))),
    "model.layers.0.self_attn.o_proj.weight": (REPL, DP, ROW, FSDP_ROW),
    "model.layers.0.self_attn.o_proj.bias": (REPL, DP, REPL, DP),
    "model.layers.17.mlp.gate_proj.weight": (REPL, DP, COL, FSDP_COL),
    "model.layers.17.mlp.up_proj.weight": (REPL, DP, COL, FSDP_COL),
    "model.layers.17.mlp.down_proj.weight": (REPL, DP, ROW, FSDP_ROW),
    "model.layers.17.mlp.down_proj.bias": (REPL, DP, REPL, DP),
    "model.layers.0.input_layernorm.weight": (REPL, DP, REPL, DP),
    "model.layers.0.post_attention_layernorm.weight": (REPL, DP, REPL, DP),
    "model.norm.weight": (REPL, DP, REPL, DP),
    "lm_head.weight": (REPL, DP, VOCAB_SPLIT, FSDP_COL),
    "model.rotary_emb.inv_freq": (REPL, DP, REPL, REPL),
    "optim.exp_avg.model.layers.3.self_attn.q_proj.weight": (REPL, DP, COL, FSDP_COL),
    "optim.exp_avg.model.layers.3.mlp.down_proj.weight": (REPL, DP, ROW, FSDP_ROW),
    "optim.exp_avg.lm_head.weight": (REPL, DP, VOCAB_SPLIT, FSDP_COL),
    # lc.get_state keys moments per parameter: they take their parameter's spec too.
    "optim.state.model.layers.3.self_attn.q_proj.weight.exp_avg": (REPL, DP, COL, FSDP_COL),
    "optim.state.model.layers.3.mlp.down_proj.weight.exp_avg_sq": (REPL, DP, ROW, FSDP_ROW),
    "optim.state.model.embed_tokens.weight.exp_avg": (REPL, DP, VOCAB_SPLIT, FSDP_COL),
    "optim.step": (REPL, REPL, REPL, REPL),
}


def test_every_spec_file_is_covered():
    assert sorted(p.name for p in SPECS.glob("*.toml")) == sorted([*MESHES, "megatron_gpt.toml"])


def test_megatron_spec_file_declares_the_model_in_its_comments():
    """megatron_gpt.toml: its mesh, global names and the fused and padded pieces of the sizes it states."""
    layout = lc.Layout.from_file(SPECS / "megatron_gpt.toml")
    assert layout.mesh == lc.Mesh({"pp": 4, "ep": 2, "tp": 2}) and layout.stage_axes == ("pp", "ep")
    for _, spec in layout.rules:
        assert parse_spec(repr(spec)) == spec
    coords = {"pp": 3, "ep": 1, "tp": 1}  # the last stage, second expert-parallel rank
    local = [
        "decoder.layers.7.self_attention.linear_qkv.weight",
        "decoder.layers.7.mlp.experts.local_experts.3.linear_fc1.weight",
        "optim.exp_avg.decoder.layers.0.mlp.router.weight",
        "output_layer.weight",
    ]
    assert list(to_global(layout.names, local, coords).values()) == [
        "decoder.layers.31.self_attention.linear_qkv.weight",
        "decoder.layers.31.mlp.experts.local_experts.7.linear_fc1.weight",
        "optim.exp_avg.decoder.layers.24.mlp.router.weight",
        "output_layer.weight",
    ]
    # linear_qkv at tp=2: 4 of the 8 query groups, (4 + 2) * 128 rows each.
    qkv = layout.spec_for("decoder.layers.31.self_attention.linear_qkv.weight")
    cuts = qkv.cuts("decoder.layers.31.self_attention.linear_qkv.weight", (3072, 4096), layout.mesh, coords)
    assert [(n.split(".")[-2], c.groups * c.width) for n, c in cuts] == [("q", 2048), ("k", 512), ("v", 512)]
    for name in (
        "decoder.layers.0.mlp.linear_fc1.weight",
        "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight",
    ):
        cuts = layout.spec_for(name).cuts(name, (14336, 4096), layout.mesh, coords)
        assert [(n.split(".")[-2], c.width) for n, c in cuts] == [("gate", 7168), ("up", 7168)]
    # 50257 rows padded to a multiple of 128 * tp: 25216 per rank; the last rank's tail is padding.
    cut, start, rows = layout.spec_for("output_layer.weight").cut(
        "output_layer.weight", (25216, 4096), layout.mesh, coords
    )
    assert (start, cut.width, rows) == (25216, 50257 - 25216, 25216)
    assert layout.spec_for("decoder.layers.3.self_attention.linear_proj.weight") == P(None, "tp")
    assert layout.spec_for("decoder.layers.3.mlp.experts.local_experts.5.linear_fc2.weight") == P(None, "tp")
    assert layout.spec_for("decoder.final_layernorm.weight") == P()


@pytest.mark.parametrize("spec_file", list(MESHES))
def test_spec_file_maps_llama_names(spec_file):
    axes = MESHES[spec_file]
    layout = layout_for(spec_file, axes)
    assert layout.mesh == lc.Mesh(axes)
    column = list(MESHES).index(spec_file)
    assert {n: layout.spec_for(n) for n in EXPECTED} == {n: specs[column] for n, specs in EXPECTED.items()}
    # The last rule is a catch-all, so no name of a state is left without a spec.
    assert layout.rules[-1][0] == ".*"
    # Every spec in the file is one parse_spec accepts and prints back the same way.
    for _, spec in layout.rules:
        assert parse_spec(repr(spec)) == spec


@pytest.mark.parametrize("spec_file", list(MESHES))
def test_spec_file_covers_the_llama_state(spec_file):
    """Every array of the example state gets a spec that fits its rank (0-d step included)."""
    layout = layout_for(spec_file, MESHES[spec_file])
    for name, leaf in flat(llama_state()).items():
        if isinstance(leaf, torch.Tensor):
            assert len(layout.spec_for(name)) <= leaf.ndim, name


def test_mesh_checks():
    with pytest.raises(lc.LayoutError, match="axes"):
        layout_for("dp_replicated.toml", {"tp": 2})
    with pytest.raises(lc.LayoutError, match="'tp'"):
        layout_for("llama_tp.toml", {"dp": 2})
    with pytest.raises(lc.LayoutError, match="no \\[mesh\\] table"):
        lc.Layout.from_file(SPECS / "llama_tp.toml")
    # A mesh axis the rules do not name holds replicas: DDP x TP with the TP file.
    assert layout_for("llama_tp.toml", {"dp": 2, "tp": 2}).spec_for("lm_head.weight") == VOCAB_SPLIT


# ---------------------------------------------------------------------------------------------
# Round trips: one process on meshes of size 1.

SINGLE = {
    "dp_replicated.toml": {"dp": 1},
    "fsdp.toml": {"dp": 1},
    "llama_tp.toml": {"tp": 1},
    "llama_dp_tp.toml": {"dp": 1, "tp": 1},
}


@pytest.mark.parametrize("spec_file", sorted(SINGLE))
def test_single_process_round_trip(spec_file, tmp_path):
    layout = layout_for(spec_file, SINGLE[spec_file])
    state = llama_state()
    lc.save(tmp_path / "ck", state, layout, step=5, inner_chunk_bytes=64)
    assert_same(lc.load(tmp_path / "ck", layout), state)
    assert_same(lc.load(tmp_path / "ck"), state)
    rd = lc.open(tmp_path / "ck")
    for name in rd.keys():
        assert rd.info(name).spec == layout.spec_for(name)


# ---------------------------------------------------------------------------------------------
# Round trips on 2-4 gloo ranks, and loads of one spec's checkpoint under another.


def _save_and_reload(rank, group, spec_file, axes, path):
    layout = layout_for(spec_file, axes)
    local = cut(llama_state(), layout, axes, rank)
    result = lc.save(path, local, layout, group=group, step=9, metadata={"spec": spec_file}, inner_chunk_bytes=64)
    assert_same(lc.load(path, layout, group=group), local)
    return result.bytes_written


def _load_as(rank, group, spec_file, axes, path):
    layout = layout_for(spec_file, axes)
    assert_same(lc.load(path, layout, group=group), cut(llama_state(), layout, axes, rank))
    return True


def _array_bytes(state: Any) -> int:
    return sum(v.numel() * v.element_size() for v in flat(state).values() if isinstance(v, torch.Tensor))


def _check_saved(path: Path, spec_file: str, axes: dict[str, int]) -> None:
    """The checkpoint holds the global state whole, with the specs and mesh of the file."""
    assert_same(lc.load(path), llama_state())
    rd = lc.open(path)
    assert rd.step == 9 and rd.metadata == {"spec": spec_file}
    layout = layout_for(spec_file, axes)
    for name in rd.keys():
        info = rd.info(name)
        assert info.spec == layout.spec_for(name) and info.saved_mesh == lc.Mesh(axes)


MULTI = [
    ("dp_replicated.toml", {"dp": 2}),
    ("fsdp.toml", {"dp": 3}),
    ("llama_tp.toml", {"tp": 4}),
    ("llama_tp.toml", {"dp": 2, "tp": 2}),
    ("llama_dp_tp.toml", {"dp": 2, "tp": 2}),
]


@pytest.mark.parametrize(("spec_file", "axes"), MULTI, ids=[f"{f}-{'x'.join(map(str, a.values()))}" for f, a in MULTI])
def test_multi_rank_round_trip(ranks, tmp_path, spec_file, axes):
    path = str(tmp_path / "ck")
    k = math.prod(axes.values())
    written = ranks.run(_save_and_reload, k, spec_file, axes, path)
    # Every byte of the global state is written exactly once, whatever the replication.
    assert sum(written) == _array_bytes(llama_state())
    _check_saved(Path(path), spec_file, axes)


def test_resume_under_other_specs(ranks, tmp_path):
    """Saved by FSDP x TP on 4 ranks; resumed by TP on 3, by FSDP on 2, by DDP on 4, and back."""
    path = str(tmp_path / "dp_tp")
    ranks.run(_save_and_reload, 4, "llama_dp_tp.toml", {"dp": 2, "tp": 2}, path)
    assert ranks.run(_load_as, 3, "llama_tp.toml", {"tp": 3}, path) == [True] * 3
    assert ranks.run(_load_as, 2, "fsdp.toml", {"dp": 2}, path) == [True] * 2
    assert ranks.run(_load_as, 4, "dp_replicated.toml", {"dp": 4}, path) == [True] * 4
    other = str(tmp_path / "tp")
    ranks.run(_save_and_reload, 3, "llama_tp.toml", {"tp": 3}, other)
    assert ranks.run(_load_as, 4, "llama_dp_tp.toml", {"dp": 2, "tp": 2}, other) == [True] * 4
    assert ranks.run(_load_as, 4, "llama_dp_tp.toml", {"dp": 1, "tp": 4}, other) == [True] * 4
