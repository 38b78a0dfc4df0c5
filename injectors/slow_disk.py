"""A slow or failing disk under the checkpoint I/O of one rank: real file I/O, slowed or failed on its way.

Stands for storage trouble at scale ("SSD" failures in the Llama 3 table, overloaded shared file systems).
The default mechanism needs no privileges: the strategies read and write checkpoints through a DCP file-system
layer (``RankRuntime.ckpt_fs``), and this fault provides one whose streams are slowed or fail. Modes:

* ``throttle``   bandwidth cap ``mbps`` (MB/s, 0: none) and ``latency_ms`` added to every file open and fsync
* ``enospc``     writes fail with ENOSPC once ``budget_mb`` MB have been written
* ``eio``        the ``kth_write``-th write call fails with EIO
* ``torn_write`` a file is cut at ``offset_bytes`` (made durable), then the process dies with SIGKILL

Active on ``fault.rank`` from ``fault.at_step`` on, and after a restart too: the disk does not heal.
"""

from __future__ import annotations

import errno
import os
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from injectors.base import Injector
from resilience.settings.checks import require_choice, require_int, require_number
from resilience.state.train import TrainState

if TYPE_CHECKING:
    from injectors.faulty_fs import FaultyFileSystem

MODES = ("throttle", "enospc", "eio", "torn_write")


class SlowDisk(Injector):

    caps = replace(Injector.caps, acts_on_checkpoint_fs=True)  # it reaches a rank only through ``checkpoint_fs``

    def __init__(self, mode: str = "throttle", mbps: float = 50.0, latency_ms: float = 0.0, budget_mb: float = 1.0,
                 kth_write: int = 1, offset_bytes: int = 4096, **trigger: Any) -> None:
        super().__init__(**trigger)
        self.mode = require_choice("fault.mode", mode, MODES)
        self.mbps = require_number("fault.mbps", mbps, at_least=0)
        self.latency_ms = require_number("fault.latency_ms", latency_ms, at_least=0)
        self.budget_mb = require_number("fault.budget_mb", budget_mb, at_least=0)
        self.kth_write = require_int("fault.kth_write", kth_write, 1)
        self.offset_bytes = require_int("fault.offset_bytes", offset_bytes, 0)
        self.active = False
        self._bytes_total = self._writes = 0
        self._budget_t = time.monotonic()

    def validate(self, world_size: int, steps: int, ckpt_every: int | None) -> None:
        super().validate(world_size, steps, ckpt_every)
        if ckpt_every is None:
            raise ValueError("fault=slow_disk: the strategy never checkpoints, so it never touches the disk")

    def checkpoint_fs(self, rank: int) -> FaultyFileSystem | None:
        from injectors.faulty_fs import FaultyFileSystem  # on a rank only: DCP's import (resilience.ckpt.dcp_files)

        return FaultyFileSystem(self) if rank in self.targets() else None

    def arm(self, state: TrainState) -> None:
        if self._mine:
            # After a restart a slow or full disk is as bad as before; a torn write was a one-off.
            self.active = bool(self.fired) and self.mode != "torn_write"

    def __call__(self, phase: str, step: int) -> None:
        if self.mode == "torn_write":  # armed at the trigger, recorded when the write is really torn
            if self._mine and not self.fired and phase == self.phase and step >= self.at_step:
                self.active = True
            return
        super().__call__(phase, step)

    def _plan_detail(self, step: int) -> dict[str, Any]:
        return {"mode": self.mode, "mbps": self.mbps, "latency_ms": self.latency_ms, "budget_mb": self.budget_mb,
                "kth_write": self.kth_write, "offset_bytes": self.offset_bytes, "ckpt_dir": str(self.rt.ckpt_dir)}

    def _act(self, step: int) -> None:
        self.active = True

    # ---- called by the streams ----
    def latency(self) -> None:
        if self.mode == "throttle" and self.latency_ms:
            time.sleep(self.latency_ms / 1000)

    def throttle(self, nbytes: int) -> None:
        """Sleep so that the bytes moved since the disk turned slow never exceed ``mbps``."""
        if self.mode != "throttle" or not self.mbps:
            return
        if self._bytes_total == 0:
            self._budget_t = time.monotonic()
        self._bytes_total += nbytes
        ahead = self._budget_t + self._bytes_total / (self.mbps * 1e6) - time.monotonic()
        if ahead > 0:
            time.sleep(ahead)

    def before_write(self, file_offset: int, nbytes: int) -> int | None:
        """Raise the configured disk error, or return where to cut a torn write; None lets the write through."""
        self._writes += 1
        if self.mode == "enospc" and self._bytes_total + nbytes > self.budget_mb * 1e6:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if self.mode == "eio" and self._writes == self.kth_write:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        if self.mode == "torn_write" and file_offset + nbytes > self.offset_bytes:
            self.fired.add(0)
            cut = max(0, self.offset_bytes - file_offset)
            self.record(self.rt.events.step, 0, {**self._plan_detail(0), "cut_at": file_offset + cut})
            return cut
        if self.mode == "enospc":
            self._bytes_total += nbytes
        return None
