"""Hybrid sharded data parallelism: FSDP2 within each shard group, replicas across groups (a 2-D mesh).

``replicate`` groups of ``world_size / replicate`` ranks; rank ``r`` is shard ``r % shard`` of replica
``r // shard`` (``init_device_mesh``'s row-major layout). Gradients are reduce-scattered within the shard group
(in rank order, ``ordered.py``), then all-reduced across the replicas (gloo's all-reduce; with two replicas
``a + b == b + a``).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from resilience.settings.checks import require_int
from resilience.parallel.fsdp import FullyShardedParallel


class HybridShardedParallel(FullyShardedParallel):

    caps = replace(FullyShardedParallel.caps, replicas=2, of_setting={"replicas": "replicate"})

    def __init__(self, replicate: int = 2, reshard_after_forward: bool = True, reduce: str = "ordered") -> None:
        super().__init__(reshard_after_forward, reduce)
        self.replicate = require_int("parallel.replicate", replicate, 2)
        self.caps = self.caps.under(replicate=self.replicate)

    def mesh(self, device: torch.device, world_size: int) -> DeviceMesh:
        return init_device_mesh(device.type, (self.replicate, world_size // self.replicate),
                                mesh_dim_names=("replicate", "shard"))
