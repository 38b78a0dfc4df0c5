"""Fully sharded data parallelism (FSDP2): parameters, gradients and optimizer state sharded over every rank.

``torch.distributed.fsdp.fully_shard`` is applied to each element of the model's ``nn.ModuleList``s (the
transformer blocks: one all-gather and one reduce-scatter per block) and then to the root (the rest). The
parameters become ``DTensor``s; ``get_state_dict`` gives each rank its shards, which DCP writes in parallel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from resilience.caps import ParallelCaps
from resilience.settings.checks import require_bool, require_choice
from resilience.parallel.base import Parallelism
from resilience.parallel.ordered import ORDERED_REDUCE, OrderedReduceScatter

if TYPE_CHECKING:
    from injectors.base import Injector

REDUCE = ("ordered", "library")


class FullyShardedParallel(Parallelism):

    caps = ParallelCaps(shards_state=True, replicas=1)  # each shard once (hsdp: parallel.replicate times)

    def __init__(self, reshard_after_forward: bool = True, reduce: str = "ordered") -> None:
        self.reshard_after_forward = require_bool("parallel.reshard_after_forward", reshard_after_forward)
        self.reduce = require_choice("parallel.reduce", reduce, REDUCE)
        if self.reduce == "ordered":  # before launch, in one line, on a torch it was not checked on
            ORDERED_REDUCE.check()

    def mesh(self, device: torch.device, world_size: int) -> DeviceMesh:
        """The mesh the model is sharded over: one dimension, every rank."""
        return init_device_mesh(device.type, (world_size,), mesh_dim_names=("shard",))

    def shards(self, world_size: int) -> int:
        return world_size // self.caps.replicas

    def wrapper(self, device: torch.device, world_size: int, injector: Injector, in_place: bool,
                workload: Any = None, layout: Any = None) -> FSDPWrapper:
        return FSDPWrapper(self, device, world_size)


class FSDPWrapper:
    """Shards the bare model over this run's mesh (built anew for each attempt's process group)."""

    def __init__(self, parallel: FullyShardedParallel, device: torch.device, world_size: int) -> None:
        self.parallel, self.device, self.world_size = parallel, device, world_size

    def __call__(self, module: nn.Module) -> nn.Module:
        p = self.parallel
        mesh = p.mesh(self.device, self.world_size)
        for block in [b for m in module.modules() if isinstance(m, nn.ModuleList) for b in m]:
            fully_shard(block, mesh=mesh, reshard_after_forward=p.reshard_after_forward)
        fully_shard(module, mesh=mesh, reshard_after_forward=p.reshard_after_forward)
        if p.reduce == "ordered":
            for unit in module.modules():
                if isinstance(unit, FSDPModule):
                    unit.set_custom_reduce_scatter(OrderedReduceScatter())
        return module
