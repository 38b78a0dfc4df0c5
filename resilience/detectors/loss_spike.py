"""A spike of this rank's training loss (robust z-score over a sliding window): silent corruption of its state."""

from __future__ import annotations

from resilience.detectors.base import Detection
from resilience.detectors.robust_z import RobustZ


class LossSpike(RobustZ):
    signal = "loss"

    def on_backward(self, step: int, loss: float, grad_norm: float | None) -> list[Detection]:
        return self.observe(step, loss, self.rt.rank)  # the loss is this rank's own
