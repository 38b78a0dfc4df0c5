"""The scheduler's second signal: ``python -m injectors.executioner DEADLINE RUN_DIR PID:START...`` SIGKILLs each
listed process still alive at ``DEADLINE`` (``time.monotonic()``, the host's CLOCK_MONOTONIC: the notice's time
plus its grace period, so that this process's own start-up does not lengthen it), as SLURM does after a
preemption's or a time limit's SIGTERM (its ``KillWait``), a cloud after a spot instance's notice, and a node's
scheduled maintenance at its hour.

It runs in a session of its own, so the job it ends cannot take it along; it exits as soon as every listed process
is gone (a job that finished within its grace period leaves nothing to kill, and no process behind). ``START`` is
the process's start time in clock ticks (``/proc/PID/stat``, field 22): a PID the kernel gave to another process
meanwhile is left alone.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

POLL_S = 0.05


def started(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot, or None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # after the command name, which may hold spaces


def alive(pid: int, start: int) -> bool:
    """Process ``pid`` is the one that started at ``start`` and has not been reaped (a zombie has done its work)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat.rsplit(")", 1)[1].split()
    return fields[0] != "Z" and int(fields[19]) == start


def main(argv: list[str]) -> int:
    deadline, victims = float(argv[0]), [tuple(map(int, a.split(":"))) for a in argv[2:]]  # argv[1]: the run dir
    while time.monotonic() < deadline:
        if not any(alive(pid, start) for pid, start in victims):
            return 0
        time.sleep(POLL_S)
    for pid, start in victims:
        if alive(pid, start):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
