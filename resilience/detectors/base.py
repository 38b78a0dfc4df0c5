"""The detector interface: a detector turns an observation into ``fault_detected`` events.

Detectors live on one of two sides, and override only the hooks of their side:

* supervisor side (outside the ranks): ``on_worker_failures`` when rank processes exit, and ``on_poll`` every
  monitor interval with the heartbeat board; a detection with ``abort=True`` makes the supervisor kill the blamed
  ranks so that recovery can start.
* rank side (inside the training loop, identically on every rank): ``on_backward`` after the gradients are
  reduced, ``on_step_end`` after the optimizer step (collectives allowed there, called on all ranks),
  ``on_exception`` when the step raised.
"""

from __future__ import annotations

from abc import ABC
from dataclasses import dataclass, field
from typing import Any

from resilience.caps import DetectorCaps, Named
from resilience.runtime.rank import AgentService, RankRuntime, RejectionReport
from resilience.state.train import TrainState


@dataclass(frozen=True)
class Detection:
    """One verdict: which detector, which rank it blames (None: cannot tell), at which step, and the evidence."""

    detector: str
    rank: int | None
    verdict: str
    value: Any
    step: int | None = None
    abort: bool = False  # the supervisor should kill the blamed ranks
    silent: bool = False  # silent corruption: the state is wrong though every process runs
    rollback_to: int | None = None  # newest step known good, for a rollback
    extra: dict[str, Any] = field(default_factory=dict)


class Detector(Named, ABC):
    """Base of all detectors; a subclass overrides the hooks of its side."""

    caps = DetectorCaps()

    # ---- supervisor side ----
    def start(self) -> str | None:
        """Before launch: return why this detector cannot work here (it then reports that once), or None."""
        return None

    def acts_in_supervisor(self) -> bool:
        """Whether this detector overrides a supervisor-side hook (it then needs our supervisor to run)."""
        return type(self).on_worker_failures is not Detector.on_worker_failures or \
            type(self).on_poll is not Detector.on_poll or self.agent_service() is not None

    def agent_service(self) -> AgentService | None:
        """What this detector runs in the supervisor process for the whole run (None: nothing)."""
        return None

    def on_worker_failures(self, exit_codes: dict[int, int]) -> list[Detection]:
        """``exit_codes`` maps the global rank of each failed process to its exit code."""
        return []

    def on_poll(self, board: list[tuple[int, int, float, float]], now: float) -> list[Detection]:
        """``board`` holds every rank's last heartbeat (step, phase, t_mono, busy_s); ``now`` is t_mono."""
        return []

    # ---- rank side ----
    def rejection_report(self) -> RejectionReport | None:
        """The service this detector provides to the rank's runtime: told of every checkpoint a load passed over."""
        return None

    def attach(self, rt: RankRuntime, state: TrainState) -> None:
        """Bind to a rank and its training state (before the first step)."""

    def on_backward(self, step: int, loss: float, grad_norm: float | None) -> list[Detection]:
        """After the gradients are reduced, before the optimizer step."""
        return []

    def on_step_end(self, step: int) -> list[Detection]:
        """After the optimizer step of ``step`` (the position is then ``step + 1``); on every rank."""
        return []

    def on_exception(self, exc: BaseException) -> list[Detection]:
        """The training step raised ``exc``."""
        return []
