"""Every number in ``result.json``, derived from ``events.jsonl`` by one function.

Because metrics are computed from the log alone, a definition can change and old runs be re-scored with
``python -m resilience.result RUN_DIR`` without rerunning anything. Durations use ``t_mono`` (one host's
monotonic clock, comparable across its processes).
"""

from __future__ import annotations

import statistics
from typing import Any

SCHEMA_VERSION = 1


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _first(events: list[dict], kind: str, **match: Any) -> dict | None:
    return next((e for e in events if e["kind"] == kind and all(e.get(k) == v for k, v in match.items())), None)


def _pairs(rank0: list[dict], start: str, end: str) -> list[float]:
    """Durations from each ``start`` event to the ``end`` event of the same (attempt, step)."""
    begins = {(e["attempt"], e["step"]): e["t_mono"] for e in rank0 if e["kind"] == start}
    return [e["t_mono"] - begins[(e["attempt"], e["step"])] for e in rank0
            if e["kind"] == end and (e["attempt"], e["step"]) in begins]


def compute_result(events: list[dict], run: dict[str, Any]) -> dict[str, Any]:
    """The result of one run; ``run`` carries identity fields (strategy, fault, workload, seed, world_size, steps)."""
    sup = [e for e in events if e["rank"] is None]
    rank0 = [e for e in events if e["rank"] == 0]
    final_attempt = max((e["attempt"] for e in events if e["rank"] is not None), default=0)
    run_ends = [e for e in events if e["kind"] == "run_end" and e["attempt"] == final_attempt]
    fault = _first(events, "fault_injected")
    launch, end = _first(sup, "launch"), _first(sup, "supervisor_end")
    if launch is None and events:  # launched by torchrun: no supervisor events, the ranks' own span
        launch, end = events[0], {**events[-1], "outcome": "succeeded" if run_ends else "failed"}

    status = _status(end, len(run_ends) == run["world_size"], fault is not None, launch is not None)

    result: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "status": status,
        **run,
        "supervised": _first(sup, "launch") is not None,  # False under torchrun: no detection events
        "attempts": final_attempt + 1,
        "steps_completed": max((e["step"] for e in rank0 if e["kind"] == "step_end" and e["attempt"] == final_attempt),
                               default=0),
        "wall_time_s": end["t_mono"] - launch["t_mono"] if launch and end else None,
        **_fault_metrics(events, rank0, fault, status),
        **_checkpoint_metrics(rank0),
        "step_time_s": _median([e["duration_s"] for e in rank0 if e["kind"] == "step_end"]),
    }
    result["goodput"] = _goodput(rank0, result["wall_time_s"])
    hashes = {e["final_state_sha256"] for e in run_ends}
    result["final_state_sha256"] = next((e["final_state_sha256"] for e in run_ends if e["rank"] == 0), None)
    result["replicas_agree"] = len(hashes) == 1 if hashes else None
    return result


def _status(end: dict | None, complete: bool, faulted: bool, launched: bool) -> str:
    """ok: the supervisor succeeded and every rank ended; unrecovered: a fault spent the restart budget;
    interrupted: SIGINT/SIGTERM stopped the run, or its supervisor died (a launch with no end); else error."""
    outcome = end["outcome"] if end else None
    if outcome == "succeeded" and complete:
        return "ok"
    if outcome == "failed" and faulted:
        return "unrecovered"
    if outcome == "interrupted" or (launched and end is None):
        return "interrupted"
    return "error"


def _fault_metrics(events: list[dict], rank0: list[dict], fault: dict | None, status: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        "fault_injected": fault is not None,
        "fault_step": fault["step"] if fault else None,
        "fault_rank": fault["rank"] if fault else None,
        "detected": False, "detector": None, "detected_rank": None, "detected_rank_correct": None,
        "detection_latency_s": None, "detections": {},
        "recovered": False, "recovery_time_s": None,
        "recovery_breakdown_s": {"detect": None, "restart": None, "load": None, "replay": None},
        "lost_steps": None, "recovery_source": None, "recovery_bytes": None, "recovery_load_s": None,
        "survivors_restarted": None,
        "false_alarms": sum(1 for e in events if e["kind"] == "fault_detected"
                            and (fault is None or e["t_mono"] < fault["t_mono"])),
    }
    if fault is None:
        return out
    t0 = fault["t_mono"]
    for e in events:  # the first verdict of every detector that fired after the fault (the coverage table)
        if e["kind"] == "fault_detected" and e["t_mono"] >= t0 and e["detector"] not in out["detections"]:
            out["detections"][e["detector"]] = {"latency_s": e["t_mono"] - t0, "blamed_rank": e.get("blamed_rank")}
    detection = next((e for e in events if e["kind"] == "fault_detected" and e["t_mono"] >= t0), None)
    if detection:
        targets = set(fault.get("node_ranks") or [fault.get("target_rank", fault["rank"])])
        out.update(detected=True, detector=detection["detector"], detected_rank=detection.get("blamed_rank"),
                   detected_rank_correct=detection.get("blamed_rank") in targets,
                   detection_latency_s=detection["t_mono"] - t0)
    # The recovery as one restarted rank lived it: rank 0 when every rank restarts, else a replaced rank.
    restart = next((e for e in events if e["kind"] == "restart" and e["rank"] is None and e["t_mono"] >= t0), None)
    who = min(restart["ranks"]) if restart and restart.get("ranks") else 0
    later = [e for e in events if e["rank"] == who and e["t_mono"] >= t0 and e["attempt"] > fault["attempt"]]
    start = _first(later, "run_start")
    if start is None:
        return out
    loaded = _first(later, "ckpt_loaded", attempt=start["attempt"])
    # In place, survivors may be one step past the fault when it hits: nothing was lost then, not -1 steps.
    out["lost_steps"] = max(0, fault["step"] - (loaded["step"] if loaded else 0))
    out["recovery_source"] = loaded.get("source") if loaded else "none"
    out["recovery_bytes"] = loaded.get("bytes") if loaded else 0
    # The load's critical path over the ranks that loaded: from the last one starting to the last one done (a rank
    # that starts early only waits for its peers in the load's first collective: start-up skew, not load time).
    loads = [e for e in events if e["kind"] == "ckpt_loaded" and e["attempt"] == start["attempt"]
             and e["t_mono"] >= t0 and e.get("duration_s") is not None]
    out["recovery_load_s"] = (max(e["t_mono"] for e in loads) - max(e["t_mono"] - e["duration_s"] for e in loads)
                              if loads else None)
    out["survivors_restarted"] = restart is not None and not restart.get("ranks")
    resumed = _first(later, "resumed")
    if resumed is None or status != "ok":
        return out
    # Without a detection event (torchrun supervised the run) the restart segment starts at the fault.
    t_detect = detection["t_mono"] if detection else t0
    t_loaded = loaded["t_mono"] if loaded else start["t_mono"]
    out.update(recovered=True, recovery_time_s=resumed["t_mono"] - t0, recovery_breakdown_s={
        "detect": t_detect - t0 if detection else None,
        "restart": start["t_mono"] - t_detect,
        "load": t_loaded - start["t_mono"],
        "replay": resumed["t_mono"] - t_loaded,
    })
    return out


def _checkpoint_metrics(rank0: list[dict]) -> dict[str, Any]:
    durable = [e for e in rank0 if e["kind"] == "ckpt_durable"]
    return {
        "ckpt_count": len(durable),
        "ckpt_stall_s": _median(_pairs(rank0, "ckpt_begin", "ckpt_stall_end")),
        "ckpt_durable_s": _median(_pairs(rank0, "ckpt_begin", "ckpt_durable")),
        "ckpt_bytes": _median([e["bytes"] for e in durable]),
    }


def _goodput(rank0: list[dict], wall: float | None) -> float | None:
    """Productive step time over wall time: each step counts once, from the attempt whose result survived."""
    if not wall:
        return None
    last: dict[int, float] = {}
    for e in rank0:
        if e["kind"] == "step_end":
            last[e["step"]] = e["duration_s"]  # a replayed step overwrites the lost one
    return sum(last.values()) / wall
