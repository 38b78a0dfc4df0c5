"""A damaged checkpoint, then a crash: the recovery must pass over the damaged one for the previous good one.

Stands for what storage does to files between their write and their read: a flipped bit, a file cut short by a full
or failing disk, a file lost, a commit record garbled. On ``fault.rank`` at ``fault.at_step`` the newest committed
checkpoint is damaged ``fault.how``, then the rank dies (SIGKILL), so the restart meets the damage at its load:

* ``flip``             one bit of a byte in the middle of a data file
* ``truncate``         a data file cut to half its length
* ``delete_data``      a data file removed
* ``delete_metadata``  DCP's ``.metadata`` removed
* ``garble_commit``    ``COMMIT.json`` cut in the middle (no longer JSON)

The checkpoint must never be loaded: a recovery that loads it ends with a different final state (or fails).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from injectors.base import Injector
from injectors.kill import die
from resilience.settings.checks import require_choice
from resilience.ckpt.commit import COMMIT_MARKER, METADATA_FILES, CheckpointDir, CheckpointEntry

HOW = ("flip", "truncate", "delete_data", "delete_metadata", "garble_commit")


class CkptDamage(Injector):

    def __init__(self, how: str = "flip", **trigger: Any) -> None:
        super().__init__(**trigger)
        self.how = require_choice("fault.how", how, HOW)

    def validate(self, world_size: int, steps: int, ckpt_every: int | None) -> None:
        super().validate(world_size, steps, ckpt_every)
        if ckpt_every is None or self.at_step <= ckpt_every:
            raise ValueError(f"fault.at_step={self.at_step}: fault=ckpt_damage needs a committed checkpoint before "
                             f"it (a strategy that checkpoints, at_step > checkpoint.every)")

    def _plan_detail(self, step: int) -> dict[str, Any]:
        # The checkpoint recorded is the one damaged: chosen once, since a background save may commit a newer one
        # between the record and the act (seen with dcp_async: step 8 recorded, step 12 damaged).
        self._entry = entry = CheckpointDir(self.rt.ckpt_dir).newest_committed()
        return {"how": self.how, "damaged_step": entry.step if entry else None,
                "file": self._victim(entry.path).name if entry else None}

    def _victim(self, path: Path) -> Path:
        if self.how == "garble_commit":
            return path / COMMIT_MARKER
        if self.how == "delete_metadata":
            return next((path / m for m in METADATA_FILES if (path / m).exists()), path / METADATA_FILES[0])
        return CheckpointDir(self.rt.ckpt_dir).data_files(CheckpointEntry(0, path, True))[0]

    def _act(self, step: int) -> None:
        entry = self._entry
        if entry is not None:
            victim = self._victim(entry.path)
            if self.how.startswith("delete"):
                victim.unlink()
            else:
                raw = bytearray(victim.read_bytes())
                if self.how == "flip":
                    raw[len(raw) // 2] ^= 0x10
                else:  # truncate, garble_commit: cut in the middle
                    raw = raw[: len(raw) // 2]
                victim.write_bytes(bytes(raw))
        die("SIGKILL")
