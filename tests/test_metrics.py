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


def test_literature_metrics():
    r = compute_result(recovered_log(), RUN)
    assert abs(r["mttr_s"] - (0.1 + 1.3 + 0.4)) < 1e-9  # the fault to training again: detect + restart + load
    assert abs(r["restore_s"] - (1.3 + 0.4)) < 1e-9  # from the detection: restart + load, no replay
    assert abs(r["lost_work_s"] - 0.5) < 1e-9  # the replay of step 3
    # ETTR: the same 4 productive steps over the first step's start (1.0) to the last step's end (5.4)
    assert abs(r["ettr"] - 4 * 0.5 / 4.4) < 1e-9 and r["ettr"] > r["goodput"]


def test_exhausted_budget_is_unrecovered_and_detection_without_fault_is_a_false_alarm():
    log = recovered_log()[:11] + [ev(3.0, "supervisor_end", rank=None, outcome="failed")]
    r = compute_result(log, RUN)
    assert r["status"] == "unrecovered" and not r["recovered"] and r["final_state_sha256"] is None
    quiet = [e for e in recovered_log() if e["kind"] != "fault_injected"]
    assert compute_result(quiet, RUN)["false_alarms"] == 1


def test_harness_failure_without_fault_is_an_error():
    log = [ev(0.0, "launch", rank=None), ev(1.0, "run_start"), ev(2.0, "supervisor_end", rank=None, outcome="failed")]
    assert compute_result(log, RUN)["status"] == "error"


def continued_log():
    """Our replica with ``while_replacing=continue``: rank 1 dies after step 2, rank 0 trains steps 3 and 4 alone,
    the replacement starts, heals at step 4 and both train step 5 (the heal is replica_heal, the survivor's side
    rejoined)."""
    return [
        ev(0.0, "launch", rank=None),
        ev(1.0, "run_start"), ev(1.0, "run_start", rank=1),
        ev(1.0, "replica_mode", while_replacing="continue"), ev(1.0, "replica_mode", rank=1, while_replacing="continue"),
        ev(1.5, "step_end", step=1, loss=3.0, duration_s=0.5), ev(1.5, "step_end", rank=1, step=1, loss=3.0,
                                                                   duration_s=0.5),
        ev(2.0, "step_end", step=2, loss=2.5, duration_s=0.5), ev(2.0, "step_end", rank=1, step=2, loss=2.5,
                                                                   duration_s=0.5),
        ev(2.1, "fault_injected", rank=1, step=2),
        ev(2.2, "peer_lost", step=2), ev(2.2, "fault_detected", rank=None, detector="process_exit", blamed_rank=1),
        ev(2.3, "restart", rank=None, attempt=1, ranks=[1]),
        ev(2.4, "reduced_group", attempt=1, step=2, participants=1),
        ev(2.8, "step_end", attempt=1, step=3, loss=2.2, duration_s=0.4),
        ev(3.2, "step_end", attempt=1, step=4, loss=2.0, duration_s=0.4),
        ev(4.3, "run_start", rank=1, attempt=1),
        ev(4.5, "rejoined", attempt=1, step=4),
        ev(4.5, "replica_heal", rank=1, attempt=1, step=4, transfer_s=0.15, bytes=1000, heal_s=0.2),
        ev(4.5, "ckpt_loaded", rank=1, attempt=1, step=4, source="replica:0", bytes=1000, duration_s=0.2),
        ev(4.5, "resumed", rank=1, attempt=1, step=4),
        ev(5.0, "step_end", attempt=1, step=5, loss=1.8, duration_s=0.5),
        ev(5.0, "step_end", rank=1, attempt=1, step=5, loss=1.6, duration_s=0.5),
        ev(5.1, "run_end", attempt=1, step=5, final_state_sha256="abc"),
        ev(5.1, "run_end", rank=1, attempt=1, step=5, final_state_sha256="abc"),
        ev(6.0, "supervisor_end", rank=None, attempt=1, outcome="succeeded"),
    ]


def test_our_replica_has_the_measures_of_torchft_under_the_same_names():
    r = compute_result(continued_log(), {**RUN, "strategy": "replica", "steps": 5})
    assert r["status"] == "ok" and r["recovered"] and r["lost_steps"] == 0 and r["survivors_restarted"] is False
    assert r["while_replacing"] == "continue" and r["bit_exact"] == "not by design"
    assert r["reduced_width_steps"] == 2 and r["replicas_consistent"] is True
    assert [round(r[k], 6) for k in ("quorum_detection_s", "survivors_stall_s", "replacement_start_s", "heal_s",
                                     "heal_transfer_s")] == [0.3, 0.7, 2.0, 0.2, 0.15]
    assert r["heal_bytes"] == 1000 and abs(r["final_loss"] - 1.7) < 1e-9
    # The replacement ending in another state is what the check exists for.
    log = continued_log()
    log[-2] = {**log[-2], "final_state_sha256": "abd"}
    assert compute_result(log, {**RUN, "strategy": "replica", "steps": 5})["replicas_consistent"] is False


def test_our_replica_waiting_has_no_reduced_width_step_and_is_held_to_the_bit_exact_check():
    log = [e for e in continued_log() if e["kind"] != "reduced_group"]
    log = [{**e, "while_replacing": "wait"} if e["kind"] == "replica_mode" else e for e in log]
    r = compute_result(log, {**RUN, "strategy": "replica", "steps": 5})
    assert r["while_replacing"] == "wait" and r["reduced_width_steps"] == 0 and r["bit_exact"] is None
    assert r["quorum_detection_s"] is None and abs(r["survivors_stall_s"] - 0.7) < 1e-9


def test_a_node_loss_names_the_configured_rank_not_the_first_recorder():
    """Each rank of the lost node records the fault; rank 0 of node 0 may write first, fault.rank=1 was set."""
    log = recovered_log()
    i = next(i for i, e in enumerate(log) if e["kind"] == "fault_injected")
    node = {"fault": "node_loss", "target_rank": 1, "node_ranks": [0, 1]}
    log[i:i + 1] = [ev(2.6, "fault_injected", rank=0, step=3, **node), ev(2.6, "fault_injected", rank=1, step=3, **node)]
    assert compute_result(log, RUN)["fault_rank"] == 1


def test_a_peer_replaced_one_attempt_after_the_victim_counts_as_a_restarted_survivor():
    """torchft restarts a whole replica group: the victim's group mate fails its next collective and is replaced a
    generation after the victim, before the recovery is over."""
    def log(mate_replaced: bool) -> list[dict]:
        out = [ev(0.0, "launch", rank=None), ev(1.0, "run_start"), ev(1.0, "run_start", rank=1),
               ev(1.5, "step_end", step=1, duration_s=0.5), ev(2.0, "step_end", step=2, duration_s=0.5),
               ev(2.6, "fault_injected", rank=1, step=3),
               ev(2.7, "fault_detected", rank=None, detector="process_exit", blamed_rank=1),
               ev(2.8, "restart", rank=None, attempt=1, ranks=[1]),
               ev(4.0, "run_start", rank=1, attempt=1)]
        if mate_replaced:
            out += [ev(4.1, "restart", rank=None, attempt=2, ranks=[0]), ev(4.5, "run_start", rank=0, attempt=2)]
        return out + [ev(4.9, "step_end", rank=1, attempt=1, step=3, duration_s=0.5),
                      ev(4.9, "resumed", rank=1, attempt=1, step=3),
                      ev(5.5, "run_end", attempt=2 if mate_replaced else 0, step=4, final_state_sha256="abc"),
                      ev(5.5, "run_end", rank=1, attempt=1, step=4, final_state_sha256="abc"),
                      ev(6.0, "supervisor_end", rank=None, attempt=2, outcome="succeeded")]

    assert compute_result(log(mate_replaced=True), RUN)["survivors_restarted"] is True
    assert compute_result(log(mate_replaced=False), RUN)["survivors_restarted"] is False


def test_a_stall_that_waited_for_the_previous_persist_is_split_into_snapshot_and_back_pressure():
    log = [ev(0.0, "launch", rank=None), ev(1.0, "run_start"),
           ev(2.0, "ckpt_begin", step=2), ev(2.05, "ckpt_stall_end", step=2),
           ev(3.0, "ckpt_begin", step=4), ev(3.9, "ckpt_persist_waited", step=4, duration_s=0.9),
           ev(3.95, "ckpt_stall_end", step=4), ev(4.0, "ckpt_durable", step=2, bytes=10),
           ev(5.0, "ckpt_begin", step=6), ev(5.05, "ckpt_stall_end", step=6),
           ev(6.0, "step_end", step=6, duration_s=0.5), ev(6.1, "run_end", step=6, final_state_sha256="abc"),
           ev(6.2, "supervisor_end", rank=None, outcome="succeeded")]
    r = compute_result(log, {**RUN, "fault": "none", "steps": 6})
    assert abs(r["ckpt_stall_s"] - 0.05) < 1e-9  # the median, the long one an outlier
    assert abs(r["ckpt_snapshot_stall_s"] - 0.05) < 1e-9 and r["ckpt_persist_waits"] == 1
    assert abs(r["ckpt_persist_wait_s"] - 0.3) < 1e-9  # 0.9 s over three checkpoints
