"""Model validation (resilience/projection/parity.py): the prediction on synthetic inputs, one measured pair of runs."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from resilience.record.events import EVENTS_FILE
from resilience.record.metrics import compute_result
from resilience.projection.parity import (QUICK, RunCosts, RunSpec, binomial_quantile, checkpoints_in_run, evaluate,
                                          expected_faults, lost_steps_at, measure, predict_closed_form,
                                          predict_from_plan, predict_from_rate, predicted_run_goodput,
                                          predicted_wall_s, run_one, write_outputs)

COSTS = RunCosts(steps=80, every=5, step_s=0.08, step_wall_s=0.081, stall_s=0.1, startup_s=3.0, teardown_s=1.0,
                 recovery_s=3.5)


def test_fault_free_prediction_is_the_wall_time_decomposition():
    wall = 3.0 + 1.0 + 80 * 0.081 + 15 * 0.1  # 15 checkpoints: 5, 10, ..., 75 (the final state is not saved)
    assert checkpoints_in_run(80, 5) == 15 and checkpoints_in_run(81, 5) == 16
    assert predicted_wall_s(COSTS, 0, 0) == pytest.approx(wall)
    assert predicted_run_goodput(COSTS, 0, 0) == pytest.approx(80 * 0.08 / wall)
    assert predict_from_rate(COSTS, 0.0, 80).goodput == pytest.approx(80 * 0.08 / wall)
    # Each fault adds its recovery and the replay of its lost steps, nothing else.
    assert predicted_wall_s(COSTS, 2, 7) == pytest.approx(wall + 2 * 3.5 + 7 * 0.081)


def test_expected_faults_and_lost_steps_follow_the_plan_rules():
    assert expected_faults(0.05, 79, 79) == pytest.approx(0.05 * 79)
    assert expected_faults(0.05, 79, 1) == pytest.approx(1 - 0.95 ** 79)  # count caps the plan
    assert expected_faults(0.0, 79, 79) == 0.0
    assert binomial_quantile(10, 0.5, 0.5) == 5 and binomial_quantile(79, 0.0001, 0.9) == 0
    assert [lost_steps_at(s, 5) for s in (3, 5, 9, 10, 12)] == [3, 0, 4, 0, 2]
    rate = predict_from_rate(COSTS, 0.05, 79)
    assert rate.lost_per_fault == pytest.approx(sum(s % 5 for s in range(1, 80)) / 79)
    assert rate.low <= rate.goodput <= rate.high
    assert predict_from_plan(COSTS, [29, 40]) == pytest.approx(predicted_run_goodput(COSTS, 2, 4))
    # More faults, less goodput; a plan with the expected fault count predicts what the rate predicts.
    assert predict_from_rate(COSTS, 0.1, 79).goodput < rate.goodput < predict_from_rate(COSTS, 0.0, 79).goodput


def test_closed_form_agrees_to_first_order_and_departs_when_failures_could_hit_recoveries():
    long_run = RunCosts(steps=100_000, every=10, step_s=1.0, step_wall_s=1.0, stall_s=0.5, startup_s=0.0,
                        teardown_s=0.0, recovery_s=5.0)
    # p R / t_w = 0.005: failures during recovery are rare; the two models agree to second order.
    step_clock, closed = predict_from_rate(long_run, 0.001, 100_000).goodput, predict_closed_form(long_run, 0.001)
    assert closed == pytest.approx(step_clock, rel=0.01)
    # p R / t_w = 0.5: the closed form lets failures strike recoveries (e^{-p R / t_w}), the injector cannot.
    slow = RunCosts(**{**long_run.__dict__, "recovery_s": 50.0})
    assert predict_closed_form(slow, 0.01) < 0.9 * predict_from_rate(slow, 0.01, 100_000).goodput
    # Fault-free, both are the checkpoint overhead alone.
    assert predict_closed_form(long_run, 0.0) == pytest.approx(predict_from_rate(long_run, 0.0, 1).goodput, rel=1e-4)


def synthetic_run(run_dir, steps, every, plan, t_step, stall, startup, recovery, teardown):
    """A hand-made event log of a run with exactly these costs (no loop overhead), and its result.json."""
    log, t, step, attempt, saved = [], startup, 0, 0, 0

    def ev(kind, rank=0, **kw):
        log.append({"t_mono": t, "t_wall": t, "kind": kind, "rank": rank, "attempt": attempt, "step": step, **kw})

    t = 0.0
    ev("launch", rank=None)
    t = startup
    ev("run_start")
    pending = list(plan)
    while step < steps:
        if pending and step == pending[0]:  # the kill fires at the start of the loop iteration
            pending.pop(0)
            ev("fault_injected", rank=1, fault="kill")
            t += 0.01
            ev("fault_detected", rank=None, detector="process_exit", blamed_rank=1)
            attempt, step, t = attempt + 1, saved, t - 0.01 + recovery
            ev("run_start")
            if saved:
                ev("ckpt_loaded", source="disk", bytes=1)
            continue
        t += t_step
        step += 1
        ev("step_end", duration_s=t_step, loss=1.0)
        if step % every == 0 and step < steps:
            ev("ckpt_begin")
            t += stall
            ev("ckpt_durable", bytes=1)
            ev("ckpt_stall_end")
            saved = step
    ev("run_end", final_state_sha256="x")
    ev("run_end", rank=1, final_state_sha256="x")
    t += teardown
    ev("supervisor_end", rank=None, outcome="succeeded")
    run = {"strategy": "sync", "fault": "kill", "workload": "gpt_tiny", "seed": 0, "world_size": 2, "steps": steps,
           "checkpoint_every": every}
    run_dir.mkdir()
    (run_dir / EVENTS_FILE).write_text("".join(json.dumps(e) + "\n" for e in log))
    (run_dir / "result.json").write_text(json.dumps(compute_result(log, run)))


def test_measure_recovers_the_costs_and_the_plan_prediction_closes_the_wall_time(tmp_path):
    plan = [3, 10, 17, 24]  # before any checkpoint (restart from 0), on a checkpoint step (nothing lost), two others
    synthetic_run(tmp_path / "r", steps=30, every=5, plan=plan, t_step=0.1, stall=0.2, startup=3.0, recovery=4.0,
                  teardown=1.5)
    m = measure(tmp_path / "r")
    assert m["faults"] == 4 and m["lost_steps"] == [3, 0, 2, 4]
    for key, value in {"step_s": 0.1, "step_wall_s": 0.1, "stall_s": 0.2, "startup_s": 3.0, "teardown_s": 1.5}.items():
        assert m[key] == pytest.approx(value), key
    assert m["recoveries_s"] == pytest.approx([4.0] * 4)
    wall = 3.0 + 30 * 0.1 + 5 * 0.2 + 4 * 4.0 + 9 * 0.1 + 1.5
    assert m["wall_s"] == pytest.approx(wall) and m["measured_goodput"] == pytest.approx(3.0 / wall)
    frame = evaluate([RunSpec(5, 0.1, 0, 30)], [m])  # the spec's own plan differs: the check below is direct
    assert frame.iloc[0]["recovery_source"] == "own" and math.isfinite(frame.iloc[0]["predicted_goodput"])
    write_outputs(frame, tmp_path / "out")
    assert (tmp_path / "out" / "parity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    csv = pd.read_csv(tmp_path / "out" / "parity.csv")
    assert list(csv["label"]) == ["measured vs model"] and {"measured_goodput", "predicted_plan"} <= set(csv)
    costs = RunCosts(30, 5, m["step_s"], m["step_wall_s"], m["stall_s"], m["startup_s"], m["teardown_s"], 4.0)
    assert predict_from_plan(costs, plan) == pytest.approx(m["measured_goodput"], rel=1e-9)


# Measured: a fault-free run and one at p = 0.07 over 29 candidate steps (E[K] = 2.03). Seed 4's plan kills
# before steps 24 and 25 (K = 2; 3 + 4 lost steps), a typical count, so this checks the cost model and the
# rate -> fault count mapping rather than luck (an atypical seed is off by the fault count's spread, see
# docs/projection.md). Tolerances, absolute goodput, from what we observed on the loaded 2-core machine:
# from the seeded plan the model is the run's own wall-time decomposition, off by <= 0.002 in all 13 runs we
# made (this pair: 0.0004 fault-free, 0.00004 faulty); from the rate, E[K] = 2.03 instead of 2 adds ~0.001
# (observed 0.0015). 0.02 and 0.03 leave room for one step or checkpoint slowed 10x by other load, which the
# means do not see (about 0.01 here).
PLAN_TOL, RATE_TOL = 0.02, 0.03


@pytest.mark.timeout(300)
def test_prediction_matches_two_measured_runs(tmp_path):
    specs = [RunSpec(5, 0.0, 0, 30), RunSpec(5, 0.07, 4, 30)]
    assert specs[1].plan() == [23, 24]
    measured = []
    for spec in specs:
        run_one(spec, tmp_path / spec.name, timeout_s=140)
        measured.append(measure(tmp_path / spec.name))
    frame = evaluate(specs, measured)
    free, faulty = frame.iloc[0], frame.iloc[1]
    assert free["faults"] == 0 and faulty["faults"] == faulty["planned_faults"] == 2
    assert faulty["lost_steps"] == faulty["planned_lost_steps"] == 3 + 4
    assert faulty["recovery_source"] == "own"
    assert abs(free["predicted_goodput"] - free["measured_goodput"]) < PLAN_TOL
    assert abs(faulty["predicted_plan"] - faulty["measured_goodput"]) < PLAN_TOL
    assert abs(faulty["predicted_goodput"] - faulty["measured_goodput"]) < RATE_TOL
    # The faults cost something the model sees: the faulty run's goodput is clearly lower, measured and predicted.
    assert faulty["measured_goodput"] < free["measured_goodput"] - 0.03
    assert faulty["predicted_goodput"] < free["predicted_goodput"] - 0.03
    assert len(QUICK) in (3, 4)
