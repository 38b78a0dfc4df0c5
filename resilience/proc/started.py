"""When this process started, on the wall clock: a resumed job's start, before its imports and its validation."""

from __future__ import annotations

import os
import time


def process_started_wall() -> float:
    """The wall-clock time at which this process was created (Linux: from /proc; elsewhere: now).

    The kernel counts a process's start in clock ticks since boot, and /proc/uptime gives the time since boot to
    10 ms: their difference is the process's age. (``btime`` in /proc/stat is whole seconds: too coarse.)"""
    try:
        with open("/proc/self/stat") as f:
            after_name = f.read().rsplit(")", 1)[1].split()  # the name may hold spaces and parentheses
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except OSError:
        return time.time()
    start_ticks = int(after_name[19])  # field 22 of stat(5); the fields after the name start at field 3
    return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
