"""The parallelism interface: how the bare model is wrapped for the ranks, and what that rules out.

``ddp`` replicates the whole model and state on every rank; ``fsdp`` shards parameters, gradients and optimizer
state over all ranks (FSDP2, ``torch.distributed.fsdp.fully_shard`` over a 1-D ``DeviceMesh``); ``hsdp`` shards
within groups and replicates across them (a 2-D mesh, ``replicate x shard``). See docs/sharded.md.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch
from torch import nn

from resilience.named import Named

if TYPE_CHECKING:
    from injectors.base import Injector
    from resilience.detectors.base import Detector
    from resilience.strategies.base import CheckpointStrategy
    from resilience.workloads.base import Workload


class Parallelism(Named, ABC):
    """Wraps each rank's bare model; ``shards_state``: each rank holds only a shard of the training state."""

    shards_state: bool = False

    @abstractmethod
    def wrapper(self, device: torch.device, world_size: int, injector: Injector, in_place: bool):
        """The rank's ``ModelWrap``: called with the bare model (once per attempt, again after an in-place
        recovery), it returns the model to train."""

    def check(self, world_size: int, workload: Workload, strategy: CheckpointStrategy, injector: Injector,
              detectors: list[Detector]) -> None:
        """Raise ``ValueError`` naming the setting when this parallelism cannot run with the other roles."""

    def shards(self, world_size: int) -> int:
        """Into how many shards each replica of the training state is split (1: every rank holds all of it)."""
        return 1


def model_on_meta(workload: Workload) -> nn.Module:
    """The workload's model built without memory (on the meta device): its structure, for validation."""
    with torch.device("meta"):
        return workload.build_model()
