"""The injector interface and the trigger that every fault shares.

A fault fires at a planned (rank, step, phase), the same plan on every rank, computed without communication.
Its ``fault_injected`` record is written and fsynced *before* the destructive action (a SIGKILLed process
cannot log afterwards), and the record is also what makes a fault fire only once per run: restarted ranks
pass the same step again, find the record in the event log, and do not fire.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from resilience.events import read_events
from resilience.runtime import RankRuntime

PHASES = ("before_forward", "before_optimizer_step", "during_checkpoint")


def require_int(key: str, value: Any, minimum: int) -> int:
    """``value`` if it is an integer >= ``minimum``; otherwise a ValueError naming ``key``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{key}={value}: must be an integer >= {minimum}")
    return value


class Injector(ABC):
    """Fires one fault on rank ``rank`` when training reaches ``at_step`` at ``phase``."""

    name: str = "base"

    def __init__(self, rank: int = 0, at_step: int = 0, phase: str = "before_forward") -> None:
        if phase not in PHASES:
            raise ValueError(f"fault.phase={phase}: must be one of {', '.join(PHASES)}")
        self.rank = require_int("fault.rank", rank, 0)
        self.at_step = require_int("fault.at_step", at_step, 0)
        self.phase = phase
        self.rt: RankRuntime | None = None
        self.fired = False

    def validate(self, world_size: int, steps: int, ckpt_every: int | None) -> None:
        """Check the plan against the run (``ckpt_every`` is None when the strategy never checkpoints)."""
        if self.rank >= world_size:
            raise ValueError(f"fault.rank={self.rank}: must be in [0, {world_size - 1}] for world_size={world_size}")
        if self.phase == "during_checkpoint":
            if ckpt_every is None:
                raise ValueError("fault.phase=during_checkpoint: the strategy never checkpoints; "
                                 "choose before_forward or before_optimizer_step")
            if self.at_step % ckpt_every or not 0 < self.at_step < steps:
                raise ValueError(f"fault.at_step={self.at_step}: with fault.phase=during_checkpoint it must be a "
                                 f"checkpoint step (a multiple of checkpoint.every={ckpt_every} below steps={steps})")
        elif self.at_step >= steps:
            raise ValueError(f"fault.at_step={self.at_step}: must be in [0, {steps - 1}] for steps={steps}")

    def attach(self, rt: RankRuntime) -> None:
        """Bind to a rank; a fault already recorded in this run's event log never fires again."""
        self.rt = rt
        self.fired = any(e["kind"] == "fault_injected" for e in read_events(rt.run_dir))

    def __call__(self, phase: str, step: int) -> None:
        """The phase hook: cheap when it does not fire (three comparisons)."""
        if self.fired or step != self.at_step or phase != self.phase or self.rt.rank != self.rank:
            return
        self.fired = True
        detail = self._plan(step)
        self.rt.events.emit("fault_injected", step=step, fault=self.name, phase=phase, target_rank=self.rank,
                            fsync=True, **detail)
        self._act()

    @abstractmethod
    def _plan(self, step: int) -> dict[str, Any]:
        """Everything needed to reproduce the fault, for its record."""

    @abstractmethod
    def _act(self) -> None:
        """The destructive action itself."""
