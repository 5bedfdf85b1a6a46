"""End to end: a Megatron-style GPT saved at PP=2 x TP=2, resumed under other parallelisms.

The model (``tests/support/megatron.py``) is written here in plain torch with manual tensor and
pipeline parallelism: stage-local layer names (``decoder.layers.0..1`` on both stages), a fused
GQA ``linear_qkv`` (8 query heads in 4 groups, head_dim * heads != hidden), a fused SwiGLU
``linear_fc1 = [gate; up]``, row-parallel projections, and a vocabulary of 70 padded to a multiple
of 8 * tp (72, 80 or 96 rows) on an embedding and an untied output layer, both vocab-parallel.

Every rank's tensors are derived from one set of global, unfused, unpadded weights (Hugging-Face
names), so a single-process reference gives the expected logits. The padding rows are saved with
a non-zero value: they must not reach the checkpoint, and come back as zeros.

A checkpoint saved by 4 gloo ranks at PP=2 x TP=2 is loaded at PP=1 x TP=4 and PP=4 x TP=1 (4
ranks), at TP=1 in one plain process, and into an unfused Hugging-Face-named model (separate
q/k/v and gate/up projections, ``lc.Rename`` rules): parameters bit-equal to the ones derived for
that parallelism, logits on a fixed batch equal the reference's. Bad declarations (fused part
sizes that do not add up, a padding smaller than the vocabulary, a renumbering that maps two
local names onto one global) are refused with ``LayoutError`` on every rank, before anything is
written; so is a load that splits 2 query groups over 4 tp ranks (replicated KV heads). At
PP=1 x DP=2 x TP=2 with ``share_reads=True``, the data-parallel replicas split the reads of
their fused and padded tensors and end bit-equal.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import layoutckpt as lc
from layoutckpt.storage import _shardread
from tests.support import megatron
from tests.support.multirank import RankPool
from tests.support.oracle import leaves

CFG = megatron.Config()
SEED = 0
PAD = -7.0  # what the saving run keeps in its padding rows; a load fills them with 0
TOL = {"rtol": 1e-5, "atol": 1e-5}  # tp changes how partial sums are reduced: last bits only
QKV = r"\.self_attention\.linear_qkv\.weight$"
FC1 = r"\.mlp\.linear_fc1\.weight$"
VOCAB = r"^(embedding\.word_embeddings|output_layer)\.weight$"


def layout(
    pp: int,
    tp: int,
    *,
    cfg: megatron.Config = CFG,
    per: int | None = None,
    fc1_sizes: tuple[int, int] | None = None,
    vocab: int | None = None,
    dp: int = 1,
) -> lc.Layout:
    """The Megatron layout at PP=pp x TP=tp (x DP=dp replicas); the other keywords spoil one
    declaration for the refusals."""
    qkv = lc.Fused(
        lc.P("tp", None),
        [("q", cfg.q_per_group * cfg.head_dim), ("k", cfg.head_dim), ("v", cfg.head_dim)],
        groups=cfg.groups,
    )
    gate, up = fc1_sizes or (cfg.ffn, cfg.ffn)
    rules = [
        (QKV, qkv),
        (FC1, lc.Fused(lc.P("tp", None), [("gate", gate), ("up", up)])),
        (VOCAB, lc.Padded(lc.P("tp", None), size=vocab or cfg.vocab)),
        (r"\.(linear_proj|linear_fc2)\.weight$", lc.P(None, "tp")),
        (r".*", lc.P()),
    ]
    names = [lc.Renumber(r"^decoder\.layers\.(\d+)\.", axis="pp", per=per or cfg.layers // pp)]
    axes = {"pp": pp, "tp": tp} if dp == 1 else {"pp": pp, "dp": dp, "tp": tp}
    return lc.Layout(lc.Mesh(axes), rules, names=names)


def hf_layout() -> lc.Layout:
    """One plain process holding the unfused model under Hugging-Face names."""
    names = [lc.Rename(pattern, repl) for pattern, repl in megatron.HF_TO_MEGATRON]
    return lc.Layout(lc.Mesh({}), [(r".*", lc.P())], names=names)


def _clone(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state.items()}


# --- tasks on the pool's ranks: rank r is stage r // tp, tp rank r % tp ---------------------------


def _forward(rank: int, group: Any, pp: int, tp: int) -> torch.Tensor | None:
    """No checkpoint: the parallel model built from the global weights, one forward."""
    w = megatron.global_weights(CFG, SEED)
    model = megatron.build_stage(w, CFG, pp, tp, rank // tp, rank % tp, pad_value=PAD)
    return megatron.pipeline_logits(model, rank, group, megatron.tokens(CFG))


def _save(rank: int, group: Any, path: str, pp: int, tp: int) -> torch.Tensor | None:
    w = megatron.global_weights(CFG, SEED)
    model = megatron.build_stage(w, CFG, pp, tp, rank // tp, rank % tp, pad_value=PAD)
    logits = megatron.pipeline_logits(model, rank, group, megatron.tokens(CFG))
    lc.save(path, model.state_dict(), layout(pp, tp), group=group)
    return logits


def _load(rank: int, group: Any, path: str, pp: int, tp: int) -> dict[str, Any]:
    """Into a model of another seed, in place; and from a meta template, as new tensors."""
    stage = rank // tp
    model = megatron.build_stage(megatron.global_weights(CFG, SEED + 1), CFG, pp, tp, stage, rank % tp, pad_value=PAD)
    target = model.state_dict()
    filled = lc.load(path, layout(pp, tp), like=target, inplace=True, group=group)
    same_objects = sorted(filled) == sorted(target) and all(filled[k] is target[k] for k in target)
    meta = megatron.Stage(CFG, pp, tp, stage, device="meta").state_dict()
    fresh = lc.load(path, layout(pp, tp), like=meta, group=group)
    return {
        "inplace": _clone(model.state_dict()),
        "same_objects": same_objects,
        "from_meta": _clone(fresh),
        "logits": megatron.pipeline_logits(model, rank, group, megatron.tokens(CFG)),
    }


def _refused(rank: int, group: Any, path: str, case: str) -> tuple[bool, str, str]:
    """A save at PP=2 x TP=2 under a spoiled declaration: (is a LayoutError, type, message)."""
    pp, tp = 2, 2
    model = megatron.build_stage(megatron.global_weights(CFG, SEED), CFG, pp, tp, rank // tp, rank % tp)
    bad = {
        # gate + up = 24 + 12 rows, 18 per rank, but each rank's linear_fc1 has 24
        "fused_sizes": lambda: layout(pp, tp, fc1_sizes=(CFG.ffn, CFG.ffn // 2)),
        # 81 logical rows, but tp * rows per rank = 80
        "padding": lambda: layout(pp, tp, vocab=CFG.padded_vocab(tp) + 1),
        # each stage holds layers 0 and 1: with per=1, local 1 on stage 0 and local 0 on stage 1
        # would both be global layer 1
        "renumber": lambda: layout(pp, tp, per=1),
    }[case]
    try:
        lc.save(path, model.state_dict(), bad(), group=group)
    except Exception as err:  # noqa: BLE001 - sent back for the test to check its type
        return isinstance(err, lc.LayoutError), type(err).__name__, str(err)
    return False, "", "saved"


def _refused_load(rank: int, group: Any, path: str, cfg: megatron.Config) -> tuple[bool, str, str]:
    try:
        meta = megatron.Stage(cfg, 1, 4, 0, device="meta").state_dict()
    except Exception as err:  # noqa: BLE001
        return False, type(err).__name__, f"the model itself cannot be built: {err}"
    try:
        lc.load(path, layout(1, 4, cfg=cfg), like=meta, group=group)
    except Exception as err:  # noqa: BLE001 - sent back for the test to check its type
        return isinstance(err, lc.LayoutError), type(err).__name__, str(err)
    return False, "", "loaded"


# --- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return megatron.global_weights(CFG, SEED)


@pytest.fixture(scope="module")
def reference(weights: dict[str, torch.Tensor]) -> torch.Tensor:
    return megatron.reference_logits(weights, megatron.tokens(CFG), CFG)


@pytest.fixture(scope="module")
def saved(ranks: RankPool, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    path = tmp_path_factory.mktemp("megatron") / "pp2-tp2"
    return path, ranks.run(_save, 4, os.fspath(path), 2, 2)


def _assert_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], where: str) -> None:
    assert sorted(got) == sorted(want), where
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype and g.shape == w.shape, (where, name, g.shape, w.shape)
        assert torch.equal(g.view(torch.int32), w.view(torch.int32)), f"{where}: {name} differs"


def _logits_of(results: list[Any], pp: int, tp: int) -> list[torch.Tensor]:
    """The logits every rank of the last stage returned (the others return None)."""
    last = range((pp - 1) * tp, pp * tp)
    assert all((r in last) == (x is not None) for r, x in enumerate(results))
    return [results[r] for r in last]


# --- the model itself, without checkpoints ------------------------------------------------------


def test_unfused_reference_orders_heads_by_query_group(weights: dict[str, torch.Tensor]) -> None:
    """HF q_proj is the concatenation over groups of linear_qkv's q rows (k_proj, v_proj alike)."""
    qkv = megatron.megatron_shards(weights, CFG, 1, 1, 0, 0)["decoder.layers.0.self_attention.linear_qkv.weight"]
    per = (CFG.q_per_group + 2) * CFG.head_dim
    groups = qkv.reshape(CFG.groups, per, CFG.hidden)
    qrows = CFG.q_per_group * CFG.head_dim
    q, k, v = groups[:, :qrows], groups[:, qrows : qrows + CFG.head_dim], groups[:, qrows + CFG.head_dim :]
    assert torch.equal(q.reshape(-1, CFG.hidden), weights["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(k.reshape(-1, CFG.hidden), weights["model.layers.0.self_attn.k_proj.weight"])
    assert torch.equal(v.reshape(-1, CFG.hidden), weights["model.layers.0.self_attn.v_proj.weight"])


def test_one_process_megatron_forward_matches_the_reference(
    weights: dict[str, torch.Tensor], reference: torch.Tensor
) -> None:
    stages = [megatron.build_stage(weights, CFG, 2, 1, s, 0, pad_value=PAD) for s in range(2)]
    torch.testing.assert_close(megatron.sequential_logits(stages, megatron.tokens(CFG)), reference, **TOL)


@pytest.mark.parametrize(("pp", "tp"), [(2, 2), (1, 4), (4, 1)])
def test_parallel_forward_matches_the_reference(ranks: RankPool, reference: torch.Tensor, pp: int, tp: int) -> None:
    for logits in _logits_of(ranks.run(_forward, 4, pp, tp), pp, tp):
        torch.testing.assert_close(logits, reference, **TOL)


# --- save at PP=2 x TP=2 --------------------------------------------------------------------------


def test_save_stores_the_logical_unfused_unpadded_arrays(
    saved: tuple[Path, list[Any]], weights: dict[str, torch.Tensor], reference: torch.Tensor
) -> None:
    path, results = saved
    for logits in _logits_of(results, 2, 2):
        torch.testing.assert_close(logits, reference, **TOL)
    rd = lc.open(path)
    want = {megatron.stored_name(hf): w for hf, w in weights.items()}
    assert sorted(rd.keys()) == sorted(want)
    assert "decoder.layers.3.self_attention.linear_qkv.q.weight" in want  # global numbers, part names
    for name, w in want.items():
        got = rd.read_torch(name)
        assert got.shape == w.shape, (name, got.shape)  # 70 rows for the padded vocabulary
        assert torch.equal(got.view(torch.int32), w.view(torch.int32)), name


def test_plain_load_gives_every_array_under_its_global_name(
    saved: tuple[Path, list[Any]], weights: dict[str, torch.Tensor]
) -> None:
    got = dict(leaves(lc.load(saved[0])))  # one plain process, no layout: nested global names
    _assert_bits(got, {megatron.stored_name(hf): w for hf, w in weights.items()}, "plain load")


# --- resume under other parallelisms --------------------------------------------------------------


@pytest.mark.parametrize(("pp", "tp"), [(1, 4), (4, 1)])
def test_load_on_four_ranks(
    ranks: RankPool,
    saved: tuple[Path, list[Any]],
    weights: dict[str, torch.Tensor],
    reference: torch.Tensor,
    pp: int,
    tp: int,
) -> None:
    results = ranks.run(_load, 4, os.fspath(saved[0]), pp, tp)
    for rank, result in enumerate(results):
        want = megatron.megatron_shards(weights, CFG, pp, tp, rank // tp, rank % tp, pad_value=0.0)
        _assert_bits(result["inplace"], want, f"rank {rank} in place")
        _assert_bits(result["from_meta"], want, f"rank {rank} from meta")
        assert result["same_objects"], rank
    for logits in _logits_of([r["logits"] for r in results], pp, tp):
        torch.testing.assert_close(logits, reference, **TOL)


def _load_shared(rank: int, group: Any, path: str, share: bool) -> tuple[dict[str, torch.Tensor], int]:
    """At PP=1 x DP=2 x TP=2, in place: the two replicas of each tp rank load the same fused
    QKV and gate-up parts and the same padded vocabulary rows."""
    model = megatron.build_stage(megatron.global_weights(CFG, SEED + 1), CFG, 1, 2, 0, rank % 2, pad_value=PAD)
    before = _shardread.bytes_read()
    lc.load(path, layout(1, 2, dp=2), like=model.state_dict(), inplace=True, group=group, share_reads=share)
    return _clone(model.state_dict()), _shardread.bytes_read() - before


def test_data_parallel_replicas_share_the_reads_of_fused_and_padded_parts(
    ranks: RankPool, saved: tuple[Path, list[Any]], weights: dict[str, torch.Tensor]
) -> None:
    """``share_reads=True`` under PP=1 x DP=2 x TP=2: each replica reads part of its tp rank's
    fused and padded tensors and receives the rest; both end bit-equal to the derived shards."""
    alone = ranks.run(_load_shared, 4, os.fspath(saved[0]), False)
    shared = ranks.run(_load_shared, 4, os.fspath(saved[0]), True)
    for rank, (got, _) in enumerate(shared):
        _assert_bits(got, megatron.megatron_shards(weights, CFG, 1, 2, 0, rank % 2, pad_value=0.0), f"rank {rank}")
    read_alone, read_shared = sum(n for _, n in alone), sum(n for _, n in shared)
    assert read_shared < 0.6 * read_alone, (read_shared, read_alone)


def test_load_at_tp1_in_one_plain_process(
    saved: tuple[Path, list[Any]], weights: dict[str, torch.Tensor], reference: torch.Tensor
) -> None:
    like = megatron.Stage(CFG, 1, 1, 0, device="meta").state_dict()
    got = lc.load(saved[0], layout(1, 1), like=like)
    want = megatron.megatron_shards(weights, CFG, 1, 1, 0, 0, pad_value=0.0)
    _assert_bits(got, want, "tp=1")
    model = megatron.Stage(CFG, 1, 1, 0)
    model.load_state_dict(got)
    torch.testing.assert_close(megatron.sequential_logits([model], megatron.tokens(CFG)), reference, **TOL)


def test_load_into_an_unfused_hugging_face_model(
    saved: tuple[Path, list[Any]], weights: dict[str, torch.Tensor], reference: torch.Tensor
) -> None:
    like = {name: torch.empty(w.shape, device="meta") for name, w in weights.items()}
    got = lc.load(saved[0], hf_layout(), like=like)
    _assert_bits(got, weights, "Hugging-Face names")
    assert torch.equal(megatron.reference_logits(got, megatron.tokens(CFG), CFG), reference)


# --- refusals ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "names"),
    [
        ("fused_sizes", "linear_fc1"),
        ("padding", "word_embeddings|output_layer"),
        ("renumber", "decoder.layers.1."),
    ],
)
def test_bad_declarations_are_refused_before_anything_is_written(
    ranks: RankPool, tmp_path: Path, case: str, names: str
) -> None:
    path = tmp_path / case
    results = ranks.run(_refused, 4, os.fspath(path), case, timeout=60)
    for rank, (is_layout_error, kind, message) in enumerate(results):
        assert is_layout_error, f"rank {rank}: {kind}: {message}"
        assert any(n in message for n in names.split("|")), f"rank {rank}: the message names no array: {message}"
    with pytest.raises(lc.CheckpointNotFoundError):
        lc.open(path)
    assert not path.exists() or not any(path.rglob("*")), sorted(path.rglob("*"))


def test_more_tp_ranks_than_query_groups_is_refused(ranks: RankPool, tmp_path: Path) -> None:
    """2 query groups cannot be split over 4 tp ranks: a LayoutError, not replicated KV heads."""
    cfg = megatron.Config(groups=2)
    path = tmp_path / "two-groups"
    w = megatron.global_weights(cfg, SEED)
    lc.save(path, megatron.megatron_shards(w, cfg, 1, 1, 0, 0), layout(1, 1, cfg=cfg))
    for rank, (is_layout_error, kind, message) in enumerate(ranks.run(_refused_load, 4, os.fspath(path), cfg)):
        assert is_layout_error, f"rank {rank}: {kind}: {message}"
        assert "linear_qkv" in message, message
