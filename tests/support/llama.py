"""A tiny Llama-like transformer in plain torch, and the ways the tests parallelize it.

Token embedding, blocks of (RMSNorm, causal attention with bias-free q/k/v/o projections,
RMSNorm, SwiGLU MLP), a final RMSNorm and an output projection tied to the embedding, as in
small Llamas (``Config(tied=False)`` gives the output projection a weight of its own).
Dimensions are tiny so that training a few steps on CPU takes milliseconds.

Parallelisms, as torchtitan applies them:

- ``apply_fsdp(model, mesh)``: FSDP2 ``fully_shard`` on every block, then on the root.
- ``apply_tp(model, tp_mesh)``: Megatron-style tensor parallelism of the blocks (column-parallel
  q/k/v/gate/up, row-parallel o/down), heads split across the ranks; ``apply_tp_block`` of one.
- ``apply_2d(model, mesh)``: tensor parallelism on ``mesh["tp"]``, then FSDP2 on ``mesh["dp"]``.

Tied weights under tensor parallelism: the embedding and the output projection stay whole
(replicated) on every tensor-parallel rank, and only the blocks are sharded. Sharding them would
need vocabulary-parallel embedding and output modules that ``parallelize_module`` would convert
one at a time, making two parameters of the tied one. Replicated, every rank computes the same
gradient for the shared weight (the blocks' outputs are all-reduced), so the copies stay equal and
one parameter object serves both names. Under FSDP2 the tied weight belongs to the root's unit,
which shards it once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    dim: int = 32
    layers: int = 2
    heads: int = 4
    hidden: int = 64
    eps: float = 1e-5
    # The output projection shares the embedding's weight. A pipeline split puts the embedding
    # on the first stage and the output on the last, where one parameter cannot serve both.
    tied: bool = True


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        # -1 heads: under tensor parallelism the column-parallel projections give this rank's heads.
        q, k, v = (w(x).view(bsz, seqlen, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden, bias=False)  # gate
        self.w3 = nn.Linear(cfg.dim, cfg.hidden, bias=False)  # up
        self.w2 = nn.Linear(cfg.hidden, cfg.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, cfg: Config = Config()) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim, cfg.eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        if cfg.tied:
            self.output.weight = self.tok_embeddings.weight
        # nn.Embedding draws N(0, 1), which as tied output weights gives logits far too large.
        nn.init.normal_(self.tok_embeddings.weight, std=0.1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def build(seed: int, cfg: Config = Config(), device: str | torch.device = "cpu") -> Llama:
    """A model whose initial weights depend only on ``seed`` (none are drawn on ``meta``)."""
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        return Llama(cfg)


def materialize(model: Llama, device: str | torch.device = "cpu") -> Llama:
    """Allocate (uninitialized) storage for a model built on ``meta``, keeping its weights tied.

    ``nn.Module.to_empty`` gives each module a new plain parameter of its own, which unties the
    output projection from the embedding (DTensor parameters of FSDP2 or tensor parallelism are
    swapped in place and stay tied); tie them again, as ``tie_weights()`` does in transformers.
    """
    model.to_empty(device=device)
    if model.cfg.tied and model.output.weight is not model.tok_embeddings.weight:
        model.output.weight = model.tok_embeddings.weight
    return model


def batch(step: int, cfg: Config = Config(), size: int = 4, seqlen: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step: (inputs, next-token targets), the same on every rank."""
    # Each sequence counts up in steps of 5 from a random start: a pattern a few optimizer steps
    # learn well, so a resumed model's loss is far from a fresh one's.
    g = torch.Generator().manual_seed(10_000 + step)
    start = torch.randint(0, cfg.vocab, (size, 1), generator=g)
    tokens = (start + 5 * torch.arange(seqlen + 1)) % cfg.vocab
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(model: Llama, step: int) -> torch.Tensor:
    """Mean next-token cross-entropy on the batch of ``step``."""
    inputs, targets = batch(step, model.cfg)
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    # foreach=False: under tensor parallelism the parameters mix DTensors and plain tensors,
    # which the multi-tensor kernels refuse to take in one list.
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)


def train_step(model: Llama, opt: torch.optim.Optimizer, step: int) -> torch.Tensor:
    """One optimizer step on the batch of ``step``; the loss before the update, detached."""
    opt.zero_grad()
    loss = loss_fn(model, step)
    loss.backward()
    opt.step()
    return loss.detach()


def apply_fsdp(model: Llama, mesh: Any) -> Llama:
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def apply_tp_block(block: Block, tp_mesh: Any) -> Block:
    """Megatron-style tensor parallelism of one block on ``tp_mesh``."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    heads = block.attention.wq.out_features // block.attention.head_dim
    assert heads % tp_mesh.size() == 0, "every tensor-parallel rank needs whole heads"
    plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }
    parallelize_module(block, tp_mesh, plan)
    return block


def apply_tp(model: Llama, tp_mesh: Any) -> Llama:
    for layer in model.layers:
        apply_tp_block(layer, tp_mesh)
    return model


def apply_2d(model: Llama, mesh: Any) -> Llama:
    """Tensor parallelism on ``mesh["tp"]``, then FSDP2 on ``mesh["dp"]`` (as torchtitan nests them)."""
    apply_tp(model, mesh["tp"])
    return apply_fsdp(model, mesh["dp"])
