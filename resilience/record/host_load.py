"""Was the host quiet while a run was measured? What the rest of the machine did during the run, from ``/proc``.

A timing taken while other processes compete for the cores is not the technique's: the same cell's recovery time
varied 10x with machine load. So every run records, over its own span:

* ``other_cpu_frac``: the CPU time of everything outside the run's process tree, as a fraction of the machine's
  capacity over the run (all cores x wall time): ``/proc/stat`` busy time minus the run's own CPU time (the
  supervisor and every process it reaped: ranks, their helpers, adopted orphans, from ``getrusage``);
* ``steal_frac``: the share of CPU time the hypervisor gave to other guests (``/proc/stat`` steal);
* ``load_max``: the highest 1-minute load average sampled (it counts the run's own processes too);
* ``cpu_pressure_max`` and ``memory_pressure_max``: the highest PSI ``some avg10`` sampled (the share of time some
  task waited for a CPU, or for memory), where the kernel has PSI.

The verdict (``valid`` or ``noisy``, with its reasons) compares these with the run's ``validity`` thresholds
(``conf/config.yaml``); ``resilience.record.metrics`` puts both in ``result.json``.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class CpuTimes:
    busy_s: float  # every core's non-idle time, steal excluded
    steal_s: float
    total_s: float
    own_s: float  # this process and its reaped children
    t_mono: float

    @staticmethod
    def now() -> CpuTimes | None:
        try:
            fields = [int(x) for x in (PROC / "stat").read_text().splitlines()[0].split()[1:]]
        except (OSError, ValueError, IndexError):
            return None
        user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
        me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return CpuTimes(busy_s=(user + nice + system + irq + softirq) / TICK, steal_s=steal / TICK,
                        total_s=(user + nice + system + idle + iowait + irq + softirq + steal) / TICK,
                        own_s=me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime, t_mono=time.monotonic())


def _pressure(kind: str) -> float | None:
    """PSI ``some avg10`` of ``cpu`` or ``memory`` (percent), or None without PSI."""
    try:
        first = (PROC / "pressure" / kind).read_text().splitlines()[0]
        return float(first.split("avg10=")[1].split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _load1() -> float | None:
    try:
        return float((PROC / "loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


class HostLoadSampler:
    """Takes the CPU counters at ``start`` and ``stop`` (call ``stop`` after the run's processes are reaped) and
    samples load and pressure every ``interval_s`` in a daemon thread in between."""

    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self.samples: dict[str, list[float]] = {"load": [], "cpu_pressure": [], "memory_pressure": []}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="host-load-sampler", daemon=True)
        self._start: CpuTimes | None = None

    def start(self) -> HostLoadSampler:
        self._start = CpuTimes.now()
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            for name, value in (("load", _load1()), ("cpu_pressure", _pressure("cpu")),
                                ("memory_pressure", _pressure("memory"))):
                if value is not None:
                    self.samples[name].append(value)
            self._stop.wait(self.interval_s)

    def stop(self) -> dict[str, float | int | None]:
        """The figures of the module docstring (None where this host cannot tell)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        end, begin = CpuTimes.now(), self._start
        out: dict[str, float | int | None] = {
            f"{name}_max": max(values) if values else None for name, values in self.samples.items()}
        out["samples"] = len(self.samples["load"])
        out["cpus"] = os.cpu_count()
        out["other_cpu_frac"] = out["steal_frac"] = None
        if begin and end and end.total_s > begin.total_s:
            capacity = (end.t_mono - begin.t_mono) * (os.cpu_count() or 1)
            other = (end.busy_s - begin.busy_s) - (end.own_s - begin.own_s)
            out["other_cpu_frac"] = max(0.0, other) / capacity if capacity > 0 else None
            out["steal_frac"] = (end.steal_s - begin.steal_s) / (end.total_s - begin.total_s)
        return out
