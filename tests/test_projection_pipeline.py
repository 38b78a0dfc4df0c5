"""The pipeline techniques at scale (resilience/projection/pipeline_rules.py): Swift's one-stage replay, overhead."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import yaml

from resilience.projection import CostsAtScale, fit_strategies, goodput, recovery_survival, simulate
from resilience.projection.cli import load
from resilience.projection.pipeline_rules import RULES, pipeline_costs
from resilience.projection.sweeps import evaluate, strategy_summary
from test_projection import REPO, composed, mixed_kinds

STRATEGY_CONF = REPO / "conf" / "strategy"


def summary(runs: int, step_s: dict[str, float]) -> pd.DataFrame:
    """A pipeline matrix's summary: ``runs`` runs per strategy under pp on 2 stages, the same checkpoint costs for
    every strategy that saves, and each strategy's step time (a little spread, so that medians have intervals)."""
    rows = []
    for name, step in step_s.items():
        saves = name != "none"
        for i in range(runs):
            rows.append({"strategy": name, "ckpt_bytes": 14e6 if saves else np.nan, "ckpt_stall_s": 0.4 if saves
                         else np.nan, "recovery_breakdown_s.load": 0.6 if saves else np.nan, "world_size": 2,
                         "parallel.name": "pp", "parallel.mesh": "[2]", "parallel.shards_per_replica": 2,
                         "step_time_s": step * (1 + 0.001 * i), "state": "ok", "validity.verdict": "valid"})
    return pd.DataFrame(rows)


def projected(frame: pd.DataFrame, stages_at_scale: int | None):
    """The llama3_405b scenario with costs fitted from ``frame`` and the pipeline rules applied."""
    _, scn, _ = load(composed("scenario=llama3_405b"), REPO)
    return scn.with_strategies(pipeline_costs(fit_strategies(frame, scn.strategies), frame, stages_at_scale))


def test_swift_log_beats_sync_at_the_same_costs_because_one_stage_replays() -> None:
    frame = summary(3, {"none": 0.08, "sync": 0.08, "swift_log": 0.08, "swift_log_selective": 0.08})
    scn = projected(frame, stages_at_scale=None)  # S from the runs: 2 stages
    sync, swift, selective = (evaluate(scn, n) for n in ("sync", "swift_log", "swift_log_selective"))
    assert (sync.costs.stall_s, sync.costs.load_s) == (swift.costs.stall_s, swift.costs.load_s)  # the same costs
    assert swift.costs.lost_work_factor == 0.5 and selective.costs.lost_work_factor == 1.0  # 2 of 2 retrain
    assert swift.goodput > sync.goodput + 0.01
    assert swift.goodput == pytest.approx(goodput(swift.interval_s, swift.mtbf_s, swift.costs.stall_s,
                                                  swift.costs.lag_s, swift.recovery_s, swift.shares, 0.5))
    assert swift.interval_s > sync.interval_s  # losing less per failure, it checkpoints less often
    assert selective.goodput == pytest.approx(sync.goodput, rel=1e-3)  # its stall is measured the same
    at_16 = evaluate(projected(frame, stages_at_scale=16), "swift_log")
    assert at_16.costs.lost_work_factor == 1 / 16 and at_16.goodput > swift.goodput
    assert "1 of S = 16 stages retrain" in projected(frame, 16).strategies["swift_log"].note


def test_a_factor_of_one_reproduces_the_closed_form_exactly() -> None:
    model, kinds = mixed_kinds()
    costs = CostsAtScale("t", stall_s=53.0, lag_s=53.0, load_s=72.0, restart_s=180.0)
    mtbf, tau = model.job_mtbf_s(16384), 1050.0
    r, p = costs.recovery_s(kinds), np.asarray(model.kind_shares)
    lam, a = 1.0 / mtbf, recovery_survival(mtbf, r, p)
    before = lam * tau * a * np.exp(-lam * (tau + 53.0)) / -np.expm1(-lam * (tau + 53.0))  # the formula before f
    assert goodput(tau, mtbf, 53.0, 53.0, r, p, lost_work_factor=1.0) == before
    assert goodput(tau, mtbf, 53.0, 53.0, r, p, lost_work_factor=0.5) > before
    with pytest.raises(ValueError, match="lost_work_factor=0"):
        goodput(tau, mtbf, 53.0, 53.0, r, p, lost_work_factor=0.0)
    # sync is left as it was; the selective variant on 2 stages (f = 1) reads exactly as sync would with its costs
    frame = summary(3, {"none": 0.08, "sync": 0.08, "swift_log_selective": 0.08})
    _, scn, _ = load(composed("scenario=llama3_405b"), REPO)
    plain = scn.with_strategies(fit_strategies(frame, scn.strategies))
    ruled = projected(frame, stages_at_scale=None)
    columns = ["strategy", "stall_s", "optimal_interval_s", "goodput_closed_form", "daly_interval_s"]
    assert strategy_summary(plain)[columns].equals(strategy_summary(ruled)[columns])


def test_the_step_overhead_is_the_measured_step_time_ratio_where_it_is_clear_of_one() -> None:
    times = {"none": 0.100, "sync": 0.100, "swift_log": 0.110}
    clear = projected(summary(7, times), stages_at_scale=None)  # 7 runs a side: a 95% interval for the ratio
    swift = evaluate(clear, "swift_log")
    assert swift.costs.step_overhead == pytest.approx(0.10, abs=1e-3)
    c = swift.costs
    assert swift.goodput == pytest.approx((1 - c.step_overhead) * goodput(
        swift.interval_s, swift.mtbf_s, c.stall_s, c.lag_s, swift.recovery_s, swift.shares, 0.5))
    assert "step overhead 0.100" in clear.strategies["swift_log"].note
    few = projected(summary(3, times), stages_at_scale=None)  # 3 against 3: the runs' ranges at 50%, no call
    assert few.strategies["swift_log"].step_overhead == 0.0
    assert "not a 95% interval clear of 1" in few.strategies["swift_log"].note
    faster = projected(summary(7, {**times, "swift_log": 0.09}), stages_at_scale=None)
    assert faster.strategies["swift_log"].step_overhead == 0.0  # clamped at 0


def test_the_monte_carlo_follows_the_closed_form_when_one_stage_replays() -> None:
    model, kinds = mixed_kinds()
    mtbf = model.job_mtbf_s(16384)
    costs = CostsAtScale("t", stall_s=53.0, lag_s=53.0, load_s=72.0, restart_s=180.0, lost_work_factor=0.25)
    tau = 2000.0
    expected = goodput(tau, mtbf, 53.0, 53.0, costs.recovery_s(kinds), model.kind_shares, 0.25)
    sim = simulate(costs, model, kinds, gpus=16384, interval_s=tau, horizon_s=54 * 86400.0, trials=400, seed=5)
    assert abs(sim.mean - expected) < 4 * sim.ci95 + 2e-3
    # the replaying loop at f -> 1 lands where the stretches of f = 1 do, draw for draw
    whole = CostsAtScale("t", 53.0, 53.0, 72.0, 180.0)
    almost = CostsAtScale("t", 53.0, 53.0, 72.0, 180.0, lost_work_factor=1 - 1e-12)
    a, b = (simulate(c, model, kinds, gpus=16384, interval_s=tau, horizon_s=54 * 86400.0, trials=50, seed=9)
            for c in (whole, almost))
    assert np.allclose(a.goodput, b.goodput, atol=1e-6) and not math.isclose(sim.mean, a.mean, rel_tol=0.01)


def test_the_rules_table_holds_the_strategies_own_log_every() -> None:
    own = {name: yaml.safe_load((STRATEGY_CONF / f"{name}.yaml").read_text()) for name in RULES}
    base = own["swift_log"]["log_every"]
    assert RULES["swift_log"].group == base == 1
    assert RULES["swift_log_selective"].group == own["swift_log_selective"].get("log_every", base) == 2


def test_the_scenario_pipeline_degree_is_validated() -> None:
    _, scn, _ = load(composed("scenario=llama3_405b"), REPO)
    assert scn.pipeline_stages == 16
    with pytest.raises(ValueError, match=r"^scenario.pipeline_stages=0: must be an integer >= 1"):
        load(composed("scenario=llama3_405b", "scenario.pipeline_stages=0"), REPO)
    _, other, _ = load(composed("scenario=meta_rsc_1k"), REPO)
    assert other.pipeline_stages is None  # no degree given: the measured stages are used
