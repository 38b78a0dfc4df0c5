"""Detects a rank process that exited: the supervisor's elastic agent sees it within one monitor interval."""

from __future__ import annotations

import signal

from resilience.detectors.base import Detection, Detector
from resilience.runtime.rank import REQUESTED_EXITS


def describe_exit(exitcode: int) -> str:
    """``SIGKILL`` for a process killed by a signal (negative exit code), ``exit 3`` otherwise."""
    if exitcode < 0:
        try:
            return signal.Signals(-exitcode).name
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit {exitcode}"


class ProcessExit(Detector):
    """Blames the rank that died first.

    When one rank dies its peers fail too, moments later, inside their collective. A process killed by a
    signal, or one exiting with a code other than Python's 1 for an uncaught exception, is the likelier
    origin; among equals the lowest rank is named. All failed ranks are listed in the evidence.
    """


    def on_worker_failures(self, exit_codes: dict[int, int]) -> list[Detection]:
        codes = {r: c for r, c in exit_codes.items() if c not in REQUESTED_EXITS}
        if not codes:
            return []
        blamed = min(codes, key=lambda r: (0 if codes[r] < 0 else 1 if codes[r] != 1 else 2, r))
        value = {str(r): describe_exit(c) for r, c in sorted(codes.items())}
        return [Detection(self.name, blamed, f"rank {blamed} died ({describe_exit(codes[blamed])})", value)]
