"""Fully sharded data parallelism (FSDP2): parameters, gradients and optimizer state sharded over every rank.

``torch.distributed.fsdp.fully_shard`` is applied to each element of the model's ``nn.ModuleList``s (the
transformer blocks: one all-gather and one reduce-scatter per block) and then to the root (the rest). The
parameters become ``DTensor``s; ``get_state_dict`` gives each rank its shards, which DCP writes in parallel.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from resilience.checks import require_bool, require_choice
from resilience.parallel.base import Parallelism, model_on_meta
from resilience.parallel.ordered import OrderedReduceScatter

REDUCE = ("ordered", "library")


class FullyShardedParallel(Parallelism):

    shards_state = True
    replicas = 1  # how many ranks hold each shard (hsdp: parallel.replicate)

    def __init__(self, reshard_after_forward: bool = True, reduce: str = "ordered") -> None:
        self.reshard_after_forward = require_bool("parallel.reshard_after_forward", reshard_after_forward)
        self.reduce = require_choice("parallel.reduce", reduce, REDUCE)

    def mesh(self, device: torch.device, world_size: int) -> DeviceMesh:
        """The mesh the model is sharded over: one dimension, every rank."""
        return init_device_mesh(device.type, (world_size,), mesh_dim_names=("shard",))

    def check(self, world_size, workload, strategy, injector, detectors) -> None:
        name = self.name
        sparse = [n for n, m in model_on_meta(workload).named_modules() if isinstance(m, nn.Embedding) and m.sparse]
        if sparse:
            raise ValueError(f"parallel={name}: the workload's embeddings have sparse gradients ({sparse[0]}, ...), "
                             f"which FSDP's reduce-scatter cannot shard; use parallel=ddp")
        if strategy.saves and not strategy.handles_sharded_state():
            raise ValueError(f"parallel={name}: strategy={strategy.name} does not save sharded state "
                             f"({strategy.sharded_refusal()}); use strategy=sync, async, inmemory, dlrover_flash, "
                             f"nvrx_async, nvrx_async_dcp or dcp_async (executor=thread)")
        if strategy.recovers_in_place and not strategy.handles_sharded_state():
            raise ValueError(f"parallel={name}: strategy={strategy.name} recovers in place with whole-model state "
                             f"(strategy=replica moves shards with while_replacing=wait); use parallel=ddp")
        if strategy.recovers_in_place and self.replicas < 2:
            raise ValueError(f"parallel={name}: strategy={strategy.name} takes a lost rank's state from a replica, "
                             f"and {name} holds each shard once; use parallel=hsdp or a strategy that checkpoints")
        if injector.hooks_reduction or injector.name == "bitflip":
            raise ValueError(f"parallel={name}: fault={injector.name} reaches into DDP's module and reduction, which "
                             f"a sharded model has not; use parallel=ddp")
        crossing = [d.name for d in detectors if d.compares_ranks]
        if crossing:
            raise ValueError(f"parallel={name}: detector={','.join(crossing)} compares the ranks' states, which are "
                             f"different shards here; leave it out of the detector list")

    def shards(self, world_size: int) -> int:
        return world_size // self.replicas

    def wrapper(self, device: torch.device, world_size: int, injector, in_place: bool) -> FSDPWrapper:
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
