"""The heartbeat board: one fixed slot per rank in a small memory-mapped file that the supervisor reads.

Ranks beat from the training loop itself, at each phase of each step, never from a background thread: a thread
keeps beating while the loop is stuck, which is exactly what a hang detector must not see. A beat is a plain
store into shared memory, with no system call, so it costs next to nothing.

A slot holds (step, phase, t_mono of the beat, busy_s): ``busy_s`` is the median, over the last few steps, of the
time from the end of the previous backward pass (where the gradient all-reduce has just lined all ranks up) to the
start of this one, i.e. the rank's own work (optimizer step, data, forward) before it waits for its peers again:
what a straggler detector compares across ranks.
"""

from __future__ import annotations

import mmap
import os
import statistics
import struct
import time
from collections import deque
from pathlib import Path

BOARD_FILE = "heartbeat.bin"
SLOT = struct.Struct("<qqdd")  # step, phase, t_mono, busy_s

# Phases, in the order a step passes them; a rank with less progress than its peers is the one they wait for.
STEP_START, FORWARD_DONE, BACKWARD_DONE, STEP_DONE = 0, 1, 2, 3
CKPT_IO = 4  # inside the checkpoint save after a step: the supervisor allows timeouts.ckpt_io_s instead
FINISHED = 5  # out of the training loop (final wait, hashing, exit): no deadline any more


def create_board(run_dir: Path, world_size: int) -> Path:
    """An all-zero board for ``world_size`` ranks (the supervisor creates it before launching them)."""
    path = Path(run_dir) / BOARD_FILE
    path.write_bytes(b"\0" * SLOT.size * world_size)
    return path


class Beater:
    """A rank's side of the board: ``beat(step, phase)`` from the training loop."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        path = Path(run_dir) / BOARD_FILE
        self._map = None
        if path.exists():  # under torchrun there is no supervisor and no board: beats are dropped
            fd = os.open(path, os.O_RDWR)
            try:
                self._map = mmap.mmap(fd, 0)
            finally:
                os.close(fd)
        self._offset = rank * SLOT.size
        self._synced: float | None = None
        self._busy: deque[float] = deque(maxlen=5)
        self._busy_median = 0.0

    def beat(self, step: int, phase: int) -> None:
        now = time.monotonic()
        if phase == BACKWARD_DONE:
            self._synced = now
        elif phase == FORWARD_DONE and self._synced is not None:
            self._busy.append(now - self._synced)
            self._busy_median = statistics.median(self._busy)
        if self._map is not None:
            SLOT.pack_into(self._map, self._offset, step, phase, now, self._busy_median)

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None


def read_board(run_dir: Path, world_size: int) -> list[tuple[int, int, float, float]]:
    """Every rank's last beat: (step, phase, t_mono, busy_s); t_mono 0.0 means the rank has not beaten yet."""
    data = (Path(run_dir) / BOARD_FILE).read_bytes()
    return [SLOT.unpack_from(data, r * SLOT.size) for r in range(world_size)]


def reset_board(run_dir: Path, world_size: int, ranks: list[int] | None = None) -> None:
    """Clear the slots of ``ranks`` (default: all; a new attempt, or replaced ranks: they have not beaten yet)."""
    path = Path(run_dir) / BOARD_FILE
    with open(path, "r+b") as f:
        for rank in range(world_size) if ranks is None else ranks:
            f.seek(rank * SLOT.size)
            f.write(b"\0" * SLOT.size)
