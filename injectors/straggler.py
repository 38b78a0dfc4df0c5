"""A straggler: one rank runs ``factor`` times slower from ``fault.at_step`` on (thermal throttling, a noisy
neighbour, a degraded link), so every collective waits for it. Not a failure; a detector should say so."""

from __future__ import annotations

import time
from typing import Any

from injectors.base import Injector
from resilience.settings.checks import require_number


class Straggler(Injector):

    def __init__(self, factor: float = 2.0, **trigger: Any) -> None:
        super().__init__(**trigger)
        self.factor = require_number("fault.factor", factor, above=1)
        self._last: float | None = None
        self._slept = 0.0

    def __call__(self, phase: str, step: int) -> None:
        if phase != "before_forward" or not self._mine:
            return
        now = time.monotonic()
        if step >= self.at_step:
            if not self.fired:
                self.fired.add(0)
                self.record(step, 0, {"factor": self.factor})
            if self._last is not None:
                # Extra delay proportional to this rank's own work in the last step (the delay itself excluded).
                own = max(0.0, now - self._last - self._slept)
                self._slept = (self.factor - 1.0) * own
                time.sleep(self._slept)
        self._last = now

    def _plan_detail(self, step: int) -> dict[str, Any]:
        return {"factor": self.factor}

    def _act(self, step: int) -> None:
        raise AssertionError("Straggler acts in __call__")
