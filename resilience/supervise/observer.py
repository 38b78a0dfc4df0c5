"""What a supervisor does with what it sees, whichever way it recovers: verdicts into events, hung ranks killed."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from pathlib import Path

from resilience.detectors.base import Detection, Detector
from resilience.rank.detectors import emit_detection
from resilience.record.events import EventLog
from resilience.record.board import read_board

log = logging.getLogger(__name__)


def say(message: str) -> None:
    """A supervisor line on the console and in ``supervisor.log``."""
    print(f"[supervisor] {message}", flush=True)
    log.info(message)


def kill_hard(pid: int) -> None:
    """SIGCONT then SIGKILL: a process frozen with SIGSTOP dies at once too."""
    for sig in (signal.SIGCONT, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


class Observer:
    """Runs the supervisor-side detectors: on rank exits, and on every poll of the heartbeat board."""

    def __init__(self, events: EventLog, detectors: list[Detector], run_dir: Path, world_size: int) -> None:
        self.events, self.detectors, self.run_dir, self.world_size = events, detectors, run_dir, world_size

    def exited(self, exit_codes: dict[int, int]) -> None:
        """Rank -> exit code of the ranks that failed."""
        self._emit([d for det in self.detectors for d in det.on_worker_failures(exit_codes)])

    def poll(self) -> set[int]:
        """Read the board; return the ranks that a verdict says to abort (the caller kills them)."""
        board = read_board(self.run_dir, self.world_size)
        found = [d for det in self.detectors for d in det.on_poll(board, time.monotonic())]
        self._emit(found)
        return {d.rank for d in found if d.abort and d.rank is not None}

    def _emit(self, found: list[Detection]) -> None:
        for d in found:
            emit_detection(self.events, d)
            say(f"fault detected by {d.detector}: {d.verdict}")
