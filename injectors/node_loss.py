"""Node loss: every rank of one simulated node dies at once, with what that node held in memory for recovery.

Stands for a host, PSU or network failure, which takes a whole machine's ranks and RAM with it.
"""

from __future__ import annotations

from typing import Any

from injectors.kill import Kill
from resilience.checks import require_int


class NodeLoss(Kill):
    """Kills every rank of the simulated node that holds ``fault.rank`` (ranks grouped by ``ranks_per_node``)."""


    def __init__(self, ranks_per_node: int = 1, **kw: Any) -> None:
        super().__init__(**kw)
        self.ranks_per_node = require_int("fault.ranks_per_node", ranks_per_node, 1)

    def validate(self, world_size: int, steps: int, ckpt_every: int | None) -> None:
        super().validate(world_size, steps, ckpt_every)
        if world_size % self.ranks_per_node:
            raise ValueError(f"fault.ranks_per_node={self.ranks_per_node}: must divide world_size={world_size}")
        self.world_size = world_size

    def node(self) -> int:
        return self.rank // self.ranks_per_node

    def targets(self) -> set[int]:
        first = self.node() * self.ranks_per_node
        return set(range(first, first + self.ranks_per_node))

    def _plan_detail(self, step: int) -> dict[str, Any]:
        return {**super()._plan_detail(step), "node": self.node(), "node_ranks": sorted(self.targets())}

    def _act(self, step: int) -> None:
        if self.rt.node_memory is not None:
            self.rt.node_memory.destroy(self.node())  # the node's RAM is gone with it
        super()._act(step)
