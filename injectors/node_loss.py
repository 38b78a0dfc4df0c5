"""Node loss: every rank of one simulated node dies at once, with what that node held in memory for recovery.

Stands for a host, PSU or network failure, which takes a whole machine's ranks and RAM with it. With
``return_after_s`` the node comes back that many seconds after the loss (repaired, rebooted, reconnected): its
ranks can be started again, which ``recovery=grow`` does at the next checkpoint boundary. The return is the
supervisor's to act on (it reads the setting through the recovery policy); the ranks only record it with the fault.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from injectors.kill import Kill
from injectors.striker import wait_gone
from resilience.settings.checks import require_int, require_number


class NodeLoss(Kill):
    """Kills every rank of the simulated node that holds ``fault.rank`` (ranks grouped by ``ranks_per_node``)."""

    caps = replace(Kill.caps, of_setting={"returns_after_s": "return_after_s"})

    def __init__(self, ranks_per_node: int = 1, return_after_s: float | None = None, **kw: Any) -> None:
        super().__init__(**kw)
        self.ranks_per_node = require_int("ranks_per_node", ranks_per_node, 1)  # the run's (conf/config.yaml)
        # None: the node never returns (the job goes on without it or waits for a spare)
        self.return_after_s = None if return_after_s is None else require_number(
            "fault.return_after_s", return_after_s, at_least=0)
        if self.listed and self.return_after_s is not None:  # recovery=grow waits out one lost node at a time
            raise ValueError(f"fault.return_after_s={return_after_s}: a returning node is planned for one loss; with "
                             f"a list in fault.at_step give fault.return_after_s=null")
        self.caps = self.caps.under(return_after_s=self.return_after_s)

    def validate(self, world_size: int, steps: int, ckpt_every: int | None) -> None:
        super().validate(world_size, steps, ckpt_every)
        if world_size % self.ranks_per_node:
            raise ValueError(f"ranks_per_node={self.ranks_per_node}: must divide world_size={world_size}")
        self.world_size = world_size

    def node(self) -> int:
        return self.rank // self.ranks_per_node

    def targets(self) -> set[int]:
        first = self.node() * self.ranks_per_node
        return set(range(first, first + self.ranks_per_node))

    def _plan_detail(self, step: int) -> dict[str, Any]:
        return {**super()._plan_detail(step), "node": self.node(), "node_ranks": sorted(self.targets()),
                "return_after_s": self.return_after_s}

    def _act(self, step: int) -> None:
        if self.rt.node_memory is not None:
            self.rt.node_memory.destroy(self.node())  # the node's RAM is gone with it
        super()._act(step)

    def act_on(self, pid: int) -> None:
        """From another process: the rank first, then, once it has stopped, the node's memory (no thread of the rank
        writes into it after the wipe)."""
        super().act_on(pid)
        if self.rt.node_memory is not None:
            wait_gone(pid)
            self.rt.node_memory.destroy(self.node())
