"""Metric definitions on a hand-written event log, so each number can be checked by hand."""

from __future__ import annotations

from resilience.record.metrics import compute_result

RUN = {"strategy": "sync", "fault": "kill", "workload": "gpt_tiny", "seed": 0, "world_size": 2, "steps": 4}


def ev(t, kind, rank=0, attempt=0, step=0, **kw):
    return {"t_mono": t, "t_wall": t, "kind": kind, "rank": rank, "attempt": attempt, "step": step, **kw}


def recovered_log():
    return [
        ev(0.0, "launch", rank=None),
        ev(1.0, "run_start"), ev(1.0, "run_start", rank=1),
        ev(1.5, "step_end", step=1, duration_s=0.5),
        ev(2.0, "step_end", step=2, duration_s=0.5),
        ev(2.0, "ckpt_begin", step=2), ev(2.2, "ckpt_durable", step=2, bytes=1000), ev(2.3, "ckpt_stall_end", step=2),
        ev(2.5, "step_end", step=3, duration_s=0.5),
        ev(2.6, "fault_injected", rank=1, step=3),
        ev(2.7, "fault_detected", rank=None, detector="process_exit", blamed_rank=1),
        ev(2.8, "restart", rank=None, attempt=1),
        ev(4.0, "run_start", attempt=1), ev(4.0, "run_start", rank=1, attempt=1),
        ev(4.4, "ckpt_loaded", attempt=1, step=2, source="disk", bytes=1000),
        ev(4.9, "step_end", attempt=1, step=3, duration_s=0.5),
        ev(4.9, "resumed", attempt=1, step=3),
        ev(5.4, "step_end", attempt=1, step=4, duration_s=0.5),
        ev(5.5, "run_end", attempt=1, step=4, final_state_sha256="abc"),
        ev(5.5, "run_end", rank=1, attempt=1, step=4, final_state_sha256="abc"),
        ev(6.0, "supervisor_end", rank=None, attempt=1, outcome="succeeded"),
    ]


def test_recovery_metrics():
    r = compute_result(recovered_log(), RUN)
    assert r["status"] == "ok" and r["recovered"] and r["detected"]
    assert r["fault_step"] == 3 and r["fault_rank"] == 1 and r["detected_rank"] == 1
    assert abs(r["detection_latency_s"] - 0.1) < 1e-9
    assert abs(r["recovery_time_s"] - 2.3) < 1e-9
    b = r["recovery_breakdown_s"]
    assert [round(b[k], 6) for k in ("detect", "restart", "load", "replay")] == [0.1, 1.3, 0.4, 0.5]
    assert abs(sum(b.values()) - r["recovery_time_s"]) < 1e-9
    assert r["lost_steps"] == 1
    assert r["ckpt_count"] == 1 and r["ckpt_bytes"] == 1000
    assert abs(r["ckpt_stall_s"] - 0.3) < 1e-9 and abs(r["ckpt_durable_s"] - 0.2) < 1e-9
    assert abs(r["goodput"] - 4 * 0.5 / 6.0) < 1e-9  # step 3 counted once though it ran twice
    assert r["final_state_sha256"] == "abc" and r["replicas_agree"]
    assert r["false_alarms"] == 0 and r["steps_completed"] == 4


def test_exhausted_budget_is_unrecovered_and_detection_without_fault_is_a_false_alarm():
    log = recovered_log()[:11] + [ev(3.0, "supervisor_end", rank=None, outcome="failed")]
    r = compute_result(log, RUN)
    assert r["status"] == "unrecovered" and not r["recovered"] and r["final_state_sha256"] is None
    quiet = [e for e in recovered_log() if e["kind"] != "fault_injected"]
    assert compute_result(quiet, RUN)["false_alarms"] == 1


def test_harness_failure_without_fault_is_an_error():
    log = [ev(0.0, "launch", rank=None), ev(1.0, "run_start"), ev(2.0, "supervisor_end", rank=None, outcome="failed")]
    assert compute_result(log, RUN)["status"] == "error"
