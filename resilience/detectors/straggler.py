"""A straggler: a rank whose own work per step exceeds its peers' by ``factor``. Slow, not stuck: no abort.

Compares the heartbeat board's ``busy_s`` (median time from step start to backward, i.e. before waiting for the
others in the all-reduce) across ranks; the verdict must hold for ``patience`` consecutive polls.
"""

from __future__ import annotations

import statistics

from resilience.settings.checks import require_int, require_number
from resilience.detectors.base import Detection, Detector


class StragglerDetector(Detector):

    def __init__(self, factor: float = 2.0, patience: int = 10, min_step: int = 3) -> None:
        self.factor = require_number("detectors.straggler.factor", factor, above=1)
        self.patience = require_int("detectors.straggler.patience", patience, 1)
        self.min_step = require_int("detectors.straggler.min_step", min_step, 0)
        self._streak: dict[int, int] = {}
        self._flagged: set[int] = set()

    def on_poll(self, board: list[tuple[int, int, float, float]], now: float) -> list[Detection]:
        busy = [b for _, _, _, b in board]
        if len(busy) < 2 or min(busy) <= 0 or min(s for s, _, _, _ in board) < self.min_step:
            return []
        found = []
        for r, b in enumerate(busy):
            others = statistics.median(busy[:r] + busy[r + 1:])
            ratio = b / others
            self._streak[r] = self._streak.get(r, 0) + 1 if ratio > self.factor else 0
            if self._streak[r] >= self.patience and r not in self._flagged:
                self._flagged.add(r)
                found.append(Detection(self.name, r, f"rank {r} is a straggler: {ratio:.1f}x its peers' step work",
                                       round(ratio, 2), step=board[r][0]))
        return found
