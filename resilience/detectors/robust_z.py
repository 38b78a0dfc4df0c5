"""The base of the spike detectors (``loss_spike``, ``grad_norm``): a robust z-score over a sliding window,
(x - median) / (1.4826 * MAD).

The median and MAD ignore the outliers they are looking for, unlike a mean and standard deviation, and only
upward spikes count (a falling loss is training working).
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from resilience.settings.checks import require_int, require_number
from resilience.detectors.base import Detection, Detector
from resilience.runtime.rank import RankRuntime
from resilience.state.train import TrainState


class RobustZ(Detector):
    """Flags a value whose robust z-score over the last ``window`` values exceeds ``threshold``."""

    signal: str = "value"

    def __init__(self, threshold: float = 8.0, window: int = 20, warmup: int = 10) -> None:
        self.threshold = require_number(f"detectors.{self.name}.threshold", threshold, above=0)
        self.window = require_int(f"detectors.{self.name}.window", window, 5)
        self.warmup = require_int(f"detectors.{self.name}.warmup", warmup, 0)
        self._values: deque[float] = deque(maxlen=window)
        self._seen = 0
        self._fired = False

    def attach(self, rt: RankRuntime, state: TrainState) -> None:
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
