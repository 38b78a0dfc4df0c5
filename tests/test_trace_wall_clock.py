"""The failure trace on the wall clock (issue 31, item 6): failures arrive as a Poisson process over the run's wall
time from its first training step's start, recoveries included, and the supervisor strikes each on whatever
process the fault's rank has then: a training rank, a restarting one (the recovery starts over), or none yet (the
next one is killed as it starts). The projection's closed form is checked on what it models."""

from __future__ import annotations

import math
import subprocess
import sys
import time

import pytest

from conftest import of_kind, refusal, run_experiment
from injectors import wall_striker
from injectors.trace import MIXES, Trace, arrivals, draw_wall
from injectors.wall_striker import WallStriker
from resilience.bench import trace as bench
from resilience.bench.trace_wall import ARRIVALS, NOMINAL, Cycle, predict_wall
from resilience.projection.goodput import predicted_goodput
from resilience.projection.run_model import RunCosts
from resilience.record.board import STEP_START, Beater, create_board, reset_board
from resilience.record.events import EventLog, read_events
from resilience.record.query import recovery_window


def test_the_wall_clock_plan_is_a_pure_function_of_its_seed_with_the_mixs_kinds():
    plan = draw_wall("llama3", 4.0, 11, 2000.0)
    assert plan == draw_wall("llama3", 4.0, 11, 2000.0) and plan != draw_wall("llama3", 4.0, 12, 2000.0)
    times = [t for t, _ in plan]
    assert times == sorted(times) and 0 < times[0] and times[-1] < 2000.0 and 400 <= len(plan) <= 600
    share = sum(kind == "node_loss" for _, kind in plan) / len(plan)
    assert abs(share - MIXES["llama3"]["node_loss"] / sum(MIXES["llama3"].values())) < 0.06
    # not the step clock's stream: a wall-clock trace is a plan of its own
    first = next(arrivals("llama3", 4.0, 11))
    assert first == plan[0]


@pytest.mark.parametrize(("overrides", "said"), [
    (("fault.clock=hourly",), "fault.clock=hourly: must be one of steps, wall"),
    (("fault.clock=wall",), "fault.mtbf_s=null: fault.clock=wall needs the MTBF in seconds"),
    (("fault.clock=wall", "fault.mtbf_s=0"), "fault.mtbf_s=0: must be a number > 0"),
    (("fault.mtbf_s=5",), "fault.mtbf_s=5: only with fault.clock=wall"),
    (("fault.clock=wall", "fault.mtbf_s=5", "strategy=replica"), "fault.clock=wall: fault=trace is struck by our "
                                                                "supervisor's restart-all agent"),
    (("fault.clock=wall", "fault.mtbf_s=5", "supervisor.launcher=torchrun"), "supervisor.launcher=torchrun)"),
])
def test_bad_wall_clock_settings_are_refused_in_one_line(tmp_path, overrides, said):
    assert said in refusal(tmp_path, ("fault=trace", *overrides))


class Processes:
    """The agent's side for the striker: the process started for rank 1 in the current attempt (a sleeper here)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def spawn(self) -> subprocess.Popen:
        self.procs.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]))
        return self.procs[-1]

    def rank_process(self, rank: int) -> int | None:
        return self.procs[-1].pid if rank == 1 and self.procs else None

    def end(self) -> list[int | None]:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
        return [p.returncode for p in self.procs]


class Memory:
    def __init__(self) -> None:
        self.wiped: list[tuple[int, float]] = []

    def destroy(self, node: int) -> list[str]:
        self.wiped.append((node, time.monotonic()))
        return []


def test_the_supervisor_strikes_a_training_rank_a_restarting_one_and_the_next_one_to_start(tmp_path, monkeypatch):
    """Arrivals at 0.3 s (the rank trains: its step is recorded), 1.0 s (a new attempt's process has not trained
    yet: restarting) and 1.7 s (no process: recorded then, and the next process is killed as soon as it starts;
    a node loss wipes the node's memory)."""
    monkeypatch.setattr(wall_striker, "arrivals", lambda mix, mtbf_s, seed, how: iter(
        [(0.3, "kill"), (1.0, "kill"), (1.7, "node_loss"), (60.0, "kill")]))
    create_board(tmp_path, 2)
    supervisor, processes, memory = EventLog(tmp_path, rank=None, attempt=0), Processes(), Memory()
    fault = Trace(clock="wall", mtbf_s=1.0, rank=1, seed=11)
    striker = WallStriker(fault, tmp_path, supervisor, 2, memory, processes)
    first = processes.spawn()
    Beater(tmp_path, 1).beat(7, STEP_START)  # rank 1 trains step 8 (7 steps done)
    EventLog(tmp_path, rank=0, attempt=0).emit("step_end", step=1, loss=1.0, duration_s=0.0)  # the clock's start
    t0 = time.monotonic()
    striker.start()
    try:
        first.wait(timeout=5)
        supervisor.attempt = 1
        reset_board(tmp_path, 2)  # the restart: a new attempt whose rank has not beaten yet
        second = processes.spawn()
        second.wait(timeout=5)
        time.sleep(max(0.0, t0 + 2.2 - time.monotonic()))  # past the third arrival: no process of rank 1 yet
        supervisor.attempt = 2
        third = processes.spawn()
        third.wait(timeout=5)
        killed_after = time.monotonic()
    finally:
        striker.stop()
        codes = processes.end()
    assert codes == [-9, -9, -9]
    faults = of_kind(read_events(tmp_path), "fault_injected")
    assert [f["struck"] for f in faults] == ["training", "restarting", "none"]
    assert [f["step"] for f in faults] == [7, 7, 7]  # a recovery's failures: the step training had reached
    assert [f["attempt"] for f in faults] == [0, 1, 1] and [f["plan_index"] for f in faults] == [0, 1, 2]
    assert [f["planned_s"] for f in faults] == [0.3, 1.0, 1.7] and all(0 <= f["late_s"] < 0.2 for f in faults)
    assert faults[2]["pids"] == [] and faults[2]["node_ranks"] == [1]
    assert [n for n, _ in memory.wiped] == [1] and memory.wiped[0][1] < killed_after  # wiped when it struck


def test_a_failure_in_a_recovery_loses_no_step_and_the_loss_counts_from_the_attempt_that_trained():
    def event(kind, t, attempt, rank=0, step=0, **fields):
        return {"kind": kind, "t_mono": t, "attempt": attempt, "rank": rank, "step": step, **fields}

    events = [event("fault_injected", 1.0, 0, None, 12, struck="training"),
              event("restart", 1.2, 1, None), event("run_start", 1.5, 1),
              event("fault_injected", 2.0, 1, None, 12, struck="restarting"),
              event("restart", 2.2, 2, None), event("run_start", 2.5, 2), event("ckpt_loaded", 3.0, 2, step=10),
              event("step_end", 3.5, 2, step=11, duration_s=0.1)]
    first, during = (recovery_window(events, f) for f in of_kind(events, "fault_injected"))
    assert first.loaded["step"] == 10 and first.lost_steps == 2  # not 12: attempt 1 died before it loaded
    assert during.lost_steps == 0


COSTS = RunCosts(steps=1000, every=5, step_s=0.07, step_wall_s=0.075, stall_s=0.1, startup_s=5.0, teardown_s=1.0,
                 recovery_s=3.0)


def kill(lags: list[float], stalls: list[float] | None = None, steps: list[float] | None = None) -> Cycle:
    """COSTS' cycle with one failure kind (``kill``): its lags, its saves' own stalls (None: each C), step lengths."""
    return Cycle(COSTS, {"kill": lags}, {} if stalls is None else {"kill": stalls}, steps)


def test_the_wall_clock_prediction_is_the_projections_closed_form_at_the_given_mtbf():
    lags = {"kill": [0.0], "node_loss": [0.0]}
    got = predict_wall(Cycle(COSTS, lags), 4.0, 11)
    g = float(predicted_goodput(5 * 0.075, 4.0, 0.1, 0.1, 3.0))
    wall = 1000 * 0.075 / g
    assert got[NOMINAL]["wall_s"] == pytest.approx(wall) and got[NOMINAL]["ettr"] == pytest.approx(g * 0.07 / 0.075)
    # failures in a recovery (a share 1 - exp(-R/M)) lose no step: only the others lose theirs
    per = kill([0.0]).lost("kill")
    assert per == pytest.approx(5 * (0.075 * 2 + 0.1) / (5 * 0.075 + 0.1))  # the stall loses the whole interval
    assert got[NOMINAL]["lost_steps"] == pytest.approx(wall / 4.0 * math.exp(-3.0 / 4.0) * per)
    # the seeded arrivals' own count in the window it predicts: M = W / K gives back that W
    arrived = got[ARRIVALS]
    k = len(draw_wall("llama3", 4.0, 11, arrived["wall_s"] * 1.0001))
    assert arrived["failures"] == k
    g = float(predicted_goodput(5 * 0.075, arrived["wall_s"] / k, 0.1, 0.1, 3.0))
    assert 1000 * 0.075 / g == pytest.approx(arrived["wall_s"], rel=0.02)


def test_a_lag_that_outlasts_the_strike_loses_the_interval_too():
    assert kill([0.075]).lost("kill") - kill([0.0]).lost("kill") == pytest.approx(
        5 * 0.075 / (5 * 0.075 + 0.1))


def test_a_save_recoverable_inside_its_stall_exposes_only_the_stall_before_it():
    # in-memory: its snapshot committed while the stall goes on persisting it to disk (a lag below 0); half of the
    # saves so, 0.06 s before the stall's end: the interval is lost over 0.1 - 0.03 s of the stall on average
    cycle = 5 * 0.075 + 0.1
    assert kill([-0.06, 0.0]).lost("kill") == pytest.approx(5 * (0.075 * 2 + 0.07) / cycle)
    assert kill([-0.06, 0.0]).lost("kill") < kill([0.0]).lost("kill")
    # recoverable before the stall began (never negative exposure): the stall loses nothing
    assert kill([-0.5]).lost("kill") == pytest.approx(5 * 0.075 * 2 / cycle)


def test_each_saves_exposed_stall_is_paired_with_its_own_lag():
    # in-memory's shape: one save in five persists to disk (a 0.4 s stall, recoverable 0.01 s in), the others are
    # snapshots recoverable at their stall's end; the mean stall is C = 0.1 s either way
    stalls, lags = [0.4, 0.025, 0.025, 0.025, 0.025], [-0.39, 0.0, 0.0, 0.0, 0.0]
    cycle = 5 * 0.075 + 0.1
    paired = kill(lags, stalls).lost("kill")
    assert paired == pytest.approx(5 * (0.075 * 2 + (0.01 + 4 * 0.025) / 5) / cycle)
    # taken against the mean stall instead, the short saves' lags would hide none of the long save's stall
    unpaired = kill(lags).lost("kill")
    assert unpaired == pytest.approx(5 * (0.075 * 2 + 0.1 - 0.1 / 5) / cycle) and unpaired > paired
    # the events' stalls are scaled to the loop's C (they differ by a few ms): only their shares count
    assert kill(lags, [2 * one for one in stalls]).lost("kill") == pytest.approx(paired)
    mean, _ = Cycle(COSTS, {"kill": lags}, {"kill": stalls}).spread({"kill": 1.0})
    assert mean == pytest.approx(paired)


def test_steps_slowed_beside_a_persist_weigh_where_a_failure_lands():
    # async's shape: the first step after a stall twice as long as the others (a persist beside it); scaled to
    # every x t_w, only the shares count
    cycle = 5 * 0.075 + 0.1
    assert kill([0.0], steps=[1.0] * 5).lost("kill") == pytest.approx(kill([0.0]).lost("kill"))
    slow_first = kill([0.0], steps=[2.0, 1.0, 1.0, 1.0, 1.0]).lost("kill")
    lengths = [0.375 * 2 / 6] + [0.375 / 6] * 4
    assert slow_first == pytest.approx((sum(d * one for d, one in enumerate(lengths)) + 5 * 0.1) / cycle)
    assert slow_first < kill([0.0]).lost("kill")
    assert bench.lengths_after_stall(COSTS, {0: [0.0], 1: [0.2], 2: [0.3], 3: [0.4], 4: [0.5]}) == \
        pytest.approx([0.2, 0.1, 0.1, 0.1, 0.1])
    assert bench.lengths_after_stall(COSTS, {0: [0.0], 1: [0.2]}) is None  # a boundary never seen


def test_the_chance_spread_of_a_failures_loss_is_the_models_own():
    # no stall, no lag: d uniform over 0..4, mean 2 and variance (5^2 - 1) / 12 = 2
    plain = RunCosts(steps=1000, every=5, step_s=0.07, step_wall_s=0.1, stall_s=0.0, startup_s=5.0,
                     teardown_s=1.0, recovery_s=3.0)
    assert Cycle(plain, {"kill": [0.0]}).spread({"kill": 1.0}) == pytest.approx((2.0, math.sqrt(2.0)))
    # a stall of a step's length: the interval (5) a sixth of the time, d = 0..4 the rest
    stalled = RunCosts(**{**plain.__dict__, "stall_s": 0.1})
    mean, sd = Cycle(stalled, {"kill": [0.0]}).spread({"kill": 1.0})
    assert mean == pytest.approx(15 / 6) and sd == pytest.approx(math.sqrt(55 / 6 - (15 / 6) ** 2))
    # two kinds: a mixture (the mean's weighed, the spread holds the kinds' difference too)
    mixed = Cycle(stalled, {"kill": [0.0], "node_loss": [0.1]}).spread({"kill": 0.5, "node_loss": 0.5})
    node = Cycle(stalled, {"node_loss": [0.1]}).spread({"node_loss": 1.0})
    assert mixed[0] == pytest.approx((mean + node[0]) / 2)
    assert mixed[1] ** 2 == pytest.approx((sd ** 2 + node[1] ** 2) / 2 + ((mean - node[0]) / 2) ** 2)


def test_several_traces_pool_as_one_longer_trace():
    one = {"wall_s": 100.0, "ettr": 0.3, "lost_steps": 50.0, "faults": 30, "in_recoveries": 15, "R_trace": 5.0,
           "matches": True}
    two = {**one, "wall_s": 120.0, "ettr": 0.5, "lost_steps": 70.0, "faults": 40, "in_recoveries": 20, "R_trace": 6.0}
    assert bench.pooled([one, two]) == {"wall_s": 220.0, "ettr": 0.4, "lost_steps": 120.0, "faults": 70,
                                        "in_recoveries": 35, "R_trace": 5.5, "matches": True}
    assert bench.pooled([one, {**two, "matches": False}])["matches"] is False
    assert bench.pooled([one, {**two, "matches": None}])["matches"] is None  # unchecked: not called bit-exact
    lags = {"kill": [0.0], "node_loss": [0.0]}
    each = [predict_wall(Cycle(COSTS, lags), 4.0, seed) for seed in (11, 12)]
    both = bench.pooled_predictions(each)
    assert both[NOMINAL]["wall_s"] == pytest.approx(2 * each[0][NOMINAL]["wall_s"])
    assert both[ARRIVALS]["failures"] == each[0][ARRIVALS]["failures"] + each[1][ARRIVALS]["failures"]
    assert both[ARRIVALS]["ettr"] == pytest.approx((each[0][ARRIVALS]["ettr"] + each[1][ARRIVALS]["ettr"]) / 2)


def test_each_trace_seed_is_fitted_just_before_its_own_trace_and_predicted_from_that_fit(tmp_path, monkeypatch):
    calls = []

    def fit(strategy, out, index, overrides, reuse, strike, tag=""):
        calls.append(("fit", tag))
        r = 3.0 if not tag else 4.0  # the host's cold start drifts between the two seeds' minutes
        run = {"step_s": 0.07, "step_wall_s": 0.075, "stall_s": 0.1, "startup_s": 5.0, "teardown_s": 1.0}
        runs = {"fault_free": {**run, "faults": 0, "recoveries_s": []},
                **{kind: {**run, "faults": 1, "recoveries_s": [r]} for kind in ("kill", "node_loss")}}
        return runs, {"kill": [0.0], "node_loss": [0.01]}, {"kill": [0.1], "node_loss": [0.1]}, {}, [0.01]

    def trace_run(strategy, trace_dir, steps, seed, settings, arrivals, reuse):
        calls.append(("trace", trace_dir.name, next(s for s in settings if s.startswith("fault.mtbf_s="))))
        return {"wall_s": 100.0, "ettr": 0.5, "lost_steps": 10.0, "faults": 20, "in_recoveries": 8,
                "R_trace": 3.0, "matches": True}

    monkeypatch.setattr(bench, "fit", fit)
    monkeypatch.setattr(bench, "trace_run", trace_run)
    rows = bench.technique("sync", tmp_path, 1000, 4.0, [11, 12], [], clock="wall", mtbf_r=1.5)
    assert calls == [("fit", ""), ("trace", "trace", "fault.mtbf_s=4.5"),
                     ("fit", "-seed12"), ("trace", "trace-seed12", "fault.mtbf_s=6.0")]
    wall = next(r for r in rows if r["prediction"] == NOMINAL and r["measure"] == "wall_s")
    assert wall["R"] == pytest.approx(3.5) and wall["M"] == pytest.approx(5.25) and wall["measured"] == 200.0
    costs = [bench.fitted_costs(fit("sync", tmp_path, "", [], False, "", tag)[0], {"kill": [0.0], "node_loss": [0.01]},
                                1000, {"kill": 0.5, "node_loss": 0.5})[0] for tag in ("", "-seed12")]
    assert [c.recovery_s for c in costs] == [3.0, 4.0]
    each = [predict_wall(Cycle(c, {"kill": [0.0], "node_loss": [0.01]}, {"kill": [0.1], "node_loss": [0.1]}), m, seed,
                         how="stratified")[NOMINAL]["wall_s"]
            for c, m, seed in zip(costs, (4.5, 6.0), (11, 12))]
    assert wall["predicted"] == pytest.approx(sum(each))  # each seed from its own fit, summed as the runs are


def test_the_save_cycle_is_fitted_on_the_steady_run_and_the_strike_phase_on_the_struck_ones(tmp_path, monkeypatch):
    # a restart-heavy fit run's saves are mostly an attempt's first, slower to be recoverable: not the trace's cycle
    slow = {"fault_free": 0.01, "kill": 0.05, "node_loss": 0.07}
    monkeypatch.setattr(bench, "run_or_reuse", lambda run_dir, overrides, reuse, timeout_s: ({"status": "ok"}, 0))
    monkeypatch.setattr(bench, "measure", lambda run_dir: {"run": run_dir.name})
    monkeypatch.setattr(bench, "lags_after_stall", lambda run_dir, fault: [(0.02, slow[run_dir.name])])
    monkeypatch.setattr(bench, "strike_times",
                        lambda run_dir: {d: [d * slow[run_dir.name]] for d in range(bench.EVERY)})
    monkeypatch.setattr(bench, "fault_offsets",
                        lambda run_dir: [] if run_dir.name == "fault_free" else [slow[run_dir.name]])
    fitted, lags, stalls, strikes, offsets = bench.fit("inmemory", tmp_path, "", [], False)
    assert set(fitted) == {"fault_free", "kill", "node_loss"}
    assert lags == {"kill": [0.01], "node_loss": [0.01]} and stalls == {"kill": [0.02], "node_loss": [0.02]}
    assert strikes == {d: [d * 0.01] for d in range(bench.EVERY)}
    assert sorted(offsets) == [0.05, 0.07]


@pytest.mark.parametrize("options", [["--seeds", "11,11"], ["--seeds", "11,x"],
                                     ["--clock", "steps", "--seeds", "11,12"]])
def test_bad_trace_seeds_are_refused_in_one_line(tmp_path, capsys, options):
    assert bench.main([*options, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --seeds=")


def test_the_bench_takes_the_clock_and_its_mtbf_as_its_own_options(tmp_path, capsys):
    for override, option in (("fault.clock=steps", "--clock"), ("fault.mtbf_s=3", "--mtbf-s")):
        assert bench.main(["--out", str(tmp_path), override]) == 2
        assert f"set it with {option}" in capsys.readouterr().err
    assert bench.main(["--out", str(tmp_path), "--mtbf-s", "0"]) == 2
    assert "--mtbf-s=0.0 above 0" in capsys.readouterr().err


# A seed whose first arrival strikes training early (0.3-1.2 s after the first step's start), whose second falls
# ~1.8 s later, inside that recovery (~3 s on 2 cores), and whose third comes after the run has ended.
IN_A_RECOVERY = ("fault.mtbf_s=10", "fault.seed=4541")  # 0.58 s, 1.79 s later, then 38.7 s later


@pytest.mark.timeout(240)
def test_a_failure_in_a_recovery_strikes_the_restarting_rank_and_the_run_ends_bit_exact(tmp_path, reference):
    # a cold restart (~3 s), as in production, which the second arrival falls in: one forked from the preloaded
    # interpreter (the suite's RB_RESTARTS) would be over before it
    result = run_experiment(tmp_path / "run", "strategy=sync", "fault=trace", "fault.clock=wall", *IN_A_RECOVERY,
                            "detector=[process_exit]", "recovery.max_restarts=10", "supervisor.restarts=cold")
    faults = of_kind(read_events(tmp_path / "run"), "fault_injected")
    # restarting: the new attempt's rank was starting; on a host slow to stop the old attempt it may not have been
    # started yet (none), and is then killed as it starts: either way the recovery starts over
    assert faults[0]["struck"] == "training" and faults[1]["struck"] in ("restarting", "none")
    assert result["status"] == "ok" and result["final_state_sha256"] == reference["final_state_sha256"]
    assert result["attempts"] == 3  # the run, its recovery, and that recovery started over
