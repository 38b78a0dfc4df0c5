"""Checkpoint integrity, reported: every committed checkpoint a load passed over becomes a ``fault_detected``.

The strategies always check a checkpoint before loading it (``CheckpointDir.check``: this run's, every file with its
size and checksum) and skip a bad one for the previous good one, whatever the detector list; this detector only turns
what they found into a detection, so the coverage table and the report count it.
"""

from __future__ import annotations

from pathlib import Path

from resilience.detectors.base import Detector
from resilience.runtime.rank import RankRuntime, RejectionReport
from resilience.state.train import TrainState


class CkptIntegrity(Detector):

    def rejection_report(self) -> RejectionReport:
        return self.report

    def attach(self, rt: RankRuntime, state: TrainState) -> None:
        self.rt = rt

    def report(self, step: int, path: Path, reason: str) -> None:
        self.rt.events.emit("fault_detected", step=step, detector=self.name, blamed_rank=None,
                            verdict=f"checkpoint step {step} is corrupt ({reason}); skipped",
                            value={"path": str(path), "reason": reason}, fsync=True)
