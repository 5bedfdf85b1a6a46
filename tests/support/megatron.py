"""A tiny Megatron-style GPT in plain torch: manual tensor and pipeline parallelism, no Megatron.

The model is decoder-only: a vocabulary-parallel embedding, blocks of (RMSNorm, causal GQA
attention with a fused ``linear_qkv`` and a row-parallel ``linear_proj``, RMSNorm, a SwiGLU MLP
with a fused ``linear_fc1 = [gate; up]`` and a row-parallel ``linear_fc2``), a final RMSNorm and an
untied vocabulary-parallel ``output_layer``. Parameter names are Megatron's (local spec):

- ``embedding.word_embeddings.weight``: padded vocabulary, split over tp on dim 0 (first stage);
- ``decoder.layers.{i}.input_layernorm.weight`` and ``.pre_mlp_layernorm.weight``: replicated;
- ``decoder.layers.{i}.self_attention.linear_qkv.weight``: for each local query group in order,
  that group's q rows (``q_per_group * head_dim``), then its k rows, then its v rows (``head_dim``
  each); column-parallel, the tp ranks split the groups;
- ``decoder.layers.{i}.self_attention.linear_proj.weight``: row-parallel (split on dim 1);
- ``decoder.layers.{i}.mlp.linear_fc1.weight``: this rank's gate rows, then its up rows;
- ``decoder.layers.{i}.mlp.linear_fc2.weight``: row-parallel;
- ``decoder.final_layernorm.weight`` and ``output_layer.weight`` (padded, vocab-parallel) on the
  last stage.

Layer numbers are LOCAL to each pipeline stage: every stage names its layers ``decoder.layers.0``
to ``decoder.layers.{k-1}``, as Megatron does.

The weights are defined once, globally, unfused and unpadded, under Hugging-Face (Llama) names
(``global_weights``); ``reference_logits`` runs that model in one process. ``megatron_shards``
derives each rank's local fused and padded tensors from the global weights, so a parallel run of
``stage_forward`` must give the reference's logits. The Hugging-Face heads are ordered by query
group (head ``h`` belongs to group ``h // q_per_group``), so ``q_proj`` is the concatenation over
groups of each group's q rows of ``linear_qkv``, and ``k_proj``/``v_proj`` those of its k/v rows.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Config:
    vocab: int = 70  # not a multiple of the padding: 72 rows at tp=1, 80 at tp=2, 96 at tp=4
    hidden: int = 16
    heads: int = 8
    groups: int = 4  # query groups (kv heads): 2 query heads per group
    head_dim: int = 4  # heads * head_dim = 32 != hidden
    ffn: int = 24
    layers: int = 4
    divisible_by: int = 8  # Megatron's make_vocab_size_divisible_by
    eps: float = 1e-5

    @property
    def q_per_group(self) -> int:
        return self.heads // self.groups

    def padded_vocab(self, tp: int) -> int:
        multiple = self.divisible_by * tp
        return math.ceil(self.vocab / multiple) * multiple


# --- the global model (Hugging-Face names) ------------------------------------------------------


def global_weights(cfg: Config, seed: int) -> dict[str, torch.Tensor]:
    """Every weight of the model, unfused and unpadded, under Hugging-Face names (float32)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.3) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    def norm() -> torch.Tensor:
        return 1 + rand(cfg.hidden, scale=0.1)

    h, hd = cfg.hidden, cfg.head_dim
    w = {"model.embed_tokens.weight": rand(cfg.vocab, h, scale=1.0)}
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm()
        w[p + "self_attn.q_proj.weight"] = rand(cfg.heads * hd, h)
        w[p + "self_attn.k_proj.weight"] = rand(cfg.groups * hd, h)
        w[p + "self_attn.v_proj.weight"] = rand(cfg.groups * hd, h)
        w[p + "self_attn.o_proj.weight"] = rand(h, cfg.heads * hd)
        w[p + "post_attention_layernorm.weight"] = norm()
        w[p + "mlp.gate_proj.weight"] = rand(cfg.ffn, h)
        w[p + "mlp.up_proj.weight"] = rand(cfg.ffn, h)
        w[p + "mlp.down_proj.weight"] = rand(h, cfg.ffn)
    w["model.norm.weight"] = norm()
    w["lm_head.weight"] = rand(cfg.vocab, h)
    return w


def hf_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in global_weights(cfg, 0).items()}


def tokens(cfg: Config, batch: int = 2, seq: int = 9, seed: int = 1234) -> torch.Tensor:
    """A fixed batch that uses the first and the last token of the vocabulary."""
    t = torch.randint(cfg.vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))
    t[0, 0], t[1, -1] = 0, cfg.vocab - 1
    return t


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal GQA: q (B, T, heads, hd); k, v (B, T, groups, hd), head h reads group h // (heads/groups)."""
    b, t, heads, hd = q.shape
    rep = heads // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, heads * hd)


def reference_logits(w: dict[str, torch.Tensor], toks: torch.Tensor, cfg: Config) -> torch.Tensor:
    """The unfused, unpadded model on one process: (batch, seq, vocab) logits."""
    b, t = toks.shape
    x = w["model.embed_tokens.weight"][toks]
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        a = rms_norm(x, w[p + "input_layernorm.weight"], cfg.eps)
        q = (a @ w[p + "self_attn.q_proj.weight"].T).reshape(b, t, cfg.heads, cfg.head_dim)
        k = (a @ w[p + "self_attn.k_proj.weight"].T).reshape(b, t, cfg.groups, cfg.head_dim)
        v = (a @ w[p + "self_attn.v_proj.weight"].T).reshape(b, t, cfg.groups, cfg.head_dim)
        x = x + attention(q, k, v) @ w[p + "self_attn.o_proj.weight"].T
        m = rms_norm(x, w[p + "post_attention_layernorm.weight"], cfg.eps)
        gate, up = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    x = rms_norm(x, w["model.norm.weight"], cfg.eps)
    return x @ w["lm_head.weight"].T


# --- Megatron's local tensors, derived from the global weights ---------------------------------


def layers_of(cfg: Config, pp: int, stage: int) -> range:
    """The global numbers of the layers that pipeline stage ``stage`` holds (even stages)."""
    per = cfg.layers // pp
    return range(stage * per, (stage + 1) * per)


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: Config, tp: int, rank: int) -> torch.Tensor:
    """This tp rank's ``linear_qkv``: for each of its query groups, [q rows; k rows; v rows]."""
    qg, hd = cfg.q_per_group * cfg.head_dim, cfg.head_dim
    local = cfg.groups // tp
    pieces = []
    for g in range(rank * local, (rank + 1) * local):
        pieces += [q[g * qg : (g + 1) * qg], k[g * hd : (g + 1) * hd], v[g * hd : (g + 1) * hd]]
    return torch.cat(pieces)


def pad_rows(w: torch.Tensor, rows: int, value: float) -> torch.Tensor:
    return torch.cat([w, torch.full((rows - w.shape[0], *w.shape[1:]), value, dtype=w.dtype)])


def megatron_shards(
    w: dict[str, torch.Tensor], cfg: Config, pp: int, tp: int, stage: int, rank: int, pad_value: float = 0.0
) -> dict[str, torch.Tensor]:
    """The local (Megatron-named, stage-local numbered, fused, padded) tensors of one rank."""
    out: dict[str, torch.Tensor] = {}
    padded = cfg.padded_vocab(tp)

    def vocab_piece(name: str) -> torch.Tensor:
        return pad_rows(w[name], padded, pad_value).chunk(tp)[rank].clone()

    if stage == 0:
        out["embedding.word_embeddings.weight"] = vocab_piece("model.embed_tokens.weight")
    for local, i in enumerate(layers_of(cfg, pp, stage)):
        p, m = f"model.layers.{i}.", f"decoder.layers.{local}."
        out[m + "input_layernorm.weight"] = w[p + "input_layernorm.weight"].clone()
        out[m + "self_attention.linear_qkv.weight"] = fuse_qkv(
            w[p + "self_attn.q_proj.weight"],
            w[p + "self_attn.k_proj.weight"],
            w[p + "self_attn.v_proj.weight"],
            cfg,
            tp,
            rank,
        )
        out[m + "self_attention.linear_proj.weight"] = w[p + "self_attn.o_proj.weight"].chunk(tp, dim=1)[rank].clone()
        out[m + "pre_mlp_layernorm.weight"] = w[p + "post_attention_layernorm.weight"].clone()
        gate, up = w[p + "mlp.gate_proj.weight"].chunk(tp)[rank], w[p + "mlp.up_proj.weight"].chunk(tp)[rank]
        out[m + "mlp.linear_fc1.weight"] = torch.cat([gate, up])
        out[m + "mlp.linear_fc2.weight"] = w[p + "mlp.down_proj.weight"].chunk(tp, dim=1)[rank].clone()
    if stage == pp - 1:
        out["decoder.final_layernorm.weight"] = w["model.norm.weight"].clone()
        out["output_layer.weight"] = vocab_piece("lm_head.weight")
    return out


# Hugging-Face names -> the global names a Megatron checkpoint stores (fused parts as the library
# names them: ``linear_qkv.weight`` -> ``linear_qkv.q.weight``, ``linear_fc1.gate.weight``, ...).
HF_TO_MEGATRON = [
    (r"^model\.embed_tokens\.weight$", "embedding.word_embeddings.weight"),
    (
        r"^model\.layers\.(\d+)\.self_attn\.([qkv])_proj\.weight$",
        r"decoder.layers.\1.self_attention.linear_qkv.\2.weight",
    ),
    (r"^model\.layers\.(\d+)\.self_attn\.o_proj\.weight$", r"decoder.layers.\1.self_attention.linear_proj.weight"),
    (r"^model\.layers\.(\d+)\.mlp\.(gate|up)_proj\.weight$", r"decoder.layers.\1.mlp.linear_fc1.\2.weight"),
    (r"^model\.layers\.(\d+)\.mlp\.down_proj\.weight$", r"decoder.layers.\1.mlp.linear_fc2.weight"),
    (r"^model\.layers\.(\d+)\.input_layernorm\.weight$", r"decoder.layers.\1.input_layernorm.weight"),
    (r"^model\.layers\.(\d+)\.post_attention_layernorm\.weight$", r"decoder.layers.\1.pre_mlp_layernorm.weight"),
    (r"^model\.norm\.weight$", "decoder.final_layernorm.weight"),
    (r"^lm_head\.weight$", "output_layer.weight"),
]


def stored_name(hf_name: str) -> str:
    """The global stored name of a Hugging-Face weight (what ``HF_TO_MEGATRON`` gives)."""
    for pattern, repl in HF_TO_MEGATRON:
        if re.search(pattern, hf_name):
            return re.sub(pattern, repl, hf_name, count=1)
    raise KeyError(hf_name)


# --- the per-stage module and its manually parallel forward ------------------------------------


class Weight(nn.Module):
    """A module holding one ``weight`` (a linear layer or a norm, applied by ``stage_forward``)."""

    def __init__(self, *shape: int, device: str | torch.device | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(*shape, device=device), requires_grad=False)


class Layer(nn.Module):
    def __init__(self, cfg: Config, tp: int, device: str | torch.device | None) -> None:
        super().__init__()
        qkv_rows = (cfg.groups // tp) * (cfg.q_per_group + 2) * cfg.head_dim
        self.input_layernorm = Weight(cfg.hidden, device=device)
        self.self_attention = nn.Module()
        self.self_attention.linear_qkv = Weight(qkv_rows, cfg.hidden, device=device)
        self.self_attention.linear_proj = Weight(cfg.hidden, cfg.heads * cfg.head_dim // tp, device=device)
        self.pre_mlp_layernorm = Weight(cfg.hidden, device=device)
        self.mlp = nn.Module()
        self.mlp.linear_fc1 = Weight(2 * cfg.ffn // tp, cfg.hidden, device=device)
        self.mlp.linear_fc2 = Weight(cfg.hidden, cfg.ffn // tp, device=device)


class Stage(nn.Module):
    """Pipeline stage ``stage`` of ``pp`` on one of ``tp`` tensor-parallel ranks; zero weights."""

    def __init__(self, cfg: Config, pp: int, tp: int, stage: int, device: str | torch.device | None = None) -> None:
        super().__init__()
        self.cfg, self.pp, self.tp, self.stage = cfg, pp, tp, stage
        rows = cfg.padded_vocab(tp) // tp
        if stage == 0:
            self.embedding = nn.Module()
            self.embedding.word_embeddings = Weight(rows, cfg.hidden, device=device)
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList(Layer(cfg, tp, device) for _ in layers_of(cfg, pp, stage))
        if stage == pp - 1:
            self.decoder.final_layernorm = Weight(cfg.hidden, device=device)
            self.output_layer = Weight(rows, cfg.hidden, device=device)


def build_stage(
    w: dict[str, torch.Tensor], cfg: Config, pp: int, tp: int, stage: int, rank: int, pad_value: float = 0.0
) -> Stage:
    model = Stage(cfg, pp, tp, stage)
    model.load_state_dict(megatron_shards(w, cfg, pp, tp, stage, rank, pad_value), strict=True)
    return model


def _all_reduce(x: torch.Tensor, group: object, tp: int) -> torch.Tensor:
    if tp > 1:
        import torch.distributed as dist

        dist.all_reduce(x, group=group)
    return x


def stage_forward(
    model: Stage, tp_rank: int, tp_group: object, x: torch.Tensor, *, send_to: int | None = None
) -> torch.Tensor | None:
    """One stage's part of the forward on one tp rank.

    ``x`` is the token batch on the first stage, the hidden states received from the previous
    stage on the others. The last stage returns the full (batch, seq, vocab) logits, gathered
    over the tp ranks and cut to the real vocabulary; the other stages return their hidden
    states (``send_to`` is then the global rank they are also sent to, or None).
    """
    cfg, tp = model.cfg, model.tp
    if model.stage == 0:
        emb = model.embedding.word_embeddings.weight
        lo = tp_rank * emb.shape[0]
        mine = (x >= lo) & (x < lo + emb.shape[0])
        h = emb[(x - lo).clamp(0, emb.shape[0] - 1)] * mine.unsqueeze(-1)
        h = _all_reduce(h, tp_group, tp)
    else:
        h = x
    b, t, _ = h.shape
    groups, heads, hd = cfg.groups // tp, cfg.heads // tp, cfg.head_dim
    for layer in model.decoder.layers:
        a = rms_norm(h, layer.input_layernorm.weight, cfg.eps)
        qkv = (a @ layer.self_attention.linear_qkv.weight.T).reshape(b, t, groups, cfg.q_per_group + 2, hd)
        q = qkv[:, :, :, : cfg.q_per_group].reshape(b, t, heads, hd)
        k, v = qkv[:, :, :, -2], qkv[:, :, :, -1]
        o = attention(q, k, v) @ layer.self_attention.linear_proj.weight.T
        h = h + _all_reduce(o, tp_group, tp)
        m = rms_norm(h, layer.pre_mlp_layernorm.weight, cfg.eps)
        gate, up = (m @ layer.mlp.linear_fc1.weight.T).chunk(2, dim=-1)
        h = h + _all_reduce((F.silu(gate) * up) @ layer.mlp.linear_fc2.weight.T, tp_group, tp)
    if model.stage < model.pp - 1:
        if send_to is not None:
            import torch.distributed as dist

            dist.send(h.contiguous(), dst=send_to)
        return h
    h = rms_norm(h, model.decoder.final_layernorm.weight, cfg.eps)
    logits = h @ model.output_layer.weight.T
    if tp > 1:
        import torch.distributed as dist

        parts = [torch.empty_like(logits) for _ in range(tp)]
        dist.all_gather(parts, logits.contiguous(), group=tp_group)
        logits = torch.cat(parts, dim=-1)
    return logits[..., : cfg.vocab]


def sequential_logits(stages: list[Stage], toks: torch.Tensor) -> torch.Tensor:
    """The stages of one tp=1 pipeline run one after another in this process."""
    x: torch.Tensor = toks
    for s in stages:
        out = stage_forward(s, 0, None, x)
        assert out is not None
        x = out
    return x


# --- on real ranks: rank r of a job on Mesh({"pp": pp, "tp": tp}) is stage r // tp, tp rank r % tp

_TP_GROUPS: dict[tuple[int, int], list[object]] = {}


def tp_group(pp: int, tp: int, rank: int, job_group: object) -> object:
    """The tp process group of ``rank``: the job's own group when pp == 1, else a new gloo group.

    ``dist.new_group`` is collective over the default world: every rank of the default world
    (here, of the job) calls it for every stage, in the same order. Groups are kept per process.
    """
    if tp == 1:
        return None
    if pp == 1:
        return job_group
    if (pp, tp) not in _TP_GROUPS:
        import torch.distributed as dist

        _TP_GROUPS[(pp, tp)] = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(pp)]
    return _TP_GROUPS[(pp, tp)][rank // tp]


def pipeline_logits(model: Stage, rank: int, group: object, toks: torch.Tensor) -> torch.Tensor | None:
    """The forward of a pipeline of ``model.pp`` stages x ``model.tp`` tp ranks, one batch.

    Each stage receives its input from the rank of the previous stage with the same tp rank and
    sends its output to the next; the last stage's ranks return the logits, the others None.
    Ranks of ``group`` must be the global ranks 0..pp*tp-1 (as in ``RankPool``).
    """
    import torch.distributed as dist

    tp = model.tp
    tp_grp = tp_group(model.pp, tp, rank, group)  # collective: before any stage waits on another
    x = toks
    if model.stage > 0:
        x = torch.empty(*toks.shape, model.cfg.hidden)
        dist.recv(x, src=rank - tp)
    send_to = rank + tp if model.stage < model.pp - 1 else None
    out = stage_forward(model, rank % tp, tp_grp, x, send_to=send_to)
    return out if model.stage == model.pp - 1 else None
