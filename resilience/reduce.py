"""A gradient reduction whose result does not depend on DDP's bucket layout: bit-exact replay needs it.

DDP reduces gradients in buckets, and rebuilds the buckets after the first iteration of every process. A rank
restarted at step 10 therefore reduces step 10 with the initial layout, where the uninterrupted run had the
rebuilt one. With more than two ranks a ring all-reduce adds each element's contributions in an order set by
where the element falls in its bucket, so the sums differ in the last bits and the recovered run drifts away from
the reference. This hook all-gathers every rank's bucket and adds them in rank order: the same bits for any
layout. With two ranks a + b == b + a and DDP's own reduction is used.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

ReduceHook = Callable[[Any, Any], torch.futures.Future]


def ordered_sum_hook(process_group: Any, bucket: Any) -> torch.futures.Future:
    """DDP comm hook: mean of the ranks' buckets, summed in rank order."""
    buf = bucket.buffer()
    group = process_group if process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(buf) for _ in range(world)]
    work = dist.all_gather(gathered, buf, group=group, async_op=True)

    def finish(done: torch.futures.Future) -> torch.Tensor:
        done.value()  # re-raises a failed all-gather (a dead peer): never sum uninitialised buffers
        total = gathered[0].clone()
        for part in gathered[1:]:
            total += part
        return total.div_(world)

    return work.get_future().then(finish)


def reduce_hook_for(world_size: int) -> ReduceHook:
    """The reduction a run uses; an injector that hooks the reduction (grads_pre) must end in it too."""
    return ordered_sum_hook if world_size > 2 else default_hooks.allreduce_hook


def install(ddp: Any, world_size: int) -> ReduceHook:
    """Register the run's reduction on ``ddp`` if it is not DDP's own; return it."""
    hook = reduce_hook_for(world_size)
    if hook is ordered_sum_hook:
        ddp.register_comm_hook(None, _unannotated(hook))
    return hook


def _unannotated(hook: ReduceHook) -> Callable:
    # DDP checks a hook's annotations, which postponed evaluation turns into strings: wrap it plainly.
    def call(process_group, bucket):
        return hook(process_group, bucket)

    return call
