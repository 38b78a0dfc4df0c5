"""The failure trace (issue 31, item 6): fault=trace draws failures at seeded exponential arrivals with the Llama 3
table's crash-kind weights, the same plan on every rank and before the run; the bench's predictions use only costs
of runs that are not the trace run."""

from __future__ import annotations

import pytest

from conftest import refusal, run_experiment
from injectors.trace import MIXES, Trace, draw
from resilience.bench import trace as bench
from resilience.projection.run_model import RunCosts
from resilience.record.events import read_events


def test_the_trace_is_a_pure_function_of_its_seed_with_the_mixs_kinds():
    plan = draw("llama3", 40.0, 11, 1, 4000)
    assert plan == draw("llama3", 40.0, 11, 1, 4000) and plan != draw("llama3", 40.0, 12, 1, 4000)
    steps = sorted(plan)
    assert steps[0] >= 1 and steps[-1] < 4000 and 70 <= len(steps) <= 110  # ~4000 / 40 arrivals
    share = sum(k == "node_loss" for k in plan.values()) / len(plan)
    weights = MIXES["llama3"]
    assert abs(share - weights["node_loss"] / sum(weights.values())) < 0.12


def test_the_injector_splits_the_trace_into_a_kill_and_a_node_loss_with_listed_steps():
    fault = Trace(mtbf_steps=20.0, rank=1, at_step=1, seed=11)
    fault.validate(world_size=2, steps=200, ckpt_every=5)
    assert fault.plan == sorted(draw("llama3", 20.0, 11, 1, 200))
    listed = {p.name: p.at_steps for p in fault.parts}
    assert sorted(s for steps in listed.values() for s in steps) == fault.plan
    assert all(fault.kinds[s] == name for name, steps in listed.items() for s in steps)


@pytest.mark.parametrize(("overrides", "said"), [
    (("fault.mtbf_steps=0",), "fault.mtbf_steps=0"),
    (("fault.mix=nope",), "fault.mix=nope: must be one of llama3"),
])
def test_bad_trace_settings_are_refused_in_one_line(tmp_path, overrides, said):
    assert said in refusal(tmp_path, ("fault=trace", "steps=40", *overrides))


@pytest.mark.timeout(300)
def test_a_traced_run_meets_every_planned_failure_and_ends_on_the_fault_free_state(tmp_path):
    training = ("workload=gpt_tiny", "world_size=2", "steps=30", "checkpoint.every=5", "seed=0",
                "detector=[process_exit]", "recovery.max_restarts=10")
    fault_free = run_experiment(tmp_path / "fault-free", "strategy=none", "fault=none", *training)
    result = run_experiment(tmp_path / "run", "strategy=sync", "fault=trace", "fault.mtbf_steps=8",
                            "fault.seed=11", *training)
    plan = draw("llama3", 8.0, 11, 1, 30)
    fired = {e["step"]: e["fault"] for e in read_events(tmp_path / "run") if e["kind"] == "fault_injected"}
    assert fired == plan and len(plan) >= 2
    assert result["status"] == "ok" and result["final_state_sha256"] == fault_free["final_state_sha256"]


def both(lags: list[float]) -> dict[str, list[float]]:
    return {"kill": lags, "node_loss": lags}


def test_the_predictions_lose_the_steps_since_the_newest_durable_checkpoint():
    costs = RunCosts(steps=100, every=5, step_s=0.09, step_wall_s=0.1, stall_s=0.05, startup_s=5.0,
                     teardown_s=1.0, recovery_s=3.0)
    plan = {12: "node_loss", 21: "node_loss"}  # 2 and 1 steps after a checkpoint
    sync = bench.predict(costs, both([-0.005, 0.0]), plan)["schedule"]
    assert sync["lost_steps"] == 3  # durable before training went on
    lagging = bench.predict(costs, both([0.35]), plan)["schedule"]  # 3.5 steps of persisting after the stall
    assert lagging["lost_steps"] == 3 + 2 * 5  # both struck before their newest checkpoint was durable
    # lags of 2 and 3 steps after the stall: the one struck 1 step after its checkpoint loses that interval too
    # whichever lag it met, the one 2 steps after it in half of them
    mixed = bench.predict(costs, both([0.2, 0.3]), plan)["schedule"]
    assert mixed["lost_steps"] == pytest.approx(3 + 5 + 0.5 * 5)
    closed = bench.predict(costs, both([0.0]), plan)["closed form"]
    assert closed["lost_steps"] == pytest.approx(2 * 2.0) and 0 < closed["ettr"] < 0.9
    closed = bench.predict(costs, both([0.2]), plan)["closed form"]  # a 2-step lag: 2 steps more per failure
    assert closed["lost_steps"] == pytest.approx(2 * 4.0)


def test_each_failure_kind_races_its_own_lag():
    """In-memory: a killed rank's own snapshot (committed soon after the stall) outlives its process; a node loss
    needs the peer's copy, which lags longer. Each planned failure meets the lag of its kind."""
    costs = RunCosts(steps=100, every=5, step_s=0.09, step_wall_s=0.1, stall_s=0.05, startup_s=5.0,
                     teardown_s=1.0, recovery_s=3.0)
    lags = {"kill": [0.001], "node_loss": [0.35]}
    kill = bench.predict(costs, lags, {21: "kill"})
    node = bench.predict(costs, lags, {21: "node_loss"})
    assert kill["schedule"]["lost_steps"] == 1 and node["schedule"]["lost_steps"] == 1 + 5
    assert kill["closed form"]["lost_steps"] == pytest.approx(2.0 + 0.01)
    assert node["closed form"]["lost_steps"] == pytest.approx(2.0 + 3.5)
    half = bench.predict(costs, lags, {21: "kill", 31: "node_loss"})["closed form"]  # the mix weighs the lags
    assert half["lost_steps"] == pytest.approx(2 * (2.0 + (0.01 + 3.5) / 2))


def test_step_costs_are_fitted_on_the_fault_free_runs_and_r_on_the_recoveries():
    def fit_run(step_wall_s, faults, recoveries):
        return {"step_s": step_wall_s, "step_wall_s": step_wall_s, "stall_s": 0.1, "startup_s": 5.0,
                "teardown_s": 1.0, "faults": faults, "recoveries_s": recoveries}

    costs, lags = bench.fitted_costs([fit_run(0.06, 0, []), fit_run(0.09, 3, [2.0, 3.0, 4.0])],
                                     {"kill": [], "node_loss": [0.1]}, 100)
    assert costs.step_wall_s == 0.06 and costs.recovery_s == 3.0 and lags == {"kill": [0.0], "node_loss": [0.1]}
