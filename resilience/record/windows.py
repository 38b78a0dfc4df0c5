"""Was the host quiet during each window that a headline figure is measured over? A checkpoint (its start to its
durability, rank 0's) and a recovery (the fault to training back at its step) are seconds of a run, and a run's
other-process CPU averaged over the whole of it (``resilience.record.host_load``) can stay under its threshold while
a neighbour took the cores during exactly those seconds: a time to durable 2.6x its cell's median was rated valid.

Each window's figures come from the host sampler's counters (``series``: one reading per ``validity.sample_s``),
taken over the readings that bracket it (the last at or before its start, the first at or after its end): a window
shorter than the sampling interval is judged over that interval, which dilutes a contention but never invents one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

T, BUSY, OWN, STEAL, TOTAL = range(5)  # the columns of a reading (host_load's series)


@dataclass(frozen=True)
class Window:
    label: str  # "the checkpoint of step 10", "the recovery from the fault at step 13"
    start: float  # t_mono
    end: float


def windows(events: list[dict]) -> list[Window]:
    """Rank 0's checkpoints (``ckpt_begin`` -> its ``ckpt_durable``, else its ``ckpt_stall_end``) and each fault's
    recovery (``fault_injected`` -> the next ``resumed``)."""
    out = []
    rank0 = [e for e in events if e.get("rank") == 0]
    for i, begin in enumerate(rank0):
        if begin["kind"] != "ckpt_begin":
            continue
        ends = [e for e in rank0[i + 1:] if e["step"] == begin["step"] and e["kind"] in ("ckpt_durable",
                                                                                       "ckpt_stall_end")]
        end = next((e for e in ends if e["kind"] == "ckpt_durable"), ends[0] if ends else None)
        if end is not None:
            out.append(Window(f"the checkpoint of step {begin['step']}", begin["t_mono"], end["t_mono"]))
    for fault in (e for e in events if e["kind"] == "fault_injected"):
        back = next((e for e in events if e["kind"] == "resumed" and e["t_mono"] >= fault["t_mono"]), None)
        if back is not None:
            out.append(Window(f"the recovery from the fault at step {fault['step']}", fault["t_mono"],
                              back["t_mono"]))
    return out


def over(series: list[list[float]], window: Window, cpus: int) -> dict[str, float] | None:
    """Other processes' CPU (share of all cores) and steal over the readings that bracket ``window``."""
    before = [r for r in series if r[T] <= window.start]
    after = [r for r in series if r[T] >= window.end]
    if not before or not after:
        return None
    a, b = before[-1], after[0]
    span = b[T] - a[T]
    if span <= 0 or b[TOTAL] <= a[TOTAL]:
        return None
    other = (b[BUSY] - a[BUSY]) - (b[OWN] - a[OWN])
    return {"other_cpu_frac": max(0.0, other) / (span * cpus), "steal_frac": (b[STEAL] - a[STEAL]) /
            (b[TOTAL] - a[TOTAL])}


def reasons(load: dict[str, Any], events: list[dict]) -> list[str]:
    """A reason per window whose figures exceed the run's thresholds: "other processes' CPU 0.45 > 0.1 during the
    checkpoint of step 10"."""
    series, limits, cpus = load.get("series") or [], load.get("thresholds", {}), load.get("cpus") or 1
    out = []
    for w in windows(events):
        got = over(series, w, cpus)
        if got is None:
            continue
        for key, limit, label in (("other_cpu_frac", "max_other_cpu", "other processes' CPU"),
                                  ("steal_frac", "max_steal", "CPU steal")):
            if limit in limits and got[key] > limits[limit]:
                out.append(f"{label} {got[key]:.3g} > {limits[limit]} during {w.label}")
    return out
