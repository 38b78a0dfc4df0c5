"""One training step over a pipeline: the rank's stage under torch's schedule (``torch.distributed.pipelining``).

What fixes every order, so that a step replays bit for bit (docs/pipeline_parallel.md): the schedule cuts the batch
into equal micro-batches along its first dimension (micro-batch ``i`` is rows ``[i*m, (i+1)*m)``); on each stage
GPipe and 1F1B both run the forwards in micro-batch order and the backwards in micro-batch order, so each gradient
is ``g0 + g1 + ... + g(n-1)`` in that order, divided by ``n`` once at the end (``scale_grads``); activations and
their gradients cross between stages as exact bytes. The step's loss is the mean of the micro-batches' losses,
summed in order on the last stage and broadcast, so every stage reports the same loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from resilience.runtime.pipeline import Layout
from resilience.workloads.base import Workload

SCHEDULES = ("1f1b", "gpipe")  # parallel.schedule: torch's Schedule1F1B, ScheduleGPipe


class PipelineRunner:
    """Runs a step's micro-batches through this rank's stage; the gradients accumulate in the stage's parameters."""

    def __init__(self, module: nn.Module, layout: Layout, workload: Workload, device: torch.device,
                 microbatches: int, schedule: str) -> None:
        # imported where a rank builds its stage: the command that only checks the settings does without it
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        self.module, self.layout, self.device, self.n = module, layout, device, microbatches
        inputs, outputs = workload.stage_io(layout.stage, layout.stages, workload.batch_size // microbatches)
        # the shapes given up front (static): no inference pass on the first step of each attempt
        stage = PipelineStage(module, layout.stage, layout.stages, device, input_args=inputs, output_args=outputs,
                              group=layout.pp_group)
        # the loss on every stage, not the last alone: without one a stage runs no backward
        kind = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
        self.schedule = kind(stage, n_microbatches=microbatches, loss_fn=workload.loss_fn, scale_grads=True)

    def forward_backward(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, y = batch
        layout, losses = self.layout, []
        if layout.first:
            self.schedule.step(x)
        elif layout.last:
            self.schedule.step(target=y, losses=losses, return_outputs=False)
        else:
            self.schedule.step()
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        for part in losses:  # in micro-batch order: the same sum on every replay
            loss += part.detach()
        loss /= self.n
        dist.broadcast(loss, src=layout.pp_ranks[-1], group=layout.pp_group)
        return loss
