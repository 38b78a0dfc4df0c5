"""A gradient reduction whose result does not depend on DDP's bucket layout: bit-exact replay needs it.

DDP reduces gradients in buckets, and rebuilds the buckets after the first iteration of every process. A rank
restarted at step 10 therefore reduces step 10 with the initial layout, where the uninterrupted run had the
rebuilt one. With more than two ranks a ring all-reduce adds each element's contributions in an order set by
where the element falls in its bucket, so the sums differ in the last bits and the recovered run drifts away from
the reference. This hook adds every element's contributions in rank order instead: the same bits for any layout.
With two ranks a + b == b + a and DDP's own reduction is used.

How (a reduce-scatter in fixed rank order, then an all-gather of the reduced shards): the bucket is cut into
``world`` equal shards (zero-padded); an all-to-all gives rank ``j`` every rank's copy of shard ``j``, which it adds
in rank order (``part[0] + part[1] + ... + part[W-1]``, then divides by ``W``: per element exactly what an
all-gather of whole buckets summed in rank order computes, so every result bit is the same as with that simpler
hook); an all-gather then gives every rank every reduced shard. Each rank sends and receives ``2 (W-1)/W`` of the
bucket, as a ring all-reduce does, where the all-gather of whole buckets cost ``(W-1)`` buckets
(``python -m resilience.bench.reduction`` measures both).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

# torch 2.13 names the all-gather into one tensor all_gather_single (the old all_gather_into_tensor, deprecated
# there, calls it); an older torch, a GPU machine's own (make gpu-check, docs/gpu.md), has only the old name
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

ReduceHook = Callable[[Any, Any], torch.futures.Future]


def ordered_sum_hook(process_group: Any, bucket: Any) -> torch.futures.Future:
    """DDP comm hook: mean of the ranks' buckets, each element summed in rank order (reduce-scatter, all-gather)."""
    buf = bucket.buffer()
    group = process_group if process_group is not None else dist.group.WORLD
    n = buf.numel()
    # Blocking on purpose: the all-gather below must be issued from this thread, in the same order on every rank;
    # issuing it from the all-to-all's completion callback could interleave it with the next bucket's collectives.
    mine, padded = _own_shard_mean(buf.reshape(-1), group)
    total = torch.empty_like(padded)
    work = all_gather_single(total, mine, group=group, async_op=True)

    def finish(done: torch.futures.Future) -> torch.Tensor:
        done.value()  # re-raises a failed all-gather (a dead peer)
        return total[:n].view_as(buf)

    return work.get_future().then(finish)


def ordered_mean(flat: torch.Tensor, group: Any) -> torch.Tensor:
    """The mean of every rank's 1-D ``flat`` over ``group``, each element summed in rank order: ``ordered_sum_hook``
    outside DDP (``parallel=pp_dp`` averages each stage's gradients over its replicas with it)."""
    mine, padded = _own_shard_mean(flat, group)
    total = torch.empty_like(padded)
    all_gather_single(total, mine, group=group)
    return total[:flat.numel()]


def _own_shard_mean(flat: torch.Tensor, group: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's shard of the mean of ``flat`` over ``group`` (summed in rank order), and ``flat`` zero-padded to
    a multiple of the group's size."""
    world = dist.get_world_size(group)
    n = flat.numel()
    shard = -(-n // world)
    padded = flat if shard * world == n else torch.cat([flat, flat.new_zeros(shard * world - n)])
    parts = torch.empty_like(padded)
    dist.all_to_all_single(parts, padded, group=group)  # a dead peer raises here: never sum uninitialised buffers
    by_rank = parts.view(world, shard)
    mine = by_rank[0].clone()
    for part in by_rank[1:]:
        mine += part
    return mine.div_(world), padded


def gathered_sum_hook(process_group: Any, bucket: Any) -> torch.futures.Future:
    """The former reduction (all-gather whole buckets, sum in rank order): the reference the tests and the
    benchmark compare ``ordered_sum_hook`` with, bit for bit and byte for byte."""
    buf = bucket.buffer()
    group = process_group if process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(buf) for _ in range(world)]
    work = dist.all_gather(gathered, buf, group=group, async_op=True)

    def finish(done: torch.futures.Future) -> torch.Tensor:
        done.value()
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
