"""Every number in ``result.json``, derived from ``events.jsonl`` by one function.

Because metrics are computed from the log alone, a definition can change and old runs be re-scored with
``python -m resilience.result RUN_DIR`` without rerunning anything. Durations use ``t_mono`` (one host's
monotonic clock, comparable across its processes).
"""

from __future__ import annotations

from typing import Any

from resilience.record.inprocess import inprocess_recovery
from resilience.record.query import (JobRestart, RecoveryWindow, durable_times, first, first_detection, injected,
                                     job_restarts, last_job, load_window, loads, median, productive_step_times,
                                     recovery_window, stalls, step_start, step_times)
from resilience.record.replicas import replica_groups, replica_recovery
from resilience.record import windows
from resilience.record.world import world_sizes

# 2: mttr_s counts from the fault (detection included; the part after it is restore_s); drain added
SCHEMA_VERSION = 2


def compute_result(events: list[dict], run: dict[str, Any]) -> dict[str, Any]:
    """The result of one run; ``run`` carries identity fields (strategy, fault, workload, seed, world_size, steps)."""
    sup = [e for e in events if e["rank"] is None]
    rank0 = [e for e in events if e["rank"] == 0]
    final_attempt = max((e["attempt"] for e in events if e["rank"] is not None), default=0)
    run_ends = [e for e in events if e["kind"] == "run_end" and e["attempt"] == final_attempt]
    fault = first(events, "fault_injected")
    # The run starts with its first job's launch and ends with its last job's end (resume=: a run of several jobs)
    launch, end = first(sup, "launch"), first(last_job(sup), "supervisor_end")
    if launch is None and events:  # launched by torchrun: no supervisor events, the ranks' own span
        launch, end = events[0], {**events[-1], "outcome": "succeeded" if run_ends else "failed"}

    # every rank of the final attempt ended; after recovery=shrink it has fewer ranks than the run started with
    final_world = next((e["world_size"] for e in events if e["kind"] == "run_start" and e["attempt"] == final_attempt
                        and "world_size" in e), run["world_size"])
    status = _status(end, len(run_ends) == final_world, fault is not None, launch is not None)
    restarts = job_restarts(events)
    clock = "t_wall" if restarts else "t_mono"

    result: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "status": status,
        **run,
        # False under torchrun (launched by it, or supervisor.launcher=torchrun): no detection events
        "supervised": launch is not None and launch.get("recovery") not in ("torchrun", "ft_launcher") and launch["rank"] is None,
        "attempts": final_attempt + 1,
        # how the first attempt's ranks started, and every later start (resilience.proc.zygote): None if none
        **_process_starts(events),
        "steps_completed": max((e["step"] for e in rank0 if e["kind"] == "step_end" and e["attempt"] == final_attempt),
                               default=0),
        # across jobs on the wall clock: a resumed job may run on another host
        "wall_time_s": end[clock] - launch[clock] if launch and end else None,
        **_fault_metrics(events, fault, status),
        **_checkpoint_metrics(rank0),
        "step_time_s": median(step_times(rank0)),
        "shadow": _shadow(events),
        "stage_log": _stage_log(events),
    }
    # why the supervisor ended the run before its restart budget (``replica`` with every replica lost), else None
    result["unrecoverable"] = (first(sup, "unrecoverable") or {}).get("reason")
    result["goodput"] = _goodput(rank0, result["wall_time_s"])
    result["ettr"] = _ettr(rank0)
    result.update(_peer(events))
    result["torch_workarounds"] = _torch_workarounds(events)
    result.update(replica_groups(events, run["world_size"]))
    result.update(replica_recovery(events, run["world_size"]))  # our replica's, under the same names
    inexact = first(events, "ckpt_loaded_inexact")  # a restore that is an approximation by design (quantized rows)
    if inexact is not None:
        result["bit_exact"] = f"not by design: {inexact['why']}"
    result.update(world_sizes(events, launch))  # recovery=shrink|grow: the sizes trained at (none if it kept its size)
    result.update(inprocess_recovery(events))  # NVRx's in-process restart: in place, or the supervisor's fallback
    result.update(_job_restarts(restarts))  # resume=: the whole job died and a new one went on
    result["notice"] = _notice(events)  # fault=preempt, checkpoint.on_notice: what the job made of its notice
    result["drain"] = _drain(events)  # fault=drain: whether the node's ranks moved to spares before it went
    result["final_loss"] = _final_loss(events)  # every run: the report compares it with the reference's
    result["validity"] = _validity(first(sup, "host_load"), events)
    memory = first(sup, "host_memory")  # the run's process tree, peak PSS (resilience.record.memory)
    result["host_memory_peak_bytes"] = memory["peak_pss_bytes"] if memory else None
    hashes = {e["final_state_sha256"] for e in run_ends}
    result["final_state_sha256"] = next((e["final_state_sha256"] for e in run_ends if e["rank"] == 0), None)
    result["replicas_agree"] = len(hashes) == 1 if hashes else None
    return result


def _process_starts(events: list[dict]) -> dict[str, str | None]:
    """``first_start`` and ``restarts``: preloaded (forked from the zygote) or cold, per the ranks' ``run_start``;
    ``supervisor_start``: forked from the pipeline's pool or cold (the first job's ``launch``)."""
    seen: set = set()
    first, later = [], []
    for e in events:
        if e["kind"] == "run_start":
            (later if e["rank"] in seen else first).append(bool(e.get("preloaded")))
            seen.add(e["rank"])
    launch = next((e for e in events if e["kind"] == "launch"), {})
    return {"supervisor_start": launch.get("supervisor", "cold"), "first_start": "preloaded" if any(first) else "cold",
            "restarts": ("preloaded" if any(later) else "cold") if later else None}


def _validity(load: dict | None, events: list[dict]) -> dict[str, Any]:
    """Whether the host was quiet enough while the run was measured (``resilience.record.host_load``), over the
    whole run and over each checkpoint and recovery window (``resilience.record.windows``): "valid", "noisy" (with
    the figures over their thresholds, and where) or "unknown" (not recorded: an older run, or no /proc)."""
    if load is None or load.get("other_cpu_frac") is None:
        return {"verdict": "unknown", "reasons": []}
    limits = load.get("thresholds", {})
    checks = (("other_cpu_frac", "max_other_cpu", "other processes' CPU"), ("steal_frac", "max_steal", "CPU steal"),
              ("memory_pressure_max", "max_memory_pressure", "memory pressure"))
    reasons = [f"{label} {load[key]:.3g} > {limits[limit]} over the run" for key, limit, label in checks
               if load.get(key) is not None and limit in limits and load[key] > limits[limit]]
    reasons += windows.reasons(load, events)
    figures = {k: load.get(k) for k in ("other_cpu_frac", "steal_frac", "load_max", "cpu_pressure_max",
                                        "memory_pressure_max", "cpus")}
    return {"verdict": "noisy" if reasons else "valid", "reasons": reasons, **figures}


def _final_loss(events: list[dict]) -> float | None:
    """The mean over the ranks of the loss of the last step each trained (the run's last step)."""
    last = {e["rank"]: (e["step"], e["loss"]) for e in events if e["kind"] == "step_end" and "loss" in e}
    end = max((s for s, _ in last.values()), default=None)
    losses = [loss for s, loss in last.values() if s == end]
    return sum(losses) / len(losses) if losses else None


def _torch_workarounds(events: list[dict]) -> list[str]:
    """The uses of private torch (or torch library) internals that acted in any process of the run, by name
    (``resilience.record.torch_workarounds``)."""
    return sorted({e["name"] for e in events if e["kind"] == "torch_workaround"})


def _peer(events: list[dict]) -> dict[str, Any]:
    """The checkpointing library a peer strategy ran (name, version, settings) and the workarounds applied to it."""
    peer = first(events, "peer_library")
    # Processes a library started in a rank that outlived it (the supervisor killed them at the end of the run).
    orphans = [cmd for e in events if e["kind"] == "orphans_killed" for cmd in e["processes"]]
    if peer is None:
        return {"peer": None, "peer_patches": [], "orphans_killed": orphans}
    return {"peer": {"library": peer["library"], "version": peer["version"], "settings": peer.get("settings", {})},
            "peer_patches": [p["name"] for p in peer["patches"]], "orphans_killed": orphans}


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


def _fault_metrics(events: list[dict], fault: dict | None, status: str) -> dict[str, Any]:
    """Detection and recovery of the run's first injected fault (the defaults when there is none), and the count
    and outline of every fault."""
    out: dict[str, Any] = {
        "fault_injected": fault is not None,
        "fault_step": fault["step"] if fault else None,
        # the configured rank: a node loss is recorded by each of the node's ranks, the first of them not always it
        "fault_rank": fault.get("target_rank", fault["rank"]) if fault else None,
        **_detection(events, fault),
        "recovered": False, "recovery_time_s": None, "mttr_s": None, "restore_s": None, "lost_work_s": None,
        "recovery_breakdown_s": {"detect": None, "restart": None, "load": None, "replay": None},
        "lost_steps": None, "recovery_source": None, "recovery_bytes": None, "recovery_load_s": None,
        "survivors_restarted": None, "ranks_restarted": None,
        "false_alarms": _false_alarms(events, fault),
    }
    out.update(_every_fault(events, status))
    window = recovery_window(events, fault) if fault else None
    if window is None:
        return out
    out.update(_what_was_loaded(events, window))
    if status == "ok" and window.resumed is not None:
        out.update(_recovery_time(window))
    return out


def _every_fault(events: list[dict], status: str) -> dict[str, Any]:
    """Each fault of the run, in order (several with ``fault.at_step=[...]``): its step, phase and rank, and whether
    training got back to its step; the fields above describe the first alone."""
    faults = []
    for fault in injected(events):
        window = recovery_window(events, fault)
        back = status == "ok" and window is not None and window.resumed is not None
        faults.append({"step": fault["step"], "phase": fault.get("phase"),
                       "rank": fault.get("target_rank", fault["rank"]), "recovered": back,
                       "recovery_time_s": window.resumed["t_mono"] - fault["t_mono"] if back else None,
                       "lost_steps": window.lost_steps if window is not None else None})
    return {"faults_injected": len(faults), "recoveries": sum(f["recovered"] for f in faults), "faults": faults}


def _false_alarms(events: list[dict], fault: dict | None) -> int:
    """Detections before the fault (all of them in a fault-free run)."""
    return sum(1 for e in events if e["kind"] == "fault_detected" and (fault is None or e["t_mono"] < fault["t_mono"]))


def _detection(events: list[dict], fault: dict | None) -> dict[str, Any]:
    """The first verdict after the fault: which detector, whom it blamed (and whether rightly: a node loss blames
    any rank of the node), how long after the fault's record; and every detector's first verdict (coverage)."""
    out: dict[str, Any] = {"detected": False, "detector": None, "detected_rank": None,
                           "detected_rank_correct": None, "detection_latency_s": None, "detections": {}}
    if fault is None:
        return out
    for e in events:
        if e["kind"] == "fault_detected" and e["t_mono"] >= fault["t_mono"] and e["detector"] not in out["detections"]:
            out["detections"][e["detector"]] = {"latency_s": e["t_mono"] - fault["t_mono"],
                                                "blamed_rank": e.get("blamed_rank")}
    detection = first_detection(events, fault)
    if detection:
        targets = set(fault.get("node_ranks") or [fault.get("target_rank", fault["rank"])])
        out.update(detected=True, detector=detection["detector"], detected_rank=detection.get("blamed_rank"),
                   detected_rank_correct=detection.get("blamed_rank") in targets,
                   detection_latency_s=detection["t_mono"] - fault["t_mono"])
    return out


def _what_was_loaded(events: list[dict], window: RecoveryWindow) -> dict[str, Any]:
    """Lost steps, where the state came from, its bytes, the load's critical path, and whether survivors
    restarted."""
    fault, loaded = window.fault, window.loaded
    # A rank other than the fault's victims started again in the recovery's attempt or a later one before the
    # recovery was over (under torchrun there is no restart event of ours to ask, so the ranks' own starts tell; a
    # victim's peer that fails a poll later, e.g. torchft's replica group mate, is replaced one attempt later).
    until = window.resumed["t_mono"] if window.resumed else float("inf")
    started = {e["rank"] for e in events if e["kind"] == "run_start" and e["attempt"] >= window.start["attempt"]
               and e["t_mono"] <= until}
    victims = set(fault.get("node_ranks") or [fault.get("target_rank", fault["rank"])])
    return {
        "lost_steps": window.lost_steps,
        "recovery_source": loaded.get("source") if loaded else "none",
        "recovery_bytes": loaded.get("bytes") if loaded else 0,
        "recovery_load_s": _load_time(events, window),
        "survivors_restarted": bool(started - victims),
        "ranks_restarted": sorted(started),  # every rank started again in the recovery (replace_failed: the lost)
    }


def _load_time(events: list[dict], window: RecoveryWindow) -> float | None:
    """The recovery's load: its critical path over the ranks of the restarted rank's attempt."""
    span = load_window(loads(events, window.start["attempt"], since=window.fault["t_mono"]))
    return span[1] - span[0] if span else None


def _recovery_time(window: RecoveryWindow) -> dict[str, Any]:
    """From the fault to the restarted rank reaching its step again = detect + restart + load + replay. Without a
    detection event (torchrun supervised the run) the restart segment starts at the fault."""
    detection, t0 = window.detection, window.fault["t_mono"]
    t_detect = detection["t_mono"] if detection else t0
    t_loaded = window.ready["t_mono"]
    # MTTR: from the fault to training running again (detection included, since an undetected fault is down time
    # too), without the replay of lost work, which is lost_work_s (time) beside lost_steps (count); the part after
    # detection, the restore (restart + load), keeps its own name.
    return {"recovered": True, "recovery_time_s": window.resumed["t_mono"] - t0,
            "mttr_s": t_loaded - t0, "restore_s": t_loaded - t_detect,
            "lost_work_s": window.resumed["t_mono"] - t_loaded,
            "recovery_breakdown_s": {
        "detect": t_detect - t0 if detection else None,
        "restart": window.start["t_mono"] - t_detect,
        "load": t_loaded - window.start["t_mono"],
        "replay": window.resumed["t_mono"] - t_loaded,
    }}


def _notice(events: list[dict]) -> dict[str, Any] | None:
    """A preemption's notice (fault=preempt): its grace period, and with checkpoint.on_notice the step saved on it
    and how long after the SIGTERM it was durable; ``fitted``: durable within the grace period (None: no save was
    tried). None when the run had no notice."""
    given = first(events, "fault_injected", fault="preempt")
    noticed, saved = first(events, "notice", rank=0), first(events, "notice_saved", rank=0)
    if given is None and noticed is None:
        return None
    grace = given.get("grace_s") if given else None
    return {"grace_s": grace, "step": noticed["step"] if noticed else None,
            "saved_s": saved["saved_s"] if saved else None,
            "fitted": None if noticed is None else saved is not None and (grace is None or saved["saved_s"] <= grace)}


def _drain(events: list[dict]) -> dict[str, Any] | None:
    """A node's maintenance notice (fault=drain): the step at which its ranks left, whether they left before the
    node went (``moved``), ``left_s`` from the notice to the last of them leaving, and ``stopped_s``: the time no
    rank trained, from the staying ranks' handover to the start of the first step after it (waiting for the spares,
    forming the group, the heal). None when the run had no such notice."""
    given = first(events, "fault_injected", fault="drain")
    if given is None:
        return None
    t0, drained, handover = given["t_mono"], [e for e in events if e["kind"] == "drained"], first(events, "handover")
    trained = next((e for e in events if handover and e["kind"] == "step_end" and e["t_mono"] > handover["t_mono"]),
                   None)
    left_s = max(e["t_mono"] for e in drained) - t0 if drained else None
    return {"notice_s": given["notice_s"], "ranks": sorted(e["rank"] for e in drained),
            "step": drained[0]["step"] if drained else None,
            "moved": left_s is not None and left_s <= given["notice_s"], "left_s": left_s,
            "stopped_s": trained["t_mono"] - trained["duration_s"] - handover["t_mono"] if trained else None}


def _job_restarts(restarts: list[JobRestart]) -> dict[str, Any]:
    """How many jobs the run took, and each job restart: from the old job's death (its last event) to the new job
    back at the step where it died = the gap until the new job's process started (whatever started it) + its
    start-up until rank 0's start + load + replay; ``first_step_s``: until the new job's first step."""
    out = []
    for j in restarts:
        t0, ready = j.died["t_wall"], j.loaded or j.start
        started = j.resumed["started_t_wall"]
        out.append({
            "job": j.resumed["job"], "first_attempt": j.resumed["first_attempt"], "died_at_step": j.died_step,
            "loaded_step": (j.loaded["step"] if j.loaded else 0) if j.start else None, "lost_steps": j.lost_steps,
            "job_restart_s": j.back["t_wall"] - t0 if j.back else None,
            "first_step_s": j.first_step["t_wall"] - t0 if j.first_step else None,
            "breakdown_s": {"gap": started - t0, "startup": j.start["t_wall"] - started if j.start else None,
                            "load": ready["t_wall"] - j.start["t_wall"] if j.start else None,
                            "replay": j.back["t_wall"] - ready["t_wall"] if j.back and ready else None}})
    return {"jobs": len(restarts) + 1, "job_restarts": out}


def _checkpoint_metrics(rank0: list[dict]) -> dict[str, Any]:
    durable = [e for e in rank0 if e["kind"] == "ckpt_durable"]
    # a background save's stall holds the wait for the previous persist when the interval is too short for it
    # (back-pressure): apart, the snapshot's own cost and that wait
    waited = {(e["attempt"], e["step"]): e["duration_s"] for e in rank0 if e["kind"] == "ckpt_persist_waited"}
    taken = stalls(rank0)
    waits = [waited.get((s.attempt, s.step), 0.0) for s in taken]
    return {
        "ckpt_count": len(durable),
        "ckpt_stall_s": median([s.seconds for s in taken]),
        "ckpt_snapshot_stall_s": median([s.seconds - w for s, w in zip(taken, waits)]),
        "ckpt_persist_wait_s": sum(waits) / len(waits) if waits else None,
        "ckpt_persist_waits": sum(w > 0 for w in waits),
        "ckpt_durable_s": median([s.seconds for s in durable_times(rank0)]),
        "ckpt_bytes": median([e["bytes"] for e in durable]),
        # checkpoint.every=auto: every interval it chose, from which step, and why (resilience.strategies.interval)
        "checkpoint_intervals": [{"step": e["step"], "interval": e["interval"], "reason": e["reason"]}
                                 for e in rank0 if e["kind"] == "ckpt_interval"],
    }


def _shadow(events: list[dict]) -> dict[str, Any] | None:
    """strategy=shadow: how far behind the training its shadow ran (``shadow_lag``, every ``report_every`` applied
    steps: the published step to the applied one), over the run; None for any other strategy."""
    lags = [e for e in events if e["kind"] == "shadow_lag"]
    if not lags:
        return None
    steps = sum(e["steps"] for e in lags)
    return {"applied_steps": steps, "lag_s_mean": sum(e["lag_s_mean"] * e["steps"] for e in lags) / steps,
            "lag_s_max": max(e["lag_s_max"] for e in lags), "lag_steps_max": max(e["lag_steps_max"] for e in lags),
            "apply_s_mean": sum(e["apply_s_mean"] * e["steps"] for e in lags) / steps}


def _stage_log(events: list[dict]) -> dict[str, Any] | None:
    """strategy=swift_log: what its boundary log cost (``log_discarded``, after each committed checkpoint: the most
    one step logged and the most held in memory, per stage, summed over the stages as the pipeline pays them) and
    what its recovery recomputed (``stage_replayed``: stage-steps replayed alone, their time, the log received;
    ``stage_loaded`` by a survivor that stepped back, under selective logging). None for any other strategy."""
    kept = [e for e in events if e["kind"] == "log_discarded"]
    replays = [e for e in events if e["kind"] == "stage_replayed"]
    if not kept and not replays:
        return None
    step_bytes: dict[int, int] = {}
    held: dict[int, int] = {}
    for e in kept:  # events of an older run carry neither field: 0
        step_bytes[e["rank"]] = max(step_bytes.get(e["rank"], 0), e.get("step_bytes_max", 0))
        held[e["rank"]] = max(held.get(e["rank"], 0), e.get("held_peak", 0))
    return {"bytes_per_step": sum(step_bytes.values()), "held_peak_bytes": sum(held.values()),
            "replayed_stage_steps": sum(e["steps"] for e in replays),
            "replay_s": sum(e["duration_s"] for e in replays),
            "received_bytes": sum(e["received_bytes"] for e in replays)}


def _ettr(rank0: list[dict]) -> float | None:
    """Effective training time ratio (Kokolis et al., "Revisiting Reliability in Large-Scale Machine Learning
    Research Clusters", arXiv:2410.21680): productive step time over the job's time from its first training step to
    its last. The one-time start-up and tear-down, which a real job amortizes over days, are outside; every
    restart, load, replay and checkpoint stall inside counts against it."""
    ends = [e for e in rank0 if e["kind"] == "step_end"]
    if not ends:
        return None
    window = max(e["t_mono"] for e in ends) - min(step_start(e) for e in ends)
    return _goodput(rank0, window)


def _goodput(rank0: list[dict], wall: float | None) -> float | None:
    """Productive step time over wall time: each step counts once, from the attempt whose result survived."""
    if not wall:
        return None
    return sum(productive_step_times(rank0).values()) / wall
