"""The failure trace (issue 31, item 6): fault=trace draws failures at seeded exponential arrivals with the Llama 3
table's crash-kind weights, the same plan on every rank and before the run; the bench's predictions use only costs
of runs that are not the trace run."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from conftest import refusal, run_experiment
from injectors.trace import MIXES, Trace, draw, strike_fraction
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


@pytest.mark.parametrize("kind", ["kill", "node_loss"])
def test_a_one_kind_mix_plans_that_kind_alone(kind):
    """The trace bench's fit runs: each recovery of one kind, struck as the trace strikes."""
    fault = Trace(mtbf_steps=6.0, rank=1, at_step=1, seed=13, mix=kind)
    fault.validate(world_size=2, steps=80, ckpt_every=5)
    assert 8 <= len(fault.plan) <= 16 and set(fault.kinds.values()) == {kind}
    assert [(p.name, p.at_steps) for p in fault.parts] == [(kind, fault.plan)]


def test_the_injector_splits_the_trace_into_a_kill_and_a_node_loss_with_listed_steps():
    fault = Trace(mtbf_steps=20.0, rank=1, at_step=1, seed=11)
    fault.validate(world_size=2, steps=200, ckpt_every=5)
    assert fault.plan == sorted(draw("llama3", 20.0, 11, 1, 200))
    listed = {p.name: p.at_steps for p in fault.parts}
    assert sorted(s for steps in listed.values() for s in steps) == fault.plan
    assert all(fault.kinds[s] == name for name, steps in listed.items() for s in steps)


class Struck:
    """A trace part's stand-in: what the striker's child records and does, written to a file (the child is another
    process), and the test's own process is never signalled."""

    def __init__(self, log: Path) -> None:
        self.log, self.fired = log, set()

    def due(self, phase, step):
        return 0 if (phase, step) == ("before_forward", 7) and not self.fired else None

    def _plan_detail(self, step):
        return {"pid": os.getpid()}

    def record(self, step, index, detail, fsync=True):
        with open(self.log, "a") as f:
            f.write(f"{time.monotonic()} {step} {index} {detail['pid']} {fsync}\n")

    def act_on(self, pid):
        with open(self.log, "a") as f:
            f.write(f"acted on {pid}\n")

    def sync_records(self):
        with open(self.log, "a") as f:
            f.write("synced\n")

    def fire(self, step, index):  # fault.strike=boundary: in the rank, at once
        self.fired.add(index)
        self.record(step, index, self._plan_detail(step))

    def cleanup(self):
        pass

    def lines(self, wait_s: float = 0.0) -> list[str]:
        deadline = time.monotonic() + wait_s
        while True:
            text = self.log.read_text() if self.log.exists() else ""
            if text.count("\n") >= 3 or time.monotonic() >= deadline:
                return text.splitlines()
            time.sleep(0.01)


def a_trace_with(part: Struck, strike: str) -> Trace:
    fault = Trace(mtbf_steps=20.0, rank=1, at_step=1, seed=11, strike=strike)
    fault.parts = [part]
    return fault


def test_a_failure_strikes_its_seeded_fraction_of_a_step_into_its_step_from_a_child(tmp_path):
    assert strike_fraction(11, 7) == strike_fraction(11, 7) != strike_fraction(11, 8)
    assert all(0 <= strike_fraction(11, s) < 1 for s in range(200))
    part = Struck(tmp_path / "log")
    fault = a_trace_with(part, "anywhere")
    assert fault.delay_s(7) == 0.0  # no step's time known yet: at the step's start
    fault.starts.extend([10.0, 10.1, 10.2, 10.5])  # gaps 0.1, 0.1 and a checkpoint's 0.3: the median is a step
    assert fault.delay_s(7) == pytest.approx(strike_fraction(11, 7) * 0.1)
    fault.starts.clear()
    started = time.monotonic()
    fault.starts.extend([started - 0.4, started - 0.2])  # steps of 0.2 s: it strikes that fraction of 0.2 s later
    try:
        fault("before_forward", 7)
        assert part.fired == {0}  # marked fired when the strike was set: the step is not met again in this attempt
        # the rank's main thread holds the interpreter lock for a long while (a sort in C): a timer thread in the
        # rank would wait for it; the child strikes on time
        sorted(list(range(3_000_000, 0, -1)) * 2)
        held = time.monotonic() - started
        (struck, acted, synced) = part.lines(wait_s=5)
    finally:
        fault.cleanup()
    at, step, index, pid, fsync = struck.split()
    # recorded without an fsync, which would wait on a disk a checkpoint keeps busy; synced after the action
    assert (int(step), int(index), int(pid), fsync) == (7, 0, os.getpid(), "False")
    assert (acted, synced) == (f"acted on {os.getpid()}", "synced")
    assert float(at) - started < min(held, 0.2 + 0.15), (float(at) - started, held)  # struck while the lock was held
    assert fault.striker.children == []


def test_a_pending_failure_is_stopped_when_the_rank_leaves_and_boundary_strikes_at_once(tmp_path):
    part = Struck(tmp_path / "log")
    fault = a_trace_with(part, "anywhere")
    now = time.monotonic()
    fault.starts.extend([now - 20.0, now - 10.0])  # 10 s steps: the failure is still pending when the rank leaves
    try:
        fault("before_forward", 7)
        (child,) = fault.striker.children
    finally:
        fault.cleanup()
    assert part.lines(wait_s=0.3) == [] and not Path(f"/proc/{child}").exists()  # stopped and reaped
    boundary = Struck(tmp_path / "boundary")
    a_trace_with(boundary, "boundary")("before_forward", 7)
    assert boundary.lines()[0].split()[1:] == ["7", "0", str(os.getpid()), "True"]  # at the boundary: fsynced first


@pytest.mark.parametrize(("overrides", "said"), [
    (("fault.mtbf_steps=0",), "fault.mtbf_steps=0"),
    (("fault.mix=nope",), "fault.mix=nope: must be one of llama3"),
    (("fault.strike=later",), "fault.strike=later: must be one of anywhere, boundary"),
])
def test_bad_trace_settings_are_refused_in_one_line(tmp_path, overrides, said):
    assert said in refusal(tmp_path, ("fault=trace", "steps=40", *overrides))


def test_the_bench_takes_where_failures_strike_as_its_own_option_not_as_an_override(tmp_path, capsys):
    # the prediction needs to know it: an override would reach the runs and leave the prediction at its default
    assert bench.main(["--out", str(tmp_path), "fault.strike=boundary"]) == 2
    assert "fault.strike: set it with --strike" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:
        bench.main(["--out", str(tmp_path), "--strike", "later"])
    assert refused.value.code == 2


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


WALL, STEPS = "closed form, failures in wall time", "closed form, failures in steps"


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
    closed = bench.predict(costs, both([0.0]), plan)[WALL]
    assert closed["lost_steps"] == pytest.approx(2 * 2.0) and 0 < closed["ettr"] < 0.9
    closed = bench.predict(costs, both([0.2]), plan)[WALL]  # a 2-step lag: 2 steps more per failure
    assert closed["lost_steps"] == pytest.approx(2 * 4.0)


def test_a_failure_races_the_lag_from_where_in_its_step_it_strikes():
    """With fault.strike=anywhere a failure strikes part of a step after its step's start: the lag it races has
    run that much longer, and that part of the step is lost with it."""
    costs = RunCosts(steps=100, every=5, step_s=0.09, step_wall_s=0.1, stall_s=0.05, startup_s=5.0,
                     teardown_s=1.0, recovery_s=3.0)
    lags, plan = both([0.12]), {21: "node_loss"}  # 1 step after its checkpoint: its step starts 0.1 s after the stall
    early = bench.predict(costs, lags, plan, into={21: 0.01})["schedule"]
    late = bench.predict(costs, lags, plan, into={21: 0.05})["schedule"]
    assert early["lost_steps"] == 1 + 5 and late["lost_steps"] == 1
    at_start = bench.predict(costs, both([0.0]), plan)["schedule"]
    assert bench.predict(costs, both([0.0]), plan, into={21: 0.05})["schedule"]["wall_s"] == pytest.approx(
        at_start["wall_s"] + 0.05)


def test_the_closed_form_for_failures_in_steps_is_the_step_clock_expected_over_where_a_failure_lands():
    """Failures only in training steps, as the trace's: each costs R, half a step, (every - 1) / 2 steps and the
    checkpoint's interval with the chance that its lag outlasts the strike, over the d steps after it and the point
    within the step."""
    costs = RunCosts(steps=100, every=5, step_s=0.09, step_wall_s=0.1, stall_s=0.05, startup_s=5.0,
                     teardown_s=1.0, recovery_s=3.0)
    plan = {12: "node_loss", 21: "node_loss"}
    none = bench.predict(costs, both([0.0]), plan)[STEPS]
    assert none["lost_steps"] == pytest.approx(2 * 2.0)
    assert none["wall_s"] == pytest.approx(100 * 0.1 + 19 * 0.05 + 2 * (3.0 + 0.05) + 4.0 * 0.1)
    # a lag of 1.5 steps: every failure in the step right after the checkpoint loses it, half of those in the next
    lagging = bench.predict(costs, both([0.15]), plan)[STEPS]
    assert lagging["lost_steps"] == pytest.approx(2 * (2.0 + 5 * (1 + 0.5) / 5))
    assert lagging["ettr"] == pytest.approx(100 * 0.09 / lagging["wall_s"])


def test_each_failure_kind_races_its_own_lag():
    """In-memory: a killed rank's own snapshot (committed soon after the stall) outlives its process; a node loss
    needs the peer's copy, which lags longer. Each planned failure meets the lag of its kind."""
    costs = RunCosts(steps=100, every=5, step_s=0.09, step_wall_s=0.1, stall_s=0.05, startup_s=5.0,
                     teardown_s=1.0, recovery_s=3.0)
    lags = {"kill": [0.001], "node_loss": [0.35]}
    kill = bench.predict(costs, lags, {21: "kill"})
    node = bench.predict(costs, lags, {21: "node_loss"})
    assert kill["schedule"]["lost_steps"] == 1 and node["schedule"]["lost_steps"] == 1 + 5
    assert kill[WALL]["lost_steps"] == pytest.approx(2.0 + 0.01)
    assert node[WALL]["lost_steps"] == pytest.approx(2.0 + 3.5)
    half = bench.predict(costs, lags, {21: "kill", 31: "node_loss"})[WALL]  # the mix weighs the lags
    assert half["lost_steps"] == pytest.approx(2 * (2.0 + (0.01 + 3.5) / 2))


def test_step_costs_are_fitted_on_the_fault_free_run_and_r_per_failure_kind_weighed_by_the_trace():
    def fit_run(step_wall_s, faults, recoveries):
        return {"step_s": step_wall_s, "step_wall_s": step_wall_s, "stall_s": 0.1, "startup_s": 5.0,
                "teardown_s": 1.0, "faults": faults, "recoveries_s": recoveries}

    runs = {"fault_free": fit_run(0.06, 0, []), "kill": fit_run(0.09, 3, [2.0, 3.0, 4.0]),
            "node_loss": fit_run(0.09, 2, [5.0, 7.0])}
    costs, lags = bench.fitted_costs(runs, {"kill": [], "node_loss": [0.1]}, 100, {"kill": 0.25, "node_loss": 0.75})
    assert costs.step_wall_s == 0.06 and lags == {"kill": [0.0], "node_loss": [0.1]}
    assert costs.recovery_s == pytest.approx(0.25 * 3.0 + 0.75 * 6.0)
    with pytest.raises(RuntimeError, match="node_loss fit run holds no recovery"):
        bench.fitted_costs({**runs, "node_loss": fit_run(0.09, 0, [])}, {"kill": [], "node_loss": []}, 100,
                           {"kill": 0.25, "node_loss": 0.75})
