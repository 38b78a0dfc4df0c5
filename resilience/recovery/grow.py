"""Grow: shrink after a node loss, then take the node back at the next checkpoint boundary once it has returned.

After the loss the run goes on with the survivors exactly as under ``shrink``. The lost node returns
``fault.return_after_s`` seconds after the loss (``fault=node_loss``). The job does not stop for it at once: the
ranks train on until the next checkpoint is committed, so that nothing trained on the small world is lost, and
then the supervisor restarts every rank at the full world size; each loads that checkpoint resharded back up
(DCP's load-time resharding, as for the shrink) and training goes on to the end. Taking the node back only at a
checkpoint boundary is what elastic jobs do when a restart is the only way to change the world (TorchElastic's
membership change; Varuna, Athlur et al., EuroSys'22, reconfigures at checkpoints too).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from resilience.settings.checks import require_number
from resilience.recovery.shrink import Shrink

if TYPE_CHECKING:
    from injectors.base import Injector


class Grow(Shrink):
    """``shrink`` on a failure; ``take_back`` names the checkpoint at which the returned node rejoins."""

    caps = replace(Shrink.caps, grows_back=True)

    def __init__(self, max_restarts: int, ranks_per_node: int = 1, min_world_size: int = 1,
                 return_after_s: float | None = None) -> None:
        super().__init__(max_restarts, ranks_per_node, min_world_size)
        if return_after_s is None:
            raise ValueError("recovery=grow: takes a lost node back when it returns, and none does; use "
                             "fault=node_loss with fault.return_after_s=SECONDS (or recovery=shrink)")
        self.return_after_s = require_number("fault.return_after_s", return_after_s, at_least=0)
        self.lost_at: float | None = None  # t_mono of the loss being waited out (its fault_injected record)

    def caveats(self, injector: Injector) -> list[str]:
        return []  # the node's return is what this policy acts on

    def take_back(self, event: dict[str, Any]) -> int | None:
        """Follow the run's events in order while the world is shrunk: the step of the first checkpoint committed
        after the lost node returned, once (then the next loss is waited out afresh); else None."""
        if event["kind"] == "fault_injected" and self.lost_at is None:
            self.lost_at = event["t_mono"]  # every rank of the node records the same loss: the first counts
        elif event["kind"] == "ckpt_durable" and self.returned(event["t_mono"]):
            self.lost_at = None
            return int(event["step"])
        return None

    def returned(self, now: float) -> bool:
        """Whether the lost node is back at ``now`` (monotonic seconds)."""
        return self.lost_at is not None and now >= self.lost_at + self.return_after_s

