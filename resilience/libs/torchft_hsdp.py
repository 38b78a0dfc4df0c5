"""torchft's HSDP recipe for ``replica_torchft`` under ``parallel=hsdp``: a replica group is a replica of the shards.

Rank ``r`` is shard ``r % S`` of replica group ``r // S`` (the layout of ``resilience.parallel.hsdp``). As in
torchft's own FSDP test, each replica group is a ``torch.distributed`` world of its own: FSDP2 shards the model
over it (our ``fsdp`` wrapper, so the reduce-scatter is the same ordered one), and FSDP's all-reduce hook averages
each reduce-scattered gradient shard across the groups through the Manager's process group (shard ``s`` of one
group with shard ``s`` of the others). A group that is behind heals shard by shard: each of its ranks receives
its own shard, model and optimizer, from the same shard rank of an up-to-date group.

A rank's shard group cannot lose a member and go on, so when one rank dies its group's other ranks fail in their
next FSDP collective and are restarted too: torchft restarts a whole replica group, never one rank of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from resilience.state.train import map_tensors

if TYPE_CHECKING:
    from resilience.parallel.base import Parallelism

KEY = "torchft_hsdp"  # the prefix of this module's keys on the supervisor's store


@dataclass(frozen=True)
class ReplicaGroups:
    """Which replica group a rank belongs to and which shard it holds (``shard`` = 1: data parallel, a group each)."""

    rank: int
    world_size: int
    shard: int = 1

    @property
    def group(self) -> int:
        return self.rank // self.shard

    @property
    def local(self) -> int:
        return self.rank % self.shard

    @property
    def count(self) -> int:
        return self.world_size // self.shard

    @classmethod
    def of(cls, parallel: Parallelism, rank: int, world_size: int) -> ReplicaGroups:
        """The groups of a parallel setting: under hsdp a group per replica of the shards, else a group per rank."""
        caps = parallel.caps
        if not caps.shards_state:
            return cls(rank, world_size)
        return cls(rank, world_size, world_size // caps.replicas)


class GroupWorld:
    """The replica group's own default process group and the store its Manager needs, on the supervisor's store.

    Each start of the group's ranks is a new *incarnation*: every joining rank counts itself in, so the ranks of
    one start (first ones or replacements) meet under the same keys whatever order they come in."""

    def __init__(self, groups: ReplicaGroups, store: dist.Store, backend: str, timeout: timedelta) -> None:
        self.groups, self.store, self.backend, self.timeout = groups, store, backend, timeout
        joined = store.add(f"{KEY}/group{groups.group}/joins", 1)
        self.prefix = f"{KEY}/group{groups.group}/incarnation{(joined - 1) // groups.shard}/"
        self._manager_store: dist.TCPStore | None = None

    def join(self) -> None:
        """Replace this rank's world of one (``RankGroup`` with ``solo``) by the group's world."""
        g = self.groups
        dist.destroy_process_group()
        dist.init_process_group(self.backend, store=dist.PrefixStore(self.prefix, self.store), rank=g.local,
                                world_size=g.shard, timeout=self.timeout)

    def manager_store_port(self) -> int:
        """The group's store for torchft's Manager: hosted by its shard 0, its port published to the others."""
        key = f"{self.prefix}manager_store_port"
        if self.groups.local == 0:
            self._manager_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                                timeout=self.timeout)
            self.store.set(key, str(self._manager_store.port))
        return int(self.store.get(key))


def shard_model(module: nn.Module, parallel: Any, device: torch.device, shard: int) -> nn.Module:
    """FSDP2 over the group's world (a 1-D mesh of its ``shard`` ranks), as ``parallel=fsdp`` shards it."""
    from resilience.parallel.fsdp import FSDPWrapper, FullyShardedParallel

    one_dim = FullyShardedParallel(parallel.reshard_after_forward, parallel.reduce)
    return FSDPWrapper(one_dim, device, shard)(module)


def set_all_reduce_hooks(module: nn.Module, manager: Any) -> None:
    """Average each reduce-scattered gradient shard across the replica groups through torchft (fp32: FSDP has
    already divided by the shard count, the Manager divides the sum by the groups in the quorum)."""
    from torch.distributed.fsdp import FSDPModule

    def across_groups(grad_shard: torch.Tensor) -> None:
        # A failed all-reduce does not raise: the Manager records it, and the commit vote drops the step.
        manager.allreduce(grad_shard).wait()

    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.set_all_reduce_hook(across_groups)


def local_shards(sd: dict[str, Any]) -> dict[str, Any]:
    """This rank's shards as plain tensors (what the heal sends: one shard, no device mesh to unpickle)."""
    from torch.distributed.tensor import DTensor

    return map_tensors(lambda t: t.to_local() if isinstance(t, DTensor) else t, sd)


def load_local_shards(module: nn.Module, optimizer: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
    """Copy a peer's shards (``local_shards``) into this rank's sharded model and optimizer state."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for name, value in module.state_dict().items():
            (value.to_local() if isinstance(value, DTensor) else value).copy_(sd["model"][name])
    params = [p for group in optimizer.param_groups for p in group["params"]]
    optim = sd["optim"]
    for index, entry in optim["state"].items():
        p = params[index]
        if not isinstance(p, DTensor):
            continue
        for key, value in entry.items():  # Adam's moments are sharded like their parameter; its step is not
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == p.to_local().shape:
                entry[key] = DTensor.from_local(value, p.device_mesh, p.placements, run_check=False,
                                                shape=p.shape, stride=p.stride())
    optimizer.load_state_dict(optim)
