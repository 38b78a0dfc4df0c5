"""A preemption's notice inside a rank (``checkpoint.on_notice=true``): the SIGTERM that a scheduler sends before
its SIGKILL is noted, not obeyed at once. At the end of every step the ranks agree whether any of them has it (one
small all-reduce: the signal reaches the ranks at different moments, and a save is collective), and then they save,
wait until the checkpoint is durable, and end; the run goes on in a new job (``resume=``). What Lightning's SLURM
auto-requeue and many in-house trainers do; torchelastic's agent gives the ranks ``timeouts.shutdown_s`` after its
own SIGTERM before it kills them, so that setting bounds the save as the grace period does.
"""

from __future__ import annotations

import signal
import time

import torch
import torch.distributed as dist




class NoticeHonoured(Exception):
    """Every rank saved on the notice; this one ends (``NOTICE_EXIT``)."""


class Notice:
    """Notes the first SIGTERM; ``agreed`` tells every rank, at the same step, whether any rank has one."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.at: float | None = None  # time.monotonic() of the first SIGTERM
        self._previous = signal.signal(signal.SIGTERM, self._note)

    def _note(self, signum: int, frame: object) -> None:
        if self.at is None:
            self.at = time.monotonic()

    def agreed(self) -> bool:
        """Collective: True when a rank has had the notice (every rank calls it at the end of the same step)."""
        flag = torch.tensor([0 if self.at is None else 1], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and self.at is None:  # a peer's came first: ours is on its way
            self.at = time.monotonic()
        return bool(flag.item())

    def close(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)
