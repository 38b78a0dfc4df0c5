"""Hang detection from the ranks' own progress: no heartbeat for ``timeouts.heartbeat_s`` is a hang.

The beats come from the training loop (``resilience.record.board``), so a rank stuck in Python, frozen by a signal,
or blocked in a C call that holds the GIL all stop beating alike. Peers of a stuck rank stop too, blocked in the
collective that waits for it; they have got further into the step, so the rank(s) with the least progress are
named and aborted. Checkpoint I/O has its own, longer deadline (``timeouts.ckpt_io_s``): a slow save is no hang.
"""

from __future__ import annotations

from resilience.settings.checks import require_number
from resilience.detectors.base import Detection, Detector
from resilience.record.board import CKPT_IO, FINISHED


class Heartbeat(Detector):

    def __init__(self, heartbeat_s: float = 30.0, ckpt_io_s: float = 600.0) -> None:
        self.heartbeat_s = require_number("timeouts.heartbeat_s", heartbeat_s, above=0)
        self.ckpt_io_s = require_number("timeouts.ckpt_io_s", ckpt_io_s, above=0)

    def on_poll(self, board: list[tuple[int, int, float, float]], now: float) -> list[Detection]:
        if any(t == 0.0 for _, _, t, _ in board):
            return []  # not every rank is in its loop yet (starting, loading): nothing to compare
        if any(phase == CKPT_IO and now - t <= self.ckpt_io_s for _, phase, t, _ in board):
            return []  # a rank is saving within its deadline: the others may just be waiting for it
        silent = {r: now - t for r, (_, phase, t, _) in enumerate(board)
                  if phase != FINISHED and now - t > (self.ckpt_io_s if phase == CKPT_IO else self.heartbeat_s)}
        if not silent:
            return []
        progress = {r: (step, phase) for r, (step, phase, _, _) in enumerate(board)}
        least = min(progress[r] for r in silent)
        stuck = sorted(r for r in silent if progress[r] == least)
        return [Detection(self.name, r, f"rank {r} made no progress for {silent[r]:.1f} s "
                          f"(step {progress[r][0]}, phase {progress[r][1]})",
                          {"silent_s": round(silent[r], 3), "step": progress[r][0], "stuck_ranks": stuck},
                          step=progress[r][0], abort=True) for r in stuck]
