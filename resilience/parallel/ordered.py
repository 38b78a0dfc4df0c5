"""FSDP2's reduce-scatter with every element summed in rank order: the same bits on any backend and any run.

FSDP2 flattens each sharded unit's gradients into one buffer whose layout is fixed when the unit is built (no
rebuild after the first step, unlike DDP's buckets), so a restarted rank reduces with the same layout. What is
left is the order in which a collective adds the ranks' contributions: gloo's and NCCL's algorithms choose it
(by message size, topology, channels). Here an all-to-all hands rank ``j`` every rank's copy of shard ``j`` and
the sum is taken locally, ``part[0] + part[1] + ... + part[W-1]``, then divided by ``W`` for a mean: the order
``resilience.runtime.reduce`` uses for DDP (docs/sharded.md).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from resilience.record.torch_workarounds import declare

ORDERED_REDUCE = declare(
    "fsdp_custom_reduce_scatter", "FSDPModule.set_custom_reduce_scatter takes a ReduceScatter, whose interface "
    "torch defines in the private torch.distributed.fsdp._fully_shard._fsdp_api", ("2.13.0",), __name__)


class OrderedReduceScatter(ReduceScatter):
    """A ``ReduceScatter`` comm for ``FSDPModule.set_custom_reduce_scatter`` (SUM or AVG, summed in rank order)."""

    def __init__(self) -> None:
        ORDERED_REDUCE.acted()  # FSDP reduces through it from here on; the rank declares it (declare_acted)
        super().__init__()

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False) -> None:
        world = dist.get_world_size(group)
        parts = torch.empty_like(input_tensor)
        dist.all_to_all_single(parts, input_tensor, group=group)  # FSDP pads the input to a multiple of world
        by_rank = parts.view(world, -1)
        output_tensor.copy_(by_rank[0])
        for part in by_rank[1:]:
            output_tensor += part
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(world)
        elif op != dist.ReduceOp.SUM:
            raise ValueError(f"reduce-scatter op {op}: only SUM and AVG are summed in rank order")
        return None
