"""Shrink: after losing a node with no spare, go on with the surviving ranks (elastic world size).

Every rank is stopped, as in ``restart``, and started again, but only the survivors' number: the failed ranks'
nodes (``ranks_per_node`` consecutive ranks each) are dropped. The ranks load the newest checkpoint resharded to
the new world size (DCP's load-time resharding: each rank reads the pieces of the saved shards that its new
shard covers) and train on. The run is then not bit-exact against the fault-free one by design: the global batch
is smaller (each rank draws its own batch) and the gradients are summed over fewer ranks (docs/sharded.md).
"""

from __future__ import annotations

from typing import Any

from resilience.checks import require_int
from resilience.recovery.base import RecoveryPolicy


class Shrink(RecoveryPolicy):
    """Silent corruption is recorded; a crash or hang restarts the ranks of the nodes that are left."""

    def __init__(self, max_restarts: int, ranks_per_node: int = 1, min_world_size: int = 1) -> None:
        super().__init__(max_restarts)
        self.ranks_per_node = require_int("recovery.ranks_per_node", ranks_per_node, 1)
        self.min_world_size = require_int("recovery.min_world_size", min_world_size, 1)

    def world_after(self, world_size: int, failed: list[int]) -> int:
        """The world size to restart with when ``failed`` ranks (of ``world_size``) failed: their nodes are gone.
        Below ``min_world_size`` (or no failed rank named: a failure the supervisor could not place) the size
        stays, as ``restart`` would."""
        nodes = {rank // self.ranks_per_node for rank in failed}
        left = world_size - len(nodes) * self.ranks_per_node
        return left if failed and left >= self.min_world_size else world_size

    def check_resharding(self, world_size: int, roles: Any) -> None:
        """Refuse sharded state with a strategy whose load does not reshard: its snapshots hold each old rank's
        shards, and a survivor of another number would load the wrong one, silently (no bit-exact check applies
        across world sizes). Data-parallel state is whole on every rank and fits any size."""
        strategy = roles.strategy
        if roles.parallel.shards_state and not reshards_on_load(strategy):
            raise ValueError(f"recovery={self.name}: loads the checkpoint resharded to fewer ranks, which "
                             f"strategy={strategy.name} cannot under parallel={roles.parallel.name} (its load holds "
                             f"each old rank's shard); use strategy=sync or strategy=dcp_async (executor=thread)")


def reshards_on_load(strategy: Any) -> bool:
    """Whether every load of ``strategy`` is ``sync``'s, DCP's read of the checkpoint files, which reshards to any
    world size. A load of its own (``inmemory``'s snapshots in the ranks' memory) holds each old rank's shards,
    which do not fit a world of another size."""
    from resilience.strategies.sync import SyncCheckpoint  # torch: only once a configuration is checked

    return isinstance(strategy, SyncCheckpoint) and type(strategy)._load is SyncCheckpoint._load
