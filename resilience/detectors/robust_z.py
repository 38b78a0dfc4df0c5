"""Spike detectors on a robust z-score: (x - median) / (1.4826 * MAD) over a sliding window.

The median and MAD ignore the outliers they are looking for, unlike a mean and standard deviation, and only
upward spikes count (a falling loss is training working).
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from resilience.detectors.base import Detection, Detector


class RobustZ(Detector):
    """Flags a value whose robust z-score over the last ``window`` values exceeds ``threshold``."""

    signal: str = "value"

    def __init__(self, threshold: float = 8.0, window: int = 20, warmup: int = 10) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or threshold <= 0:
            raise ValueError(f"detectors.{self.name}.threshold={threshold}: must be a number > 0")
        if not isinstance(window, int) or window < 5:
            raise ValueError(f"detectors.{self.name}.window={window}: must be an integer >= 5")
        self.threshold, self.window, self.warmup = float(threshold), window, int(warmup)
        self._values: deque[float] = deque(maxlen=window)
        self._seen = 0
        self._fired = False

    def attach(self, rt, state) -> None:
        self.rt = rt

    def observe(self, step: int, x: float | None, blamed: int | None) -> list[Detection]:
        if x is None or self._fired:
            return []
        if not math.isfinite(x):
            return []  # the nonfinite detector's case
        found = []
        if self._seen >= self.warmup and len(self._values) >= 5:
            med = statistics.median(self._values)
            mad = statistics.median(abs(v - med) for v in self._values) * 1.4826
            z = (x - med) / max(mad, 1e-12 * max(1.0, abs(med)))
            if z > self.threshold:
                self._fired = True
                found.append(Detection(self.name, blamed, f"{self.signal} spike at step {step}: z={z:.1f}",
                                       {"value": x, "median": med, "z": round(z, 2)}, step=step, silent=True,
                                       rollback_to=step - 1))
        self._values.append(x)
        self._seen += 1
        return found


class LossSpike(RobustZ):
    name, signal = "loss_spike", "loss"

    def on_backward(self, step: int, loss: float, grad_norm: float | None) -> list[Detection]:
        return self.observe(step, loss, self.rt.rank)  # the loss is this rank's own


class GradNorm(RobustZ):
    name, signal = "grad_norm", "gradient norm"
    needs_grad_norm = True

    def on_backward(self, step: int, loss: float, grad_norm: float | None) -> list[Detection]:
        return self.observe(step, grad_norm, None)  # reduced gradients are everyone's
