"""Pipeline parallelism: the model cut into ``stages`` consecutive stages, one per rank, each step's batch cut into
``microbatches`` that flow through them under torch's schedule (``torch.distributed.pipelining``: 1F1B or GPipe).

Every rank builds the whole model from the seed and keeps its stage (``Workload.pipeline_stage``), so a stage's
parameters are the unsplit model's bit for bit; its optimizer holds that stage's state alone. The step itself is
``pp_runner.PipelineRunner``'s. See docs/pipeline_parallel.md.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

import torch
from torch import nn

from resilience.caps import ParallelCaps
from resilience.parallel.base import Parallelism
from resilience.parallel.pp_runner import SCHEDULES, PipelineRunner
from resilience.runtime.pipeline import Layout, make_layout
from resilience.runtime.rank import RankRuntime
from resilience.settings.checks import require_choice, require_int
from resilience.state.train import TrainState
from resilience.workloads.base import Workload

if TYPE_CHECKING:
    from injectors.base import Injector


class PipelineParallel(Parallelism):

    caps = ParallelCaps(stages=2, of_setting={"stages": "stages"})

    def __init__(self, stages: int = 2, microbatches: int = 4, schedule: str = "1f1b") -> None:
        self.stages = require_int("parallel.stages", stages, 2)
        self.microbatches = require_int("parallel.microbatches", microbatches, 1)
        self.schedule = require_choice("parallel.schedule", schedule, SCHEDULES)
        if schedule == "1f1b" and microbatches < stages:  # its warm-up holds one micro-batch per stage
            raise ValueError(f"parallel.microbatches={microbatches}: parallel.schedule=1f1b needs at least "
                             f"parallel.stages={stages}")
        self.caps = self.caps.under(stages=self.stages)

    def shards(self, world_size: int) -> int:
        return self.stages

    def check_workload(self, workload: Workload, world_size: int) -> None:
        batch = workload.batch_size
        if batch % self.microbatches:  # equal micro-batches: the stages' shapes are static
            raise ValueError(f"parallel.microbatches={self.microbatches}: must divide workload.batch_size={batch}")
        with torch.device("meta"):  # the cut itself says what it cannot do (too few layers), before launch
            workload.pipeline_stage(workload.build_model(), 0, self.stages)

    def layout(self, rank: int, world_size: int, timeout: timedelta | None = None) -> Layout:
        return make_layout(rank, world_size, self.stages)  # one pipeline: the world's group, no group to form

    def wrapper(self, device: torch.device, world_size: int, injector: Injector, in_place: bool,
                workload: Workload | None = None, layout: Layout | None = None) -> StageWrapper:
        assert workload is not None and layout is not None, "the rank hands a pipeline its workload and layout"
        return StageWrapper(workload, layout)

    def step_runner(self, rt: RankRuntime, state: TrainState, workload: Workload) -> PipelineRunner:
        assert rt.layout is not None
        return PipelineRunner(state.model, rt.layout, workload, rt.device, self.microbatches, self.schedule)


class StageWrapper:
    """Keeps the rank's stage of the bare model: the rest of it is dropped with the call."""

    def __init__(self, workload: Workload, layout: Layout) -> None:
        self.workload, self.layout = workload, layout

    def __call__(self, module: nn.Module) -> nn.Module:
        return self.workload.pipeline_stage(module, self.layout.stage, self.layout.stages)
