"""Hybrid sharded data parallelism: FSDP2 within each shard group, replicas across groups (a 2-D mesh).

``replicate`` groups of ``world_size / replicate`` ranks; rank ``r`` is shard ``r % shard`` of replica
``r // shard`` (``init_device_mesh``'s row-major layout). Gradients are reduce-scattered within the shard group
(in rank order, ``ordered.py``), then all-reduced across the replicas (gloo's all-reduce; with two replicas
``a + b == b + a``).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from resilience.checks import require_int
from resilience.parallel.fsdp import FullyShardedParallel


class HybridShardedParallel(FullyShardedParallel):

    def __init__(self, replicate: int = 2, reshard_after_forward: bool = True, reduce: str = "ordered") -> None:
        super().__init__(reshard_after_forward, reduce)
        self.replicate = self.replicas = require_int("parallel.replicate", replicate, 2)

    def mesh(self, device: torch.device, world_size: int) -> DeviceMesh:
        return init_device_mesh(device.type, (self.replicate, world_size // self.replicate),
                                mesh_dim_names=("replicate", "shard"))

    def check(self, world_size, workload, strategy, injector, detectors) -> None:
        if world_size % self.replicate or world_size // self.replicate < 2:
            raise ValueError(f"parallel.replicate={self.replicate}: world_size={world_size} must split into "
                             f"{self.replicate} replicas of at least 2 shards (e.g. world_size=4 parallel.replicate=2)")
        super().check(world_size, workload, strategy, injector, detectors)
        needs = getattr(strategy, "min_replicas", None)  # torchft's quorum counts replica groups: here, replicas
        if needs is not None and needs > self.replicate:
            raise ValueError(f"strategy.min_replicas={needs}: at most the {self.replicate} replica groups of "
                             f"parallel=hsdp (parallel.replicate={self.replicate})")
