"""The tiny Llama of ``tests/support/llama.py`` split into pipeline stages, and one training step
through a real ``torch.distributed.pipelining`` schedule.

Stages are cut torchtitan-style: a stage module holds the blocks it owns under their GLOBAL
names (``layers.2.attention.wq.weight`` on the stage that holds block 2), the first stage the
token embedding, the last the final norm and the output projection. Its state dict therefore
names every array as the whole model does, and the stages' names are disjoint.

``Config(tied=False)``: the embedding lives on the first stage and the output projection on the
last, so one tied parameter cannot serve both.

``train_step`` runs ``Schedule1F1B`` over ``MICROBATCHES`` microbatches of the step's global batch
(or of this data-parallel rank's slice of it), each microbatch's loss the mean cross-entropy of
its tokens; the schedule divides the gradients by the number of microbatches, so that they are
the gradients of the mean loss over the batch. The loss a step reports is the mean of the
microbatches' losses, broadcast from the last stage to every rank, averaged over the
data-parallel ranks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests.support import llama

MICROBATCHES = 4
BATCH = 8  # sequences in a step's global batch
CONFIG = llama.Config(layers=4, tied=False)


class StageModule(nn.Module):
    """The part of a ``llama.Llama`` that one pipeline stage runs, under the model's own names."""

    def __init__(self, model: llama.Llama, layers: range, *, first: bool, last: bool) -> None:
        super().__init__()
        assert not model.cfg.tied or (first and last), "a tied embedding cannot be split over stages"
        self.cfg = model.cfg
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layers})
        self.norm = model.norm if last else None
        self.output = model.output if last else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        for layer in self.layers.values():
            h = layer(h)
        if self.output is not None:
            h = self.output(self.norm(h))
        return h


def stage_layers(stage: int, stages: int, cfg: llama.Config = CONFIG) -> range:
    """The blocks stage ``stage`` of ``stages`` owns: an even, contiguous split."""
    assert cfg.layers % stages == 0, "every stage gets as many blocks"
    per = cfg.layers // stages
    return range(stage * per, (stage + 1) * per)


def build_stage(
    seed: int, stage: int, stages: int, cfg: llama.Config = CONFIG, device: str | torch.device = "cpu"
) -> StageModule:
    """Stage ``stage`` of ``stages`` of the model ``llama.build(seed, cfg)`` (the whole one is
    built, then cut, so that every stage's initial weights are those of one model)."""
    model = llama.build(seed, cfg, device=device)
    return StageModule(model, stage_layers(stage, stages, cfg), first=stage == 0, last=stage == stages - 1)


def apply_tp(stage: StageModule, tp_mesh: Any) -> StageModule:
    """Tensor parallelism of the stage's blocks, as ``llama.apply_tp`` does for the whole model."""
    for layer in stage.layers.values():
        llama.apply_tp_block(layer, tp_mesh)
    return stage


def apply_fsdp(stage: StageModule, dp_mesh: Any) -> StageModule:
    """FSDP2 on each block and on the stage module (as torchtitan shards a pipeline stage)."""
    from torch.distributed.fsdp import fully_shard

    for layer in stage.layers.values():
        # Each microbatch's backward of a block would reshard it, to gather it again for the next.
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=False)
    fully_shard(stage, mesh=dp_mesh, reshard_after_forward=False)
    return stage


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class Pipeline:
    """One rank's stage of a pipeline and the schedule that trains it.

    ``pp_group`` is the process group of the ranks holding the stages of one pipeline (one rank
    per stage, ``stage`` its index in it); ``dp_group`` (optional) the data-parallel ranks, each
    of which trains on its slice of the global batch.
    """

    def __init__(
        self, module: nn.Module, stage: int, stages: int, pp_group: Any, dp_group: Any = None, dp_rank: int = 0
    ) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        self.module, self.stage, self.stages = module, stage, stages
        self.pp_group, self.dp_group, self.dp_rank = pp_group, dp_group, dp_rank
        self.pipeline_stage = PipelineStage(module, stage, stages, torch.device("cpu"), group=pp_group)
        self.schedule = Schedule1F1B(self.pipeline_stage, MICROBATCHES, loss_fn=_loss)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def _batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        import torch.distributed as dist

        inputs, targets = llama.batch(step, CONFIG, size=BATCH)
        if self.dp_group is None:
            return inputs, targets
        dp = dist.get_world_size(self.dp_group)
        return inputs.chunk(dp)[self.dp_rank], targets.chunk(dp)[self.dp_rank]

    def train_step(self, opt: torch.optim.Optimizer, step: int) -> torch.Tensor:
        """One optimizer step on the batch of ``step``; the loss before the update, on every rank."""
        import torch.distributed as dist

        inputs, targets = self._batch(step)
        opt.zero_grad()
        losses: list[torch.Tensor] = []
        if self.first and self.last:
            self.schedule.step(inputs, target=targets, losses=losses)
        elif self.first:
            self.schedule.step(inputs)
        elif self.last:
            self.schedule.step(target=targets, losses=losses)
        else:
            self.schedule.step()
        opt.step()
        loss = torch.stack([x.detach() for x in losses]).mean() if self.last else torch.zeros(())
        # The last stage's loss, to every stage of this pipeline.
        src = dist.get_global_rank(self.pp_group, self.stages - 1)
        dist.broadcast(loss, src=src, group=self.pp_group)
        if self.dp_group is not None:
            dist.all_reduce(loss, group=self.dp_group)
            loss /= dist.get_world_size(self.dp_group)
        return loss


def plain_train_step(model: llama.Llama, opt: torch.optim.Optimizer, step: int) -> torch.Tensor:
    """What ``Pipeline.train_step`` does, in one process without a pipeline: the same
    microbatches, each loss's gradient divided by their number."""
    inputs, targets = llama.batch(step, model.cfg, size=BATCH)
    opt.zero_grad()
    losses = []
    for x, y in zip(inputs.chunk(MICROBATCHES), targets.chunk(MICROBATCHES), strict=True):
        loss = _loss(model(x), y)
        (loss / MICROBATCHES).backward()
        losses.append(loss.detach())
    opt.step()
    return torch.stack(losses).mean()
