"""A spike of the reduced gradient norm (robust z-score over a sliding window): corruption somewhere in the group."""

from __future__ import annotations

from resilience.caps import DetectorCaps
from resilience.detectors.base import Detection
from resilience.detectors.robust_z import RobustZ


class GradNorm(RobustZ):
    signal = "gradient norm"
    caps = DetectorCaps(needs_grad_norm=True)

    def on_backward(self, step: int, loss: float, grad_norm: float | None) -> list[Detection]:
        return self.observe(step, grad_norm, None)  # reduced gradients are everyone's
