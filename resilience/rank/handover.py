"""A node maintenance notice inside a rank (``fault=drain``): the node's ranks get ``SIGUSR2`` some seconds before
the node goes; at the end of every step the ranks agree which of them got it (one all-reduce of a flag per rank:
the signal reaches the node's ranks at different moments, and the move is collective). Then the leaving ranks end
(``DRAIN_EXIT``), the supervisor hands their ranks to warm spares, and the ranks that stay take the spares into a
new group and give them the state (``CheckpointStrategy.hand_over``): no step is rolled back.
"""

from __future__ import annotations

import signal
import time

import torch
import torch.distributed as dist

from injectors.drain import NOTICE_SIGNAL



class Drained(Exception):
    """Every rank agreed that this one leaves its node; it ends (``DRAIN_EXIT``)."""


class MaintenanceNotice:
    """Notes the first maintenance notice; ``leaving`` tells every rank, at the same step, which ranks got one."""

    def __init__(self, rank: int, world_size: int, device: torch.device) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        self.at: float | None = None  # time.monotonic() of the notice on this rank
        self._previous = signal.signal(NOTICE_SIGNAL, self._note)

    def _note(self, signum: int, frame: object) -> None:
        if self.at is None:
            self.at = time.monotonic()

    def leaving(self) -> list[int]:
        """Collective: the ranks that have had the notice (every rank calls it at the end of the same step)."""
        flags = torch.zeros(self.world_size, dtype=torch.int32, device=self.device)
        flags[self.rank] = 0 if self.at is None else 1
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return [r for r, f in enumerate(flags.tolist()) if f]

    def close(self) -> None:
        signal.signal(NOTICE_SIGNAL, self._previous)
