"""``python -m resilience.trace RUN_DIR [--out FILE]``: a run's ``events.jsonl`` as a Chrome / Perfetto trace.

The trace is JSON in the Trace Event Format (the JSON object form: ``{"traceEvents": [...]}``), which Perfetto's UI
(ui.perfetto.dev, "Open trace file") and ``chrome://tracing`` open. One process is the run; its tracks (threads)
are the supervisor, one per rank, and "recovery":

* rank tracks: each training step (``step N``; a step that a later attempt ran again is ``lost step N``), the
  start-up of each attempt (from the launch or the restart to the rank's ``run_start``), checkpoint stalls, and
  checkpoint loads; the time until a checkpoint is durable (it may outlast the next steps) is an async slice;
  every other event (a fault, an error, a rejected checkpoint) is an instant with the event's fields as args;
* supervisor track: its life, detections and restarts, as instants;
* recovery track: the phases of each injected fault's recovery, bounded by the events that
  resilience/record/metrics.py measures ``recovery_breakdown_s`` between: detect (fault injected to its
  detection), restart (detection to the restarted rank's ``run_start``), load (to its checkpoint loaded) and
  replay (to its ``resumed`` at the fault's step).

Time is seconds since the launch on the supervisor's monotonic clock (microseconds in the file); a run whose events
come from several hosts uses their wall clocks instead, whose monotonic clocks do not compare.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from resilience.record.events import EVENTS_FILE, read_events
from resilience.record.fsio import atomic_write_json
from resilience.record.query import durable_times, first_detection, recovery_window, stalls

TRACE_FILE = "trace.json"
PID = 1
SUPERVISOR_TID, RECOVERY_TID = 0, 100_000  # rank r is track r + 1; recovery last
BORING = {"step_end", "run_start", "ckpt_begin", "ckpt_stall_end", "ckpt_durable", "ckpt_loaded"}  # drawn as slices


def tid(rank: int | None) -> int:
    return SUPERVISOR_TID if rank is None else rank + 1


class Trace:
    """The trace events of one run, built from its event list."""

    def __init__(self, events: list[dict[str, Any]], name: str) -> None:
        self.events = events
        self.name = name
        multi_host = len({e.get("host") for e in events}) > 1
        self.clock = "t_wall" if multi_host else "t_mono"
        launch = next((e for e in events if e["kind"] == "launch"), events[0] if events else {self.clock: 0.0})
        self.t0 = launch[self.clock]
        self.launch = launch
        self.out: list[dict[str, Any]] = []

    def us(self, t: float) -> int:
        """Whole microseconds since the launch: a slice that ends where the next begins shares its time exactly
        (fractions rounded apart would overlap, which a track's slices must not)."""
        return round((t - self.t0) * 1e6)

    def slice(self, track: int, name: str, cat: str, start: float, end: float, **args: Any) -> None:
        self.out.append({"ph": "X", "pid": PID, "tid": track, "name": name, "cat": cat, "ts": self.us(start),
                         "dur": max(self.us(end) - self.us(start), 0), "args": args})

    def instant(self, track: int, name: str, cat: str, t: float, args: dict[str, Any]) -> None:
        self.out.append({"ph": "i", "s": "t", "pid": PID, "tid": track, "name": name, "cat": cat, "ts": self.us(t),
                         "args": args})

    def build(self) -> dict[str, Any]:
        self._tracks()
        self._steps_and_saves()
        self._recovery()
        return {"traceEvents": self.out, "displayTimeUnit": "ms",
                "otherData": {"run": self.name, "clock": self.clock, "source": EVENTS_FILE}}

    def _tracks(self) -> None:
        ranks = sorted({e["rank"] for e in self.events if e["rank"] is not None})
        names = [(SUPERVISOR_TID, "supervisor")] + [(tid(r), f"rank {r}") for r in ranks] + [(RECOVERY_TID, "recovery")]
        self.out.append({"ph": "M", "pid": PID, "tid": 0, "name": "process_name", "args": {"name": f"run {self.name}"}})
        for i, (track, label) in enumerate(names):
            self.out.append({"ph": "M", "pid": PID, "tid": track, "name": "thread_name", "args": {"name": label}})
            self.out.append({"ph": "M", "pid": PID, "tid": track, "name": "thread_sort_index", "args": {"sort_index": i}})

    def _steps_and_saves(self) -> None:
        clock = self.clock
        last_attempt: dict[tuple, int] = {}
        for e in self.events:
            if e["kind"] == "step_end":
                key = (e["rank"], e["step"])
                last_attempt[key] = max(last_attempt.get(key, -1), e["attempt"])
        starts = {0: self.launch[clock]} | {e["attempt"]: e[clock] for e in self.events if e["kind"] == "restart"}
        end = next((e for e in self.events if e["kind"] == "supervisor_end"), self.events[-1])
        self.slice(SUPERVISOR_TID, "supervisor", "supervisor", self.launch[clock], end[clock])
        for e in self.events:
            kind, t, track = e["kind"], e[clock], tid(e["rank"])
            if kind == "step_end":
                lost = last_attempt[(e["rank"], e["step"])] > e["attempt"]
                self.slice(track, f"{'lost step' if lost else 'step'} {e['step']}", "lost step" if lost else "step",
                           t - e.get("duration_s", 0.0), t, attempt=e["attempt"], loss=e.get("loss"))
            elif kind == "run_start":
                self.slice(track, "start-up", "start-up", starts.get(e["attempt"], t), t, attempt=e["attempt"])
            elif kind == "ckpt_loaded":
                self.slice(track, "checkpoint load", "checkpoint", t - e.get("duration_s", 0.0), t,
                           source=e.get("source"), bytes=e.get("bytes"))
            if kind not in BORING:
                args = {k: v for k, v in e.items() if k not in ("t_wall", "t_mono", "kind", "rank", "host")}
                self.instant(track, kind, _category(kind), t, args)
        for s in stalls(self.events, clock):
            self.slice(tid(s.rank), f"checkpoint stall {s.step}", "checkpoint", s.start, s.end, attempt=s.attempt)
        for n, s in enumerate(durable_times(self.events, clock)):
            # Async: an asynchronous save is durable after later steps began; slices on a track must nest.
            common = {"pid": PID, "tid": tid(s.rank), "cat": "checkpoint", "name": f"until durable {s.step}", "id": n}
            self.out.append({"ph": "b", "ts": self.us(s.start), **common, "args": {"bytes": s.closing.get("bytes")}})
            self.out.append({"ph": "e", "ts": self.us(s.end), **common})

    def _recovery(self) -> None:
        """Per injected fault, the phases between the events that result.json's recovery_breakdown_s measures
        (the same functions pick them: the restarted rank's run_start, load and resume)."""
        clock = self.clock
        for fault in (e for e in self.events if e["kind"] == "fault_injected"):
            label = f"step {fault['step']}, rank {fault.get('target_rank', fault['rank'])}"
            detection = first_detection(self.events, fault)
            rec = recovery_window(self.events, fault)
            t_detect = detection[clock] if detection else fault[clock]
            if detection:
                self.slice(RECOVERY_TID, "detect", "recovery", fault[clock], t_detect, fault=label,
                           detector=detection.get("detector"))
            if rec is None:
                continue
            t_loaded = rec.ready[clock]
            self.slice(RECOVERY_TID, "restart", "recovery", t_detect, rec.start[clock], fault=label)
            self.slice(RECOVERY_TID, "load", "recovery", rec.start[clock], t_loaded, fault=label,
                       source=rec.loaded.get("source") if rec.loaded else "none")
            if rec.resumed:
                self.slice(RECOVERY_TID, "replay", "recovery", t_loaded, rec.resumed[clock], fault=label)


def _category(kind: str) -> str:
    """The trace category of an instant: ``fault``, ``detection``, else the event kind's first word (ckpt, rank)."""
    return {"fault_injected": "fault", "fault_detected": "detection"}.get(kind, kind.split("_")[0])


def trace(run_dir: Path) -> dict[str, Any]:
    """The trace of the run in ``run_dir`` (from its events.jsonl)."""
    events = read_events(run_dir)
    if not events:
        raise ValueError(f"{run_dir}: no {EVENTS_FILE} (or an empty one)")
    return Trace(events, run_dir.resolve().name).build()


def write_trace(run_dir: Path, out: Path | None = None) -> Path:
    out = out or run_dir / TRACE_FILE
    atomic_write_json(out, trace(run_dir))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m resilience.trace", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a run directory holding events.jsonl")
    parser.add_argument("--out", type=Path, help=f"where to write the trace (default: RUN_DIR/{TRACE_FILE})")
    args = parser.parse_args(argv)
    try:
        out = write_trace(args.run_dir, args.out)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{out}: open it in https://ui.perfetto.dev (Open trace file) or chrome://tracing")
    return 0


if __name__ == "__main__":
    sys.exit(main())
