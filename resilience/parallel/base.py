"""The parallelism interface: how the bare model is wrapped for the ranks, and what it declares (``caps``).

``ddp`` replicates the whole model and state on every rank; ``fsdp`` shards parameters, gradients and optimizer
state over all ranks (FSDP2, ``torch.distributed.fsdp.fully_shard`` over a 1-D ``DeviceMesh``); ``hsdp`` shards
within groups and replicates across them (a 2-D mesh, ``replicate x shard``). See docs/sharded.md.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from resilience.caps import Named, ParallelCaps
from resilience.runtime.rank import ModelWrap

if TYPE_CHECKING:
    from injectors.base import Injector


class Parallelism(Named, ABC):
    """Wraps each rank's bare model; what that rules out is the table's (resilience.compat), from ``caps``."""

    caps = ParallelCaps()

    @abstractmethod
    def wrapper(self, device: torch.device, world_size: int, injector: Injector, in_place: bool) -> ModelWrap:
        """The rank's ``ModelWrap``: called with the bare model (once per attempt, again after an in-place
        recovery), it returns the model to train."""

    def shards(self, world_size: int) -> int:
        """Into how many shards each replica of the training state is split (1: every rank holds all of it)."""
        return 1
