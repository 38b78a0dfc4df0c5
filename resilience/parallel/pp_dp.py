"""Pipeline parallelism replicated: ``replicas`` copies of a pipeline of ``stages`` stages (``parallel=pp_dp``),
data parallel across the copies.

Stages outermost: rank ``r`` holds stage ``r // replicas`` of pipeline ``r % replicas`` (``runtime/pipeline.py``
forms each stage's data-parallel group, then each pipeline's group, on every rank in that order). Pipeline ``i``
trains on the batch of ``(seed, step, i)``, as DDP rank ``i`` does: a step consumes the global batch of
``parallel=ddp world_size=replicas``. After the schedule's step each stage's gradients are averaged over its replicas
by hand, not by DDP (docs/pipeline_parallel.md: pipelining would drive DDP through ``no_sync``, and a heal must
re-form the data-parallel group alone).
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import torch

from resilience.parallel.pp import PipelineParallel
from resilience.parallel.pp_runner import PipelineRunner
from resilience.runtime.pipeline import Layout, make_layout
from resilience.runtime.rank import RankRuntime
from resilience.runtime.reduce import ordered_mean
from resilience.settings.checks import require_int
from resilience.state.train import TrainState
from resilience.workloads.base import Workload


class PipelineDataParallel(PipelineParallel):

    caps = replace(PipelineParallel.caps, pipelines=2, of_setting={"stages": "stages", "pipelines": "replicas"})

    def __init__(self, stages: int = 2, replicas: int = 2, microbatches: int = 4, schedule: str = "1f1b") -> None:
        super().__init__(stages, microbatches, schedule)
        self.replicas = require_int("parallel.replicas", replicas, 2)
        self.caps = type(self).caps.under(stages=self.stages, replicas=self.replicas)

    def layout(self, rank: int, world_size: int, timeout: timedelta | None = None) -> Layout:
        return make_layout(rank, world_size, self.stages, self.replicas, timeout)

    def step_runner(self, rt: RankRuntime, state: TrainState, workload: Workload) -> ReplicatedRunner:
        assert rt.layout is not None
        return ReplicatedRunner(state.model, rt.layout, workload, rt.device, self.microbatches, self.schedule)


class ReplicatedRunner(PipelineRunner):
    """The pipeline's step, then the stage's gradients and the step's loss averaged over the stage's replicas."""

    def forward_backward(self, batch: tuple[torch.Tensor, ...], step: int | None = None) -> torch.Tensor:
        loss = super().forward_backward(batch, step)
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]  # the same on every replica
        # One flat buffer, the loss last (one collective, not two): every element summed in replica order, then
        # divided (reduce.ordered_mean), so the replicas end on the same bits and a replay on the same again,
        # whatever the replica count and the backend's algorithms. The loss reported is the global batch's.
        flat = torch.cat([g.reshape(-1) for g in grads] + [loss.reshape(1)])
        mean = ordered_mean(flat, self.layout.dp_group)
        for grad, part in zip(grads, mean.split([g.numel() for g in grads] + [1])):
            grad.copy_(part.view_as(grad))
        return mean[-1].clone()
