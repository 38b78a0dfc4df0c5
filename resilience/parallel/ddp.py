"""Data parallelism: every rank holds the whole model and state; gradients reduced in rank order (``reduce.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from resilience.parallel.base import Parallelism
from resilience.runtime.reduce import install as install_reduce

if TYPE_CHECKING:
    from injectors.base import Injector


class DataParallel(Parallelism):

    def wrapper(self, device: torch.device, world_size: int, injector: Injector, in_place: bool,
                workload: Any = None, layout: Any = None) -> DDPWrapper:
        return DDPWrapper(device, world_size, injector, in_place)


class DDPWrapper:
    """Wraps the bare model in DDP over the current group, with the run's gradient reduction."""

    def __init__(self, device: torch.device, world_size: int, injector: Injector, in_place: bool) -> None:
        self.device, self.world_size, self.injector, self.in_place = device, world_size, injector, in_place

    def __call__(self, module: torch.nn.Module) -> DDP:
        device = self.device
        # In place, survivors and replacement may hold different states until the strategy reconciles them:
        # DDP must not broadcast rank 0's parameters over them (at generation 0 all are equal anyway).
        ddp = DDP(module, device_ids=[device.index] if device.type == "cuda" else None, init_sync=not self.in_place)
        if self.injector.hooks_reduction:  # an injector that hooks the reduction ends in the same one itself
            self.injector.hook_reduction(ddp)
        else:
            install_reduce(ddp, self.world_size)
        return ddp
