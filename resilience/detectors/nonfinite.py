"""NaN or Inf in the loss or the gradients: the loudest form of numerical corruption."""

from __future__ import annotations

import math

from resilience.caps import DetectorCaps
from resilience.detectors.base import Detection, Detector
from resilience.runtime.rank import RankRuntime
from resilience.state.train import TrainState


class Nonfinite(Detector):
    caps = DetectorCaps(needs_grad_norm=True)

    def __init__(self) -> None:
        self._fired = False

    def attach(self, rt: RankRuntime, state: TrainState) -> None:
        self.rt = rt

    def on_backward(self, step: int, loss: float, grad_norm: float | None) -> list[Detection]:
        if self._fired:
            return []  # once NaN, always NaN: one verdict per attempt
        bad = [name for name, v in (("loss", loss), ("grad_norm", grad_norm)) if v is not None and not math.isfinite(v)]
        if not bad:
            return []
        self._fired = True
        # A non-finite local loss is this rank's; reduced gradients are everyone's, so they blame nobody.
        blamed = self.rt.rank if "loss" in bad else None
        return [Detection(self.name, blamed, f"non-finite {' and '.join(bad)} at step {step}",
                          {"loss": loss, "grad_norm": grad_norm}, step=step, silent=True, rollback_to=step - 1)]
