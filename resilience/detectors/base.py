"""The detector interface: a detector turns an observation into ``fault_detected`` events.

Supervisor-side detectors observe the rank processes from outside (exit codes, missing progress); the
supervisor calls them from its monitor loop every ``monitor_interval``.
"""

from __future__ import annotations

from abc import ABC
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Detection:
    """One verdict: which detector, which rank it blames, at which step, and the evidence."""

    detector: str
    rank: int | None
    verdict: str
    value: Any
    step: int | None = None


class Detector(ABC):
    """Base of all detectors; a subclass overrides the observation hooks it needs."""

    name: str = "base"

    def on_worker_failures(self, exit_codes: dict[int, int]) -> list[Detection]:
        """Supervisor hook: ``exit_codes`` maps the global rank of each failed process to its exit code."""
        return []
