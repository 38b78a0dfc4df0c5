"""Shrink: after losing a node with no spare, go on with the surviving ranks (elastic world size).

Every rank is stopped, as in ``restart``, and started again, but only the survivors' number: the failed ranks'
nodes (``ranks_per_node`` consecutive ranks each) are dropped. The ranks load the newest checkpoint resharded to
the new world size (DCP's load-time resharding: each rank reads the pieces of the saved shards that its new
shard covers) and train on. The run is then not bit-exact against the fault-free one by design: the global batch
is smaller (each rank draws its own batch) and the gradients are summed over fewer ranks (docs/sharded.md).
"""

from __future__ import annotations

from resilience.caps import PolicyCaps
from resilience.settings.checks import require_int
from resilience.recovery.base import RecoveryPolicy


class Shrink(RecoveryPolicy):
    """Silent corruption is recorded; a crash or hang restarts the ranks of the nodes that are left."""

    caps = PolicyCaps(resizes_world=True, of_setting={"min_world_size": "min_world_size"})

    def __init__(self, max_restarts: int, ranks_per_node: int = 1, min_world_size: int = 1) -> None:
        super().__init__(max_restarts)
        self.ranks_per_node = require_int("recovery.ranks_per_node", ranks_per_node, 1)
        self.min_world_size = require_int("recovery.min_world_size", min_world_size, 1)
        self.caps = self.caps.under(min_world_size=self.min_world_size)

    def world_after(self, world_size: int, failed: list[int]) -> int:
        """The world size to restart with when ``failed`` ranks (of ``world_size``) failed: their nodes are gone.
        Below ``min_world_size`` (or no failed rank named: a failure the supervisor could not place) the size
        stays, as ``restart`` would."""
        nodes = {rank // self.ranks_per_node for rank in failed}
        left = world_size - len(nodes) * self.ranks_per_node
        return left if failed and left >= self.min_world_size else world_size
