"""Readers of a run's event list: small lookups, and the one definition of each quantity that ``result.json``, the
benches, the projection and the report read from the log (a save's stall and its time until durable, step times,
loads, a fault's recovery window). The kinds and their fields are those of ``resilience.record.catalogue``.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def first(events: list[dict], kind: str, **match: Any) -> dict | None:
    return next((e for e in events if e["kind"] == kind and all(e.get(k) == v for k, v in match.items())), None)


@dataclass(frozen=True)
class Span:
    """From a start event to an end event of the same rank, attempt and step; ``closing`` is the end event."""

    rank: int | None
    attempt: int
    step: int
    start: float
    end: float
    closing: dict = field(repr=False, compare=False)

    @property
    def seconds(self) -> float:
        return self.end - self.start


def spans(events: list[dict], start: str, end: str, clock: str = "t_mono") -> list[Span]:
    """Each ``end`` event with the last ``start`` event of its (rank, attempt, step) before it, in the ends' order;
    an end without a start (and a start without an end: a save its rank did not live through) is left out."""
    begins: dict[tuple, float] = {}
    out = []
    for e in events:
        where = (e["rank"], e["attempt"], e["step"])
        if e["kind"] == start:
            begins[where] = e[clock]
        elif e["kind"] == end and where in begins:
            out.append(Span(*where, begins[where], e[clock], e))
    return out


def stalls(events: list[dict], clock: str = "t_mono") -> list[Span]:
    """The checkpoint stall of each save on each rank: ``ckpt_begin`` until ``ckpt_stall_end`` (training goes on;
    a skipped save has no end, so no stall)."""
    return spans(events, "ckpt_begin", "ckpt_stall_end", clock)


def durable_times(events: list[dict], clock: str = "t_mono") -> list[Span]:
    """Each save's time until durable: ``ckpt_begin`` until ``ckpt_durable`` (rank 0's commit)."""
    return spans(events, "ckpt_begin", "ckpt_durable", clock)


def step_start(step_end: dict) -> float:
    """When the loop iteration of a ``step_end`` began: a step's time is its whole iteration (``duration_s``)."""
    return step_end["t_mono"] - step_end["duration_s"]


def step_times(events: list[dict]) -> list[float]:
    """Every step's time (``duration_s``) among ``events`` (one rank's, for a figure), replayed steps included."""
    return [e["duration_s"] for e in events if e["kind"] == "step_end"]


def productive_step_times(events: list[dict]) -> dict[int, float]:
    """Step -> its time, each step once: from the attempt whose result survived (a replayed step overwrites the
    lost one)."""
    last: dict[int, float] = {}
    for e in events:
        if e["kind"] == "step_end":
            last[e["step"]] = e["duration_s"]
    return last


def plain_step_times(events: list[dict]) -> list[float]:
    """The times of the steps among ``events`` (one rank's) that neither follow a restart (nor start the run) nor
    carry a save (a ``ckpt_begin`` of their attempt and step): what an interval's steps cost without either."""
    ends = [e for e in events if e["kind"] == "step_end"]
    saves = {(e["attempt"], e["step"]) for e in events if e["kind"] == "ckpt_begin"}
    return [b["duration_s"] for a, b in zip(ends, ends[1:])
            if b["attempt"] == a["attempt"] and (b["attempt"], b["step"]) not in saves]


def loads(events: list[dict], attempt: int | None = None, since: float | None = None) -> list[dict]:
    """The timed ``ckpt_loaded`` events (of ``attempt``; at or after ``since`` on the monotonic clock)."""
    return [e for e in events if e["kind"] == "ckpt_loaded" and e.get("duration_s") is not None
            and (attempt is None or e["attempt"] == attempt) and (since is None or e["t_mono"] >= since)]


def load_window(loaded: list[dict]) -> tuple[float, float] | None:
    """A load's critical path, (start, end): from the last loading rank starting to the last one done. A rank that
    starts early only waits for its peers in the load's first collective (start-up skew, not load time)."""
    if not loaded:
        return None
    return max(e["t_mono"] - e["duration_s"] for e in loaded), max(e["t_mono"] for e in loaded)


@dataclass(frozen=True)
class RecoveryWindow:
    """One fault's recovery as one restarted rank lived it: rank 0 when every rank restarts, else a replaced rank.
    Its bounds are events: the fault, its detection, the restart, that rank's run_start, load, first step, resume."""

    fault: dict
    detection: dict | None  # the first verdict at or after the fault (None: nothing detected it, e.g. torchrun)
    restart: dict | None  # the supervisor's restart event
    start: dict  # the rank's run_start
    loaded: dict | None  # what it loaded, in that attempt
    first_step: dict | None  # its first step after the fault: training runs again
    resumed: dict | None  # reaching the fault's step again: the lost work is replayed

    @property
    def ready(self) -> dict:
        """The event after which the state is restored: the load, or the start where nothing was loaded."""
        return self.loaded or self.start

    @property
    def lost_steps(self) -> int:
        """The fault's step minus the step loaded; never below 0 (in place, survivors may be one step past it). A
        failure that struck a recovery (a wall-clock trace's ``struck``: restarting, or no process) loses none:
        training had not run again since the failure it interrupted, which counts the steps."""
        if self.fault.get("struck", "training") != "training":
            return 0
        return max(0, self.fault["step"] - (self.loaded["step"] if self.loaded else 0))


def injected(events: list[dict]) -> list[dict]:
    """The first ``fault_injected`` record of each planned point that fired, in order: one per fault (every rank of
    a lost node records the same point; a schedule, ``fault.at_step=[...]``, or a probability plans several)."""
    points: dict[tuple, dict] = {}
    for e in events:
        if e["kind"] == "fault_injected":
            points.setdefault((e.get("fault"), e.get("plan_index", 0)), e)
    return list(points.values())


def first_detection(events: list[dict], fault: dict) -> dict | None:
    return next((e for e in events if e["kind"] == "fault_detected" and e["t_mono"] >= fault["t_mono"]), None)


def recovery_window(events: list[dict], fault: dict) -> RecoveryWindow | None:
    """The recovery from ``fault`` (None: no rank started again after it)."""
    t0 = fault["t_mono"]
    restart = next((e for e in events if e["kind"] == "restart" and e["rank"] is None and e["t_mono"] >= t0), None)
    who = min(restart["ranks"]) if restart and restart.get("ranks") else 0
    later = [e for e in events if e["rank"] == who and e["t_mono"] >= t0 and e["attempt"] > fault["attempt"]]
    start = first(later, "run_start")
    if start is None:
        return None
    trained = first(later, "step_end")
    # what the attempt that trained again loaded (an attempt that a later failure ended while it started loaded
    # nothing that survived)
    return RecoveryWindow(fault, first_detection(events, fault), restart, start,
                          first(later, "ckpt_loaded", attempt=(trained or start)["attempt"]), trained,
                          first(later, "resumed"))


def fault_windows(events: list[dict]) -> list[tuple[dict, RecoveryWindow | None]]:
    """Every ``fault_injected`` record in time order with its recovery window (each record, not one per planned
    point as ``injected`` keeps)."""
    faults = sorted((e for e in events if e["kind"] == "fault_injected"), key=lambda e: e["t_mono"])
    return [(fault, recovery_window(events, fault)) for fault in faults]


def recovery_seconds(faults: list[tuple[dict, RecoveryWindow | None]], whole: bool = False) -> list[float]:
    """The recovery of each of ``fault_windows``' faults after which a rank trained again, in seconds: the fault to
    the restarted rank's first loop start (detect, restart and load; the replay is left to the lost steps).
    ``whole``: only those that no later fault interrupted (the next fault comes after that start), the samples a
    fitted R stands for; else every one, interrupted or not (the projection's measure of a run)."""
    out = []
    for (fault, window), after in zip(faults, [*(f for f, _ in faults[1:]), None]):
        if window is None or window.first_step is None:
            continue
        end = step_start(window.first_step)
        if not whole or after is None or after["t_mono"] > end:
            out.append(end - fault["t_mono"])
    return out


JOB_RECORDS = ("job_lost", "job_resumed")  # what a resume writes about the jobs, not an event of the job that died


def last_job(events: list[dict]) -> list[dict]:
    """The events of the run's last job: from its ``job_resumed`` on (every event, for a run of one job)."""
    starts = [i for i, e in enumerate(events) if e["kind"] == "job_resumed"]
    return events[starts[-1]:] if starts else events


@dataclass(frozen=True)
class JobDeath:
    """How a job's own events end: its last event on the wall clock (for a job whose supervisor was killed, the
    job's death), and its last attempt and the furthest step that attempt reached."""

    last: dict
    attempt: int
    step: int


def job_death(events: list[dict]) -> JobDeath | None:
    """The end of the job whose events are ``events`` (None: it wrote nothing)."""
    own = [e for e in events if e["kind"] not in JOB_RECORDS]
    if not own:
        return None
    attempt = max(e["attempt"] for e in own)
    step = max((e["step"] for e in own if e["kind"] == "step_end" and e["attempt"] == attempt), default=0)
    return JobDeath(max(own, key=lambda e: e["t_wall"]), attempt, step)


@dataclass(frozen=True)
class JobRestart:
    """One job's death and the next job's return (``resume=``), its bounds events on the wall clock: the two jobs
    may run on different hosts, or across a reboot, where monotonic clocks do not compare."""

    died: dict  # the old job's last event
    died_step: int  # the furthest step of its last attempt
    resumed: dict  # the new job's ``job_resumed`` (its process's start: ``started_t_wall``)
    start: dict | None  # rank 0's first run_start in the new job
    loaded: dict | None  # what that attempt loaded
    first_step: dict | None  # rank 0's first step in the new job
    back: dict | None  # rank 0 at the step where the old job died: the lost work replayed

    @property
    def lost_steps(self) -> int | None:
        return None if self.start is None else max(0, self.died_step - (self.loaded["step"] if self.loaded else 0))


def job_restarts(events: list[dict]) -> list[JobRestart]:
    """Every resume of the run in a new job, in order."""
    starts = [i for i, e in enumerate(events) if e["kind"] == "job_resumed"]
    out = []
    for n, i in enumerate(starts):
        death = job_death(events[starts[n - 1] if n else 0:i])
        if death is None:
            continue
        rank0 = [e for e in events[i:starts[n + 1] if n + 1 < len(starts) else None] if e["rank"] == 0]
        start = first(rank0, "run_start")
        loaded = first(rank0, "ckpt_loaded", attempt=start["attempt"]) if start else None
        ready = loaded or start
        back = ready if ready and (loaded["step"] if loaded else 0) >= death.step else next(
            (e for e in rank0 if e["kind"] == "step_end" and e["step"] >= death.step), None)
        out.append(JobRestart(death.last, death.step, events[i], start, loaded, first(rank0, "step_end"), back))
    return out
