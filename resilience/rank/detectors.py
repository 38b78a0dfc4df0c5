"""The detectors of one rank, composed: each verdict becomes a ``fault_detected`` event, then the recovery policy
decides what it means for this rank (``RecoveryRequested`` asks the supervisor for a restart)."""

from __future__ import annotations

import math

import torch

from resilience.detectors.base import Detection, Detector
from resilience.record.events import EventLog
from resilience.recovery.base import RecoveryPolicy
from resilience.runtime.pipeline import global_norm
from resilience.runtime.rank import RankRuntime, RejectionReport
from resilience.state.train import TrainState


class RecoveryRequested(Exception):
    """A detector found the state corrupt and the policy wants the ranks restarted (``rollback_to``: a bound)."""

    def __init__(self, detection: Detection, reaction: str) -> None:
        super().__init__(f"{reaction} requested by {detection.detector}: {detection.verdict}")
        self.detection, self.reaction = detection, reaction


def emit_detection(events: EventLog, d: Detection) -> None:
    events.emit("fault_detected", step=d.step, detector=d.detector, blamed_rank=d.rank, verdict=d.verdict,
                value=d.value, silent=d.silent, rollback_to=d.rollback_to, fsync=True, **d.extra)


class RankDetectors:
    """Calls every detector's rank-side hook and applies ``policy.react`` to what they find."""

    def __init__(self, detectors: list[Detector], policy: RecoveryPolicy) -> None:
        self.detectors, self.policy = detectors, policy
        self.rt: RankRuntime | None = None  # attached once the rank's runtime exists
        self.needs_grad_norm = any(d.caps.needs_grad_norm for d in detectors)

    def rejection_report(self) -> RejectionReport | None:
        """Where a load reports the checkpoints it passed over, if a detector wants to know."""
        return next((v for v in (d.rejection_report() for d in self.detectors) if v is not None), None)

    def attach(self, rt: RankRuntime, state: TrainState) -> None:
        self.rt, self.state = rt, state
        for d in self.detectors:
            d.attach(rt, state)

    def grad_norm(self) -> float | None:
        if not self.needs_grad_norm:
            return None
        if self.rt.layout is not None:  # a pipeline: every stage judges the whole model's norm, not its own part's
            return float(global_norm(self.state.model.parameters(), self.rt.layout))
        # Sparse gradients (embedding tables) count by their values; DDP's sparse all-reduce leaves duplicate
        # indices, which coalescing sums first.
        grads = [g.coalesce().values() if g.is_sparse else g
                 for g in (p.grad for p in self.state.model.parameters()) if g is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])) if grads else None
        return float(norm) if norm is not None else math.nan

    def on_backward(self, step: int, loss: float) -> None:
        norm = self.grad_norm()
        self._handle([x for d in self.detectors for x in d.on_backward(step, loss, norm)])

    def on_step_end(self, step: int) -> None:
        self._handle([x for d in self.detectors for x in d.on_step_end(step)])

    def on_exception(self, exc: BaseException) -> None:
        """What the detectors make of the error that ends the rank; nothing before they are attached (the error
        came while the rank was being set up, which no detector watches)."""
        if self.rt is None:
            return
        for x in [x for d in self.detectors for x in d.on_exception(exc)]:
            emit_detection(self.rt.events, x)

    def _handle(self, found: list[Detection]) -> None:
        for d in found:
            emit_detection(self.rt.events, d)
        for d in found:
            reaction = self.policy.react(d)
            if reaction != "record":
                raise RecoveryRequested(d, reaction)
