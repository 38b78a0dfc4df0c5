"""Tests of the cluster-scale projection (resilience/projection, docs/projection.md)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from resilience.projection import (ComponentCost, CostsAtScale, FailureModel, FailureTable, RecoveryKind,
                                   StrategyCosts, daly_interval, fit_component, fit_strategies, goodput,
                                   optimal_interval, per_gpu_mttf_hours, predicted_goodput, read_measured,
                                   simulate, young_interval)
from resilience.projection.cli import load, run
from resilience.projection.sweeps import evaluate, interval_sweep, strategy_summary, winner_grid
from resilience.projection.validation import ConfigError
from resilience.projection.failure_model import RECOVERY_KINDS
from resilience.projection.settings import CONF_DIR

REPO = Path(__file__).resolve().parents[1]
TABLE = CONF_DIR / "scenario" / "data" / "llama3_405b_interruptions.csv"
HOUR = 3600.0


def composed(*overrides: str) -> dict:
    """The CLI's config as Hydra composes it, as a plain mapping."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="projection", overrides=list(overrides))
    return OmegaConf.to_container(cfg, resolve=True)


def mixed_kinds() -> tuple[FailureModel, tuple[RecoveryKind, ...]]:
    """The Llama 3 rate with an uneven mix of four recovery kinds of very different lengths."""
    model = FailureModel(per_gpu_mttf_hours(419, 16384, 54), (0.5, 0.3, 0.15, 0.05))
    kinds = (RecoveryKind("restart", 30, 0), RecoveryKind("node_replacement", 30, 600),
             RecoveryKind("hang", 600, 0), RecoveryKind("rollback", 3600, 0))
    return model, kinds


# --- failure model -------------------------------------------------------------------------------------------

def test_calibration_from_llama3_table() -> None:
    table = FailureTable.from_csv(TABLE, "table")
    assert table.total == 419  # arXiv:2407.21783 Table 5: 419 unexpected interruptions
    mttf = per_gpu_mttf_hours(table.total, 16384, 54)
    assert mttf == pytest.approx(50_700, rel=0.002)
    model = FailureModel(mttf, (1.0, 0.0, 0.0, 0.0))
    assert model.job_mtbf_s(16384) / HOUR == pytest.approx(3.09, abs=0.005)
    assert model.job_mtbf_s(1024) == pytest.approx(16 * model.job_mtbf_s(16384))


def test_scenario_maps_every_interruption_to_a_recovery_kind() -> None:
    _, scn, _ = load(composed("scenario=llama3_405b"), REPO)
    assert sum(scn.kind_counts.values()) == 419
    assert scn.kind_counts["rollback"] == 6 and scn.kind_counts["hang"] == 7  # SDC, NCCL watchdog rows
    assert sum(scn.failure.kind_shares) == pytest.approx(1.0)
    assert scn.mtbf_s / HOUR == pytest.approx(3.09, abs=0.005)


@pytest.mark.parametrize("shape", [0.7, 1.0, 2.0])
def test_interarrival_mean_is_mtbf(shape: float) -> None:
    model = FailureModel(1000.0, (1, 0, 0, 0), "weibull", shape)
    draws = model.draw_interarrivals(np.random.default_rng(1), 500.0, (200_000,))
    assert draws.mean() == pytest.approx(500.0, rel=0.01)


# --- cost model ----------------------------------------------------------------------------------------------

def test_fit_component_recovers_fixed_part_and_bandwidth() -> None:
    x = np.array([1e9, 2e9, 4e9, 8e9])
    fit = fit_component(x, 3.0 + x / 2e9, storage_bound=True)
    assert fit.fixed_s == pytest.approx(3.0) and fit.per_writer_Bps == pytest.approx(2e9)
    assert fit.residuals == pytest.approx((1.0,) * 4)
    flat = fit_component(x, [5.1, 5.0, 4.9, 5.0], storage_bound=False)  # shrinks with size: a constant
    assert flat.per_writer_Bps is None and flat.fixed_s == pytest.approx(5.0)
    single = fit_component([1e9, 1e9], [2.0, 2.0], storage_bound=True)  # one size: all bandwidth
    assert single.fixed_s == 0.0 and single.per_writer_Bps == pytest.approx(0.5e9)


def test_checkpoint_time_capped_by_storage_bandwidth() -> None:
    cost = ComponentCost(fixed_s=2.0, per_writer_Bps=1e9, storage_bound=True)
    assert cost.seconds(10e9, writers=10, storage_Bps=None) == pytest.approx(3.0)
    assert cost.seconds(10e9, writers=10, storage_Bps=2e9) == pytest.approx(7.0)  # cap binds
    assert cost.seconds(10e9, writers=1, storage_Bps=100e9) == pytest.approx(12.0)  # writers bind


def _defaults() -> dict[str, StrategyCosts]:
    const = ComponentCost(10.0)
    return {"sync": StrategyCosts("sync", const, const, ComponentCost(20.0, 1e9, True), ComponentCost(60.0))}


def test_fit_strategies_from_measured_runs() -> None:
    sizes = np.repeat([1e9, 2e9, 4e9], 2)
    frame = pd.DataFrame({
        "strategy": "async", "ckpt_bytes": sizes * 4, "ckpt_writers": 4,
        "ckpt_stall_s": 0.1 + sizes / 10e9, "ckpt_durable_s": 1.0 + sizes / 1e9,
        "recovery_breakdown_s.load": 2.0 + sizes / 2e9, "recovery_breakdown_s.restart": [9.0, 11.0] * 3,
        "detection_latency_s": [1.0, 3.0, np.nan, 2.0, 2.0, 2.0], "step_time_s": 0.5,
    })
    fitted = fit_strategies(frame, _defaults())
    assert set(fitted) == {"sync", "async"}  # defaults kept, measured strategy added
    a = fitted["async"]
    assert a.stall.fixed_s == pytest.approx(0.1) and a.stall.per_writer_Bps == pytest.approx(10e9)
    assert not a.stall.storage_bound and a.durable.storage_bound  # stall << durable: an asynchronous save
    assert a.load.per_writer_Bps == pytest.approx(2e9)
    # one cost basis at scale: the restart and the detection are the scenario's, never the local runs' (9-11 s, 1-3 s)
    assert a.restart == _defaults()["sync"].restart and a.detection_samples == ()
    at = a.at_scale(16e9, writers=4, storage_Bps=None)
    assert at.stall_s == pytest.approx(0.5) and at.lag_s == pytest.approx(5.0)


def test_fit_strategies_names_missing_columns() -> None:
    frame = pd.DataFrame({"strategy": ["x"], "ckpt_bytes": [1e9]})
    with pytest.raises(ValueError, match="'ckpt_stall_s'"):
        fit_strategies(frame, _defaults())
    frame["ckpt_stall_s"] = 1.0
    with pytest.raises(ValueError, match="'recovery_breakdown_s.load'"):
        fit_strategies(frame, _defaults())  # 'x' has no scenario default to fall back on
    frame["strategy"] = "sync"  # ... 'sync' has: its missing components keep the default
    fitted = fit_strategies(frame, _defaults())["sync"]
    assert fitted.load == _defaults()["sync"].load and fitted.stall.per_writer_Bps == pytest.approx(1e9)


def test_read_measured_results_and_skip_strategies_without_checkpoints(tmp_path: Path) -> None:
    rows = [{"strategy": "sync", "world_size": 2, "ckpt_bytes": b, "ckpt_stall_s": t, "ckpt_durable_s": t,
             "recovery_breakdown_s": {"restart": 6.0, "load": t / 2}} for b, t in [(4e8, 1.2), (8e8, 2.2)]]
    rows.append({"strategy": "none", "world_size": 2, "ckpt_bytes": None, "ckpt_stall_s": None,
                 "recovery_breakdown_s": {"restart": 6.0, "load": None}})
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    fitted = fit_strategies(read_measured(str(path)), _defaults())
    assert set(fitted) == {"sync"}  # 'none' never checkpointed: skipped
    assert fitted["sync"].stall.per_writer_Bps == pytest.approx(2e8 / 1.0)  # bytes per writer = ckpt_bytes / 2
    assert fitted["sync"].load.fixed_s == pytest.approx(0.1)


# --- intervals and closed form -------------------------------------------------------------------------------

def _brute_force_optimum(stall: float, mtbf: float, lag: float, recovery: float) -> float:
    taus = np.geomspace(1e-2 * math.sqrt(stall * mtbf), 3 * mtbf, 400_000)
    return float(taus[np.argmax(goodput(taus, mtbf, stall, lag, recovery))])


@pytest.mark.parametrize("stall", [6.0, 150.0])
def test_young_and_daly_near_brute_force_optimum(stall: float) -> None:
    mtbf = 50_700 * HOUR / 16384  # Llama 3 405B job MTBF (~3.09 h)
    best = _brute_force_optimum(stall, mtbf, stall, 600.0)
    young, daly = young_interval(stall, mtbf), daly_interval(stall, mtbf)
    assert young == pytest.approx(math.sqrt(2 * stall * mtbf))
    assert abs(daly - best) / best < 0.005  # higher order: within the grid resolution
    assert abs(young - best) / best < 0.07  # first order: off by O(sqrt(C/M))
    assert abs(daly - best) <= abs(young - best)
    assert optimal_interval(stall, mtbf) == pytest.approx(best, rel=1e-4)
    g_best = goodput(best, mtbf, stall, stall, 600.0)
    assert goodput(young, mtbf, stall, stall, 600.0) == pytest.approx(g_best, rel=2e-3)


def test_young_converges_when_checkpoint_is_cheap() -> None:
    best = _brute_force_optimum(1.0, 1e7, 1.0, 0.0)
    assert young_interval(1.0, 1e7) == pytest.approx(best, rel=1e-3)


def test_async_optimum_is_at_least_the_persist_time() -> None:
    mtbf = 3.09 * HOUR
    assert optimal_interval(0.5, mtbf, lag_s=0.5) == pytest.approx(optimal_interval(0.5, mtbf))
    assert optimal_interval(0.5, mtbf, lag_s=600.0) == pytest.approx(599.5)  # next save waits for the last
    assert _brute_force_optimum(0.5, mtbf, 600.0, 60.0) == pytest.approx(599.5, rel=1e-3)


def test_closed_form_is_dalys_model_for_synchronous_saves() -> None:
    tau, m, c, r = 1800.0, 3.09 * HOUR, 150.0, 600.0
    daly = tau / (m * math.exp(r / m) * (math.exp((tau + c) / m) - 1))
    assert goodput(tau, m, c, c, r) == pytest.approx(daly, rel=1e-12)
    assert predicted_goodput(tau, m, c, c, r) == pytest.approx(daly, rel=1e-12)
    assert goodput(tau, m, c, c, [r, r], shares=[0.3, 0.7]) == pytest.approx(daly, rel=1e-12)


# --- Monte Carlo ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("gpus, stall, lag, interval", [
    (16384, 150.0, 150.0, None),  # synchronous save at the Llama 3 scale
    (16384, 0.5, 60.0, None),  # asynchronous: durable 60 s after a 0.5 s stall
    (16384, 0.5, 300.0, 100.0),  # interval shorter than the persist: saves wait for each other
    (100_000, 20.0, 90.0, None),  # ~2,600 failures per 54-day job
])
def test_monte_carlo_matches_closed_form(gpus: int, stall: float, lag: float, interval: float | None) -> None:
    model, kinds = mixed_kinds()
    costs = CostsAtScale("t", stall_s=stall, lag_s=lag, load_s=60.0, restart_s=180.0)
    mtbf = model.job_mtbf_s(gpus)
    tau = optimal_interval(stall, mtbf, lag) if interval is None else interval
    expected = goodput(tau, mtbf, stall, lag, costs.recovery_s(kinds), model.kind_shares)
    sim = simulate(costs, model, kinds, gpus=gpus, interval_s=tau, horizon_s=54 * 86400.0, trials=1000, seed=7)
    assert abs(sim.mean - expected) / expected < 0.01
    assert abs(sim.mean - expected) < 4 * sim.ci95 + 5e-4  # and tighter: only the horizon's edge differs
    assert sim.failures.mean() == pytest.approx(54 * 86400.0 / mtbf, rel=0.02)


def test_monte_carlo_bootstrap_and_weibull_run() -> None:
    model, kinds = mixed_kinds()
    bursty = FailureModel(model.per_gpu_mttf_h, model.kind_shares, "weibull", 0.7)
    costs = CostsAtScale("t", 5.0, 50.0, 60.0, 180.0, residuals={"stall": (0.5, 1.5), "load": (0.8, 1.2)},
                         detection_samples=(10.0, 50.0))
    sim = simulate(costs, bursty, kinds, gpus=16384, interval_s=600.0, horizon_s=54 * 86400.0, trials=300,
                   seed=3, bootstrap=True)
    assert sim.goodput.shape == (300,) and np.all((sim.goodput > 0.5) & (sim.goodput < 1.0))


# --- configuration and CLI -----------------------------------------------------------------------------------

@pytest.mark.parametrize("scenario", ["llama3_405b", "meta_rsc_1k", "generic_100k"])
def test_every_scenario_composes_and_validates(scenario: str) -> None:
    settings, scn, _ = load(composed(f"scenario={scenario}"), REPO)
    assert scn.name == scenario and settings.trials >= 1
    assert set(scn.strategies) and [k.name for k in scn.kinds] == list(RECOVERY_KINDS)


@pytest.mark.parametrize("override, message", [
    ("scenario.gpus=0", "scenario.gpus=0: must be an integer >= 1"),
    ("scenario.gpus=-8", "scenario.gpus=-8: must be an integer >= 1"),
    ("scenario.gpus=1.5", "scenario.gpus=1.5: must be an integer >= 1"),
    ("scenario.storage.aggregate_GBps=-1", "scenario.storage.aggregate_GBps=-1"),
    ("scenario.strategies.sync.stall.per_writer_GBps=-2", "scenario.strategies.sync.stall.per_writer_GBps=-2"),
    ("scenario.failures.per_gpu_mttf_h=0", "scenario.failures.per_gpu_mttf_h=0: must be a finite number > 0"),
    ("scenario.failures.weibull_shape=0", "scenario.failures.weibull_shape=0: must be a finite number > 0"),
    ("scenario.failures.distribution=gamma", "scenario.failures.distribution=gamma: must be one of"),
    ("scenario.duration_days=-1", "scenario.duration_days=-1: must be a finite number > 0"),
    ("scenario.model.bytes_per_param=0", "scenario.model.bytes_per_param=0: must be a finite number > 0"),
    ("scenario.recovery_kinds.hang.detection_s=-1", "scenario.recovery_kinds.hang.detection_s=-1"),
    ("scenario.failures.table_csv=missing.csv", "scenario.failures.table_csv=missing.csv: file not found"),
    ("monte_carlo.trials=0", "monte_carlo.trials=0: must be an integer >= 1"),
    ("+scenario.strategies.sync.bytes_share=1.5", "scenario.strategies.sync.bytes_share=1.5"),
    ("scenario.strategies.shadow.step_overhead=1", "scenario.strategies.shadow.step_overhead=1.0: must be a number in"),
])
def test_bad_values_are_rejected_with_field_and_range(override: str, message: str) -> None:
    with pytest.raises(ValueError) as err:
        load(composed("scenario=llama3_405b", override), REPO)
    assert str(err.value).startswith(message)


def _cli(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "resilience.projection", f"hydra.run.dir={tmp_path / 'hydra'}",
                           *overrides], cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(120)
def test_cli_reports_bad_value_in_one_line(tmp_path: Path) -> None:
    proc = _cli(tmp_path, "scenario=llama3_405b", "scenario.gpus=0")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: scenario.gpus=0: must be an integer >= 1"
    assert not (tmp_path / "hydra").exists()  # checked before Hydra: nothing created
    assert "Traceback" not in proc.stderr + proc.stdout


@pytest.mark.timeout(180)
def test_cli_end_to_end_writes_outputs(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _cli(tmp_path, "scenario=llama3_405b", f"output_dir={out}", "monte_carlo.trials=200",
                "monte_carlo.cluster_trials=20", "sweep.interval_points=30")
    assert proc.returncode == 0, proc.stderr
    assert "job MTBF          3.09 h at 16,384 GPUs" in proc.stdout
    assert "Young" in proc.stdout and "Daly" in proc.stdout and "Monte Carlo:" in proc.stdout
    csvs = ["summary", "calibration", "failure_mix", "interval_sweep", "cluster_sweep", "winner_grid",
            "cluster_monte_carlo"]
    for name in csvs:
        frame = pd.read_csv(out / f"projection_{name}.csv")
        assert len(frame) and (frame["label"] == "projection").all()
    for name in ["goodput_vs_interval", "goodput_vs_cluster", "winner_heatmap", "failure_band"]:
        assert (out / f"projection_{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temp files left behind
    summary = pd.read_csv(out / "projection_summary.csv")
    closed, mc = summary["goodput_closed_form"], summary["goodput_monte_carlo"]
    assert ((closed - mc).abs() / closed < 0.01).all()
    # a gap beyond the simulation's 95% error is flagged for the reader, not hidden in the rounding
    assert (summary["gap_flagged"] == ((closed - mc).abs() > summary["goodput_monte_carlo_ci95"])).all()
    assert np.allclose(summary["closed_minus_monte_carlo"], closed - mc)


def test_run_with_measured_csv(tmp_path: Path) -> None:
    measured = tmp_path / "measured.csv"
    pd.DataFrame({"strategy": ["sync", "sync"], "ckpt_bytes": [1e9, 2e9], "ckpt_stall_s": [2.0, 3.0],
                  "recovery_breakdown_s.load": [1.0, 1.5]}).to_csv(measured, index=False)
    cfg = composed("scenario=llama3_405b", f"measured_csv={measured}", "monte_carlo.trials=50",
                   "monte_carlo.cluster_trials=0", "sweep.interval_points=20", "sweep.cluster_sizes=[1024,16384]",
                   "sweep.ckpt_sizes_TB=[1,10]")
    result = run(cfg, tmp_path / "out")
    assert f"fitted from {measured}" in result.summary
    assert all(p.exists() for p in result.files) and len(result.files) == 10


# --- a strategy without checkpoints (replica) ----------------------------------------------------------------

def test_replica_loses_no_work_so_its_goodput_is_the_recovery_survival() -> None:
    """No checkpoint, no lost step: goodput = A = sum_i p_i exp(-R_i/M) at any interval, in closed form and by MC."""
    _, scn, _ = load(composed("scenario=llama3_405b"), REPO)
    p = evaluate(scn, "replica")
    c = p.costs
    assert not c.checkpoints and c.stall_s == c.lag_s == 0.0 and math.isnan(p.interval_s)
    # recovery = detection + repair + replacement start + one transfer of a shard at the peer bandwidth
    assert c.load_s == pytest.approx(scn.ckpt_bytes / scn.storage.writers(scn.gpus) / 3e9)
    a = float(np.dot(p.shares, np.exp(-p.recovery_s / p.mtbf_s)))
    assert p.goodput == pytest.approx(a) and np.allclose(p.goodput_at(np.array([10.0, 1e4])), a)
    assert p.goodput > evaluate(scn, "sync").goodput  # nothing replayed, nothing written
    sim = simulate(c, scn.failure, scn.kinds, gpus=scn.gpus, interval_s=p.interval_s, horizon_s=scn.horizon_s,
                   trials=400, seed=1)
    assert abs(sim.mean - a) < 4 * sim.ci95 + 1e-3


def test_replica_rows_in_every_projection_table() -> None:
    _, scn, _ = load(composed("scenario=generic_100k"), REPO)
    summary = strategy_summary(scn)
    row = summary.set_index("strategy").loc["replica"]
    assert math.isnan(row["optimal_interval_s"]) and math.isnan(row["daly_interval_s"])
    assert row["goodput_closed_form"] > 0
    sweep = interval_sweep(scn, 10)
    flat = sweep[sweep["strategy"] == "replica"]
    assert len(flat) == 10 and flat["goodput"].nunique() == 1 and not flat["is_optimum"].any()
    assert "replica" in set(winner_grid(scn, (1024, 100_000), (1.0,))["strategy"])


def test_a_scenario_strategy_without_checkpoints_takes_no_save_costs() -> None:
    with pytest.raises(ConfigError, match=r"strategies.replica.stall=.*must be absent when checkpoint is false"):
        load(composed("scenario=llama3_405b", "+scenario.strategies.replica.stall={fixed_s: 1.0}"), REPO)


def test_noisy_and_failed_runs_are_never_fitted() -> None:
    sizes = np.repeat([1e9, 2e9, 4e9], 2)
    frame = pd.DataFrame({"strategy": "async", "ckpt_bytes": sizes, "ckpt_stall_s": 0.1 + sizes / 10e9,
                          "ckpt_durable_s": 1.0 + sizes / 1e9, "recovery_breakdown_s.load": 2.0 + sizes / 2e9,
                          "state": "ok", "validity.verdict": "valid"})
    spoiled = frame.copy()
    spoiled.loc[0, "ckpt_stall_s"], spoiled.loc[0, "validity.verdict"] = 100.0, "noisy"  # a busy host's stall
    spoiled.loc[1, "ckpt_stall_s"], spoiled.loc[1, "state"] = 100.0, "failed"
    fitted, clean = fit_strategies(spoiled, _defaults())["async"], fit_strategies(frame.drop([0, 1]), _defaults())
    assert fitted.stall == clean["async"].stall


def test_the_winner_map_is_checked_by_the_monte_carlo_in_every_cell() -> None:
    _, scn, _ = load(composed("scenario=llama3_405b"), REPO)
    grid = winner_grid(scn, (1024, 65_536), (0.3, 30.0), trials=60, seed=3)
    for _, cell in grid.groupby(["gpus", "ckpt_TB"]):
        assert cell["winner_monte_carlo"].sum() == 1 and cell["winner"].sum() == 1
        feasible = cell[cell["feasible"]]
        # the simulation of each strategy lands on its closed form's expectation
        gap = (feasible["goodput_monte_carlo"] - feasible["goodput"]).abs()
        assert (gap < 4 * feasible["goodput_monte_carlo_ci95"] + 0.01).all(), cell
    assert "winner_monte_carlo" not in winner_grid(scn, (1024,), (1.0,))  # trials=0: the closed form alone


def test_a_per_step_cost_scales_the_goodput_in_closed_form_and_by_monte_carlo() -> None:
    """shadow: no lost work, like replica, less its per-step cost (``step_overhead``); jit: no periodic cost."""
    _, scn, _ = load(composed("scenario=llama3_405b"), REPO)
    shadow, jit = evaluate(scn, "shadow"), evaluate(scn, "jit")
    assert shadow.costs.step_overhead == 0.015 and not shadow.costs.checkpoints and not jit.costs.checkpoints
    a = float(np.dot(shadow.shares, np.exp(-shadow.recovery_s / shadow.mtbf_s)))
    assert shadow.goodput == pytest.approx(0.985 * a)
    sim = simulate(shadow.costs, scn.failure, scn.kinds, gpus=scn.gpus, interval_s=1.0, horizon_s=scn.horizon_s,
                   trials=400, seed=1)
    assert abs(sim.mean - 0.985 * a) < 4 * sim.ci95 + 1e-3
    assert jit.costs.stall_s == 0.0 and jit.costs.load_s > evaluate(scn, "replica").costs.load_s  # the write


def test_an_incremental_save_writes_its_share_of_the_state_and_loads_the_whole() -> None:
    full = StrategyCosts("sync", ComponentCost(1.0, 1e9), ComponentCost(1.0, 1e9), ComponentCost(2.0, 1e9),
                         ComponentCost(180.0))
    chain = StrategyCosts("incremental", full.stall, full.durable, full.load, full.restart, bytes_share=0.25)
    a, b = full.at_scale(8e12, 8, None), chain.at_scale(8e12, 8, None)
    assert b.stall_s == pytest.approx(1.0 + 0.25 * 1000.0) and a.stall_s == pytest.approx(1001.0)
    assert b.load_s == a.load_s  # a restore replays the chain: the whole state
