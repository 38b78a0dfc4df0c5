"""Checkpoint integrity: the per-file CRC32s in the commit manifest, recomputed when a checkpoint is loaded.

A checkpoint whose bytes changed on disk (a flipped bit, a bad sector) is skipped with an event and the previous
good one is used, instead of silently restoring corrupt state.
"""

from __future__ import annotations

from resilience.detectors.base import Detector
from resilience.runtime import CheckpointVerifier
from resilience.ckpt.checksum import file_crc32
from resilience.ckpt.commit import CheckpointDir, CheckpointEntry


class CkptIntegrity(Detector):

    def checkpoint_verifier(self) -> CheckpointVerifier:
        return self.verify

    def attach(self, rt, state) -> None:
        self.rt = rt

    def verify(self, dirs: CheckpointDir, entry: CheckpointEntry) -> bool:
        """True if every file of ``entry`` matches its checksum (a manifest without checksums cannot be checked)."""
        expected = dirs.manifest(entry).get("crc32", {})
        bad = {name: crc for name, crc in expected.items() if file_crc32(entry.path / name) != crc}
        if not expected:
            self.rt.events.emit("ckpt_unverified", step=entry.step, path=str(entry.path))
        if not bad:
            return True
        self.rt.events.emit("fault_detected", step=entry.step, detector=self.name, blamed_rank=None,
                            verdict=f"checkpoint step {entry.step} is corrupt ({', '.join(sorted(bad))}); skipped",
                            value={"files": sorted(bad)}, fsync=True)
        return False
