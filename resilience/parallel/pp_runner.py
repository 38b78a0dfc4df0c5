"""One training step over a pipeline: the rank's stage under torch's schedule (``torch.distributed.pipelining``).

What fixes every order, so that a step replays bit for bit (docs/pipeline_parallel.md): the schedule cuts the batch
into equal micro-batches along its first dimension (micro-batch ``i`` is rows ``[i*m, (i+1)*m)``); on each stage
GPipe and 1F1B both run the forwards in micro-batch order and the backwards in micro-batch order, so each gradient
is ``g0 + g1 + ... + g(n-1)`` in that order, divided by ``n`` once at the end (``scale_grads``); activations and
their gradients cross between stages as exact bytes. The step's loss is the mean of the micro-batches' losses,
summed in order on the last stage and broadcast, so every stage reports the same loss.

With a ``BoundaryLog`` the stage is a ``LoggingStage``: the same ops and bytes, and a copy of each send kept per step
and micro-batch (``logged_stage.py``; docs/pipeline_parallel.md, "The boundary log and the replay").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from resilience.runtime.pipeline import Layout, stage_norms
from resilience.workloads.base import Workload

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage

    from resilience.parallel.boundary_log import BoundaryLog

SCHEDULES = ("1f1b", "gpipe")  # parallel.schedule: torch's Schedule1F1B, ScheduleGPipe


class PipelineRunner:
    """Runs a step's micro-batches through this rank's stage; the gradients accumulate in the stage's parameters."""

    def __init__(self, module: nn.Module, layout: Layout, workload: Workload, device: torch.device,
                 microbatches: int, schedule: str, log: BoundaryLog | None = None) -> None:
        self.module, self.layout, self.device, self.n, self.log = module, layout, device, microbatches, log
        self.workload, self.schedule_name = workload, schedule
        self.reset()

    def reset(self) -> None:
        """Build the stage and its schedule anew, over the pipeline's group as it is now, logging into ``self.log``
        (a survivor of a lost stage drops its schedule's runtime state, bound to the group that broke, this way)."""
        # imported where a rank builds its stage: the command that only checks the settings does without it
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

        layout, workload = self.layout, self.workload
        inputs, outputs = workload.stage_io(layout.stage, layout.stages, workload.batch_size // self.n)
        # the shapes given up front (static): no inference pass on the first step of each attempt
        self.stage = self.make_stage(self.module, layout.stage, layout.stages, self.device, input_args=inputs,
                                     output_args=outputs, group=layout.pp_group)
        # the loss on every stage, not the last alone: without one a stage runs no backward
        kind = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[self.schedule_name]
        self.schedule = kind(self.stage, n_microbatches=self.n, loss_fn=workload.loss_fn, scale_grads=True)

    def release(self) -> None:
        """Let go of the stage and its schedule, and of ``pp_dp``'s groups (``StepRunner``): with nothing left
        referring to the broken groups their sockets close, which frees a peer still blocked in one of them."""
        self.stage = self.schedule = None
        if self.layout.groups is not None:
            self.layout.groups.drop()

    def regroup(self) -> None:
        """In the re-formed world: ``pp_dp``'s groups formed again (every rank, in ``group_order``), then the stage
        and its schedule over them (``StepRunner``; one pipeline: over the world's group)."""
        if self.layout.groups is not None:
            self.layout.groups.form()
        self.reset()

    def make_stage(self, *args: Any, **kwargs: Any) -> PipelineStage:
        """torch's stage over the rank's module (``PipelineStage``'s arguments); a logging one with a log."""
        if self.log is None:
            from torch.distributed.pipelining import PipelineStage

            return PipelineStage(*args, **kwargs)
        from resilience.parallel.logged_stage import LoggingStage

        return LoggingStage(*args, log=self.log, **kwargs)

    def forward_backward(self, batch: tuple[torch.Tensor, ...], step: int | None = None) -> torch.Tensor:
        """The step's mean loss (``StepRunner``); ``step`` keys the log's entries (required with a log)."""
        if self.log is not None:
            if step is None:
                raise ValueError("a logging pipeline runner needs the step to key its log by")
            self.log.begin(step)
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        for part in self.run_schedule(batch):  # in micro-batch order: the same sum on every replay
            loss += part.detach()
        loss /= self.n
        dist.broadcast(loss, src=self.layout.pp_ranks[-1], group=self.layout.pp_group)
        return loss

    def clip_(self, params: list[torch.Tensor], max_norm: float) -> None:
        """Clip the stage's gradients to ``max_norm`` by the norm over every stage's (``train.clip_norm``); a logging
        runner keeps every stage's norm with the step's sends: a stage replayed alone clips by them."""
        norms = stage_norms(params, self.layout)
        if self.log is not None:
            self.log.record_norms(norms, max_norm)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, torch.nn.utils.get_total_norm(norms))

    def run_schedule(self, batch: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """The schedule's step on this stage: the first stage takes the inputs, the last the targets; the last
        stage's per-micro-batch losses (empty on the others)."""
        x, y = batch
        losses: list[torch.Tensor] = []
        if self.layout.first:
            self.schedule.step(x)
        elif self.layout.last:
            self.schedule.step(target=y, losses=losses, return_outputs=False)
        else:
            self.schedule.step()
        return losses
