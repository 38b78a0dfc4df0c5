"""Was the host quiet while a run was measured? What the rest of the machine did during the run, from ``/proc``.

A timing taken while other processes compete for the cores is not the technique's: the same cell's recovery time
varied 10x with machine load. So every run records, over its own span:

* ``other_cpu_frac``: the CPU time of everything outside the run's process tree, as a fraction of the machine's
  capacity over the run (all cores x wall time): ``/proc/stat`` busy time minus the run's own CPU time
  (``own_cpu_s``). The run's own is the sampling process (the supervisor) and every descendant of it: ranks, and
  what they start (DCP's checkpoint process, a library's daemon), whoever reaps it. ``getrusage`` alone misses a
  descendant nobody has reaped when the run ends (a killed rank's checkpoint process left as a zombie: its CPU
  counted as another process's and marked every DCP process-executor kill cell noisy) and one reparented outside
  the tree (to init where the sampler is no subreaper); so :class:`RunProcesses` also follows the tree in
  ``/proc`` at every sample (``own_unreaped_cpu_s``: the part of ``own_cpu_s`` that getrusage would have missed);
* ``steal_frac``: the share of CPU time the hypervisor gave to other guests (``/proc/stat`` steal);
* ``load_max``: the highest 1-minute load average sampled (it counts the run's own processes too);
* ``cpu_pressure_max`` and ``memory_pressure_max``: the highest PSI ``some avg10`` sampled (the share of time some
  task waited for a CPU, or for memory), where the kernel has PSI.

The verdict (``valid`` or ``noisy``, with its reasons) compares these with the run's ``validity`` thresholds
(``conf/config.yaml``); ``resilience.record.metrics`` puts both in ``result.json``. The counters are also kept at
every sample (``series``), so that the same figures can be taken over a window of the run (a checkpoint, a
recovery: ``resilience.record.windows``): an average over the whole run hides a neighbour that was busy only then.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROC = Path("/proc")
TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
SCAN_TRIES = 3  # then the last reading stands: a child reaped after the scan is counted twice (errs toward valid)


def _stat(pid: str) -> tuple[int, int, float] | None:
    """(parent pid, start time in ticks, CPU seconds of the process and of the children it reaped) from
    ``/proc/<pid>/stat``; a zombie keeps its times until it is reaped."""
    try:
        fields = (PROC / pid / "stat").read_text().rsplit(")", 1)[1].split()
        # fields[k] is stat field k + 3 (proc(5)): ppid 4, utime 14, stime 15, cutime 16, cstime 17, starttime 22
        return int(fields[1]), int(fields[19]), sum(int(x) for x in fields[11:15]) / TICK
    except (OSError, ValueError, IndexError):
        return None


class RunProcesses:
    """The run's processes besides the sampling one: every descendant of it, and every process once seen as one
    (by pid and start time, so that a reused pid is not), with the CPU time each has used, reaped children included.

    ``cpu_s()`` is the CPU time that ``getrusage`` of the sampling process does not hold yet: the processes alive
    now (zombies too), plus the last reading of those that left the tree (reparented to init) and died. A process
    that dies inside the tree is reaped by its parent (or by the subreaper, ``resilience.proc.orphans``), which then
    holds its time, so it drops out of the sum without being lost. Its error: what an escaped process used after
    its last sample, and escaped processes that lived less than one sample."""

    def __init__(self, root: int | None = None) -> None:
        self.root = os.getpid() if root is None else root
        self.known: dict[int, tuple[int, float, bool, int]] = {}  # pid -> (start ticks, CPU s, parent in run, parent)
        self.gone_s = 0.0  # processes that left the tree and died: their last reading

    def scan(self) -> RunProcesses:
        table = {}
        for entry in PROC.iterdir():
            if entry.name.isdigit() and (st := _stat(entry.name)) is not None:
                table[int(entry.name)] = st
        kids: dict[int, list[int]] = {}
        for pid, (ppid, _, _) in table.items():
            kids.setdefault(ppid, []).append(pid)
        roots = [self.root] + [p for p, (start, _, _, _) in self.known.items() if p in table and table[p][1] == start]
        mine, todo = set(roots) - {self.root}, list(roots)
        while todo:  # the descendants of the sampling process and of every process once seen as the run's
            for child in kids.get(todo.pop(), ()):
                if child not in mine and child != self.root:
                    mine.add(child)
                    todo.append(child)
        for pid, (start, cpu, in_run, parent) in self.known.items():
            if pid not in table or table[pid][1] != start:  # died: reaped inside the run, or by init
                self.gone_s += 0.0 if in_run else cpu
                if in_run and parent in mine and (again := _stat(str(parent))) is not None:
                    # its reaper's line may have been read before the reap, without the child's time: read it after
                    table[parent] = again
        self.known = {p: (table[p][1], table[p][2], table[p][0] == self.root or table[p][0] in mine, table[p][0])
                      for p in mine}
        return self

    def cpu_s(self) -> float:
        return self.gone_s + sum(cpu for _, cpu, _, _ in self.known.values())


@dataclass(frozen=True)
class CpuTimes:
    busy_s: float  # every core's non-idle time, steal excluded
    steal_s: float
    total_s: float
    own_s: float  # this process, its reaped children and the run's processes not (yet) reaped by it
    unreaped_s: float  # the last part: what getrusage of this process does not hold
    t_mono: float

    @staticmethod
    def now(run: RunProcesses | None = None) -> CpuTimes | None:
        try:
            fields = [int(x) for x in (PROC / "stat").read_text().splitlines()[0].split()[1:]]
        except (OSError, ValueError, IndexError):
            return None
        user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
        me = resource.getrusage(resource.RUSAGE_SELF)
        # A child this process reaps between reading its children's times and the scan of /proc is in neither: a
        # rank's whole CPU time (seconds) once went missing from a reading taken as the ranks exited, and a window
        # bracketed by it read "other processes' CPU 2.93" of 2 cores. Read them on both sides of the scan until
        # no child was reaped during it (the scan then holds exactly the processes the children's times do not).
        for _ in range(SCAN_TRIES):
            before = _children_s()
            unreaped = run.scan().cpu_s() if run else 0.0
            kids = _children_s()
            if kids == before:
                break
        return CpuTimes(busy_s=(user + nice + system + irq + softirq) / TICK, steal_s=steal / TICK,
                        total_s=(user + nice + system + idle + iowait + irq + softirq + steal) / TICK,
                        own_s=me.ru_utime + me.ru_stime + kids + unreaped, unreaped_s=unreaped, t_mono=time.monotonic())


def _children_s() -> float:
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return kids.ru_utime + kids.ru_stime


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
    samples load and pressure, and follows the run's process tree, every ``interval_s`` in a daemon thread in
    between."""

    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self.samples: dict[str, list[float]] = {"load": [], "cpu_pressure": [], "memory_pressure": []}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="host-load-sampler", daemon=True)
        self._start: CpuTimes | None = None
        self.run = RunProcesses()
        self.series: list[CpuTimes] = []  # the counters at every sample, for windows of the run

    def start(self) -> HostLoadSampler:
        self._start = CpuTimes.now(self.run)
        if self._start:
            self.series.append(self._start)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            for name, value in (("load", _load1()), ("cpu_pressure", _pressure("cpu")),
                                ("memory_pressure", _pressure("memory"))):
                if value is not None:
                    self.samples[name].append(value)
            if (times := CpuTimes.now(self.run)) is not None:  # follows the run's tree too
                self.series.append(times)
            self._stop.wait(self.interval_s)

    def stop(self) -> dict[str, Any]:
        """The figures of the module docstring (None where this host cannot tell)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        end, begin = CpuTimes.now(self.run), self._start
        if end:
            self.series.append(end)
        # [t_mono, busy_s, own_s, steal_s, total_s] per sample: what resilience.record.windows reads
        out_series = [[t.t_mono, t.busy_s, t.own_s, t.steal_s, t.total_s] for t in self.series]
        out: dict[str, Any] = {
            f"{name}_max": max(values) if values else None for name, values in self.samples.items()}
        out["samples"] = len(self.samples["load"])
        out["cpus"] = os.cpu_count()
        out["other_cpu_frac"] = out["steal_frac"] = out["own_cpu_s"] = out["own_unreaped_cpu_s"] = None
        if begin and end and end.total_s > begin.total_s:
            out["own_cpu_s"] = end.own_s - begin.own_s
            # the run's CPU that getrusage alone would have counted as other processes' (unreaped descendants)
            out["own_unreaped_cpu_s"] = end.unreaped_s - begin.unreaped_s
            capacity = (end.t_mono - begin.t_mono) * (os.cpu_count() or 1)
            other = (end.busy_s - begin.busy_s) - (end.own_s - begin.own_s)
            out["other_cpu_frac"] = max(0.0, other) / capacity if capacity > 0 else None
            out["steal_frac"] = (end.steal_s - begin.steal_s) / (end.total_s - begin.total_s)
        out["series"] = out_series
        return out
