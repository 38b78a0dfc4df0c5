"""The parallelism interface: how the bare model is wrapped for the ranks, and what it declares (``caps``).

``ddp`` replicates the whole model and state on every rank; ``fsdp`` shards parameters, gradients and optimizer
state over all ranks (FSDP2, ``torch.distributed.fsdp.fully_shard`` over a 1-D ``DeviceMesh``); ``hsdp`` shards
within groups and replicates across them (a 2-D mesh, ``replicate x shard``); ``pp`` cuts the model into pipeline
stages, one per rank, and runs each step's micro-batches through torch's schedule; ``pp_dp`` replicates that
pipeline, data parallel across the copies. See docs/sharded.md and docs/pipeline_parallel.md.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from datetime import timedelta
from typing import TYPE_CHECKING

import torch

from resilience.caps import Named, ParallelCaps
from resilience.runtime.pipeline import Layout, StepRunner
from resilience.runtime.rank import ModelWrap, RankRuntime
from resilience.state.train import TrainState
from resilience.workloads.base import Workload

if TYPE_CHECKING:
    from injectors.base import Injector


class Parallelism(Named, ABC):
    """Wraps each rank's bare model; what that rules out is the table's (resilience.compat), from ``caps``."""

    caps = ParallelCaps()

    @abstractmethod
    def wrapper(self, device: torch.device, world_size: int, injector: Injector, in_place: bool,
                workload: Workload | None = None, layout: Layout | None = None) -> ModelWrap:
        """The rank's ``ModelWrap``: called with the bare model (once per attempt, again after an in-place
        recovery), it returns the model to train (under a pipeline: the rank's stage of ``workload``'s model)."""

    def shards(self, world_size: int) -> int:
        """Into how many shards each replica of the training state is split (1: every rank holds all of it)."""
        return 1

    def check_workload(self, workload: Workload, world_size: int) -> None:
        """Before launch: a ``ValueError`` naming the setting where ``workload`` cannot be spread this way."""

    def layout(self, rank: int, world_size: int, timeout: timedelta | None = None) -> Layout | None:
        """The pipeline stage ``rank`` holds, once the world's group is formed (None: not pipelined); the groups it
        forms wait ``timeout`` for a peer (the collective timeout)."""
        return None

    def step_runner(self, rt: RankRuntime, state: TrainState, workload: Workload) -> StepRunner | None:
        """What runs a step's forward and backward in place of the loop's own (None: the loop's)."""
        return None
