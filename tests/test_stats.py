"""reports.stats: exact order-statistic intervals for the median, the ratio's interval, the difference rule."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from reports import stats

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("n,ranks,cover", [
    # by hand: P(B <= k-1) for B ~ Binomial(n, 1/2); the largest k with 1 - 2 P(B <= k-1) >= 0.95
    (6, (1, 6), 1 - 2 / 64),                        # k=1: 1 - 2/64 = 0.969; k=2: 1 - 2*7/64 = 0.781
    (10, (2, 9), 1 - 2 * 11 / 1024),                # k=2: 0.979; k=3: 1 - 2*56/1024 = 0.891
    (20, (6, 15), 1 - 2 * 21700 / 2 ** 20),         # 1+20+190+1140+4845+15504 = 21700: 0.959; k=7: 0.885
])
def test_exact_ranks_for_small_n_match_a_hand_computation(n, ranks, cover):
    assert stats.median_ranks(n) == ranks
    assert stats.coverage(n, ranks) == pytest.approx(cover)


def test_below_six_runs_there_is_no_95_percent_interval_only_the_range():
    assert [stats.median_ranks(n) for n in range(1, 6)] == [None] * 5  # n=5: 1 - 2/32 = 0.9375 < 0.95
    assert (stats.MIN_N, stats.MIN_N_RATIO) == (6, 7)  # 97.5% per side for the ratio: n=6 gives 0.969
    est = stats.median_interval([3.0, 1.0, float("nan"), 2.0])
    assert (est.median, est.n, est.low, est.high, est.exact) == (2.0, 3, 1.0, 3.0, False)
    assert est.text() == "n=3, range 1-3 (n too small for an interval)"
    assert stats.median_interval([]).text() == "n=0"
    assert stats.median_interval([4.0]).text() == "n=1 (n too small for an interval)"
    est = stats.median_interval(range(10, 0, -1))  # 1..10: ranks 2 and 9
    assert (est.median, est.low, est.high, est.exact) == (5.5, 2.0, 9.0, True)
    assert est.text() == "n=10, 95% CI 2-9"
    with pytest.raises(ValueError, match="level=1.5"):
        stats.median_ranks(10, 1.5)


@pytest.mark.parametrize("draw,true_median", [
    (lambda rng, n: rng.exponential(1.0, n), math.log(2)),
    (lambda rng, n: rng.lognormal(0.0, 1.0, n), 1.0),
    (lambda rng, n: 3.0 + rng.standard_normal(n), 3.0),
])
def test_interval_for_n20_covers_the_true_median_in_about_95_percent_of_seeded_trials(draw, true_median):
    rng, trials = np.random.default_rng(15), 4000
    hits = 0
    for _ in range(trials):
        est = stats.median_interval(draw(rng, 20))
        hits += est.low <= true_median <= est.high
    # exact coverage 0.9586; 4000 trials: standard error 0.0031
    assert abs(hits / trials - stats.coverage(20, (6, 15))) < 0.013


def test_ratio_interval_covers_the_true_ratio_at_least_95_percent_and_needs_seven_runs():
    rng, trials, hits = np.random.default_rng(16), 3000, 0
    for _ in range(trials):  # medians 0.2 ln2 and ln2: true ratio 0.2
        low, high = stats.ratio_interval(rng.exponential(0.2, 8), rng.exponential(1.0, 10))
        hits += low <= 0.2 <= high
    assert hits / trials >= 0.95
    assert stats.ratio_interval([1.0] * 6, [2.0] * 10) is None      # 6 runs: no 97.5% interval
    assert stats.ratio_interval([1.0] * 7, [2.0] * 7) == (0.5, 0.5)
    assert stats.ratio_interval([1.0] * 7, [0.0] * 7) is None       # a denominator that may be 0


def test_a_difference_is_called_only_when_the_intervals_separate():
    sync = stats.median_interval([10, 11, 12, 13, 14, 15, 16])
    faster = stats.median_interval([1, 2, 3, 4, 5, 6, 7])
    overlapping = stats.median_interval([5, 8, 9, 10, 11, 12, 30])
    assert stats.difference(faster, sync) == "lower" and stats.difference(sync, faster) == "higher"
    assert stats.difference(overlapping, sync) == stats.NO_DIFFERENCE == "no measurable difference"
    # medians 2 and 13, but 3 runs on one side: no interval, so no difference may be called
    assert stats.difference(stats.median_interval([1, 2, 3]), sync) == stats.NO_INTERVAL


def _runs(strategy: str, stalls: list[float], fault: str = "none") -> list[dict]:
    return [{"state": "ok", "cell.strategy": strategy, "cell.fault": fault.split(".")[0], "cell.fault_label": fault,
             "ckpt_count": 3, "ckpt_stall_s": s, "ckpt_durable_s": s, "ckpt_bytes": 1e6, "step_time_s": 0.1,
             "goodput": 0.5, "recovery_time_s": 10 * s, "lost_steps": 3, "matches_reference": True} for s in stalls]


def test_headline_tables_carry_n_intervals_ratio_intervals_and_the_difference_rule():
    from reports import html, tables

    sync = [1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6]
    frame = pd.DataFrame(_runs("sync", sync) + _runs("async", [0.05, 0.06, 0.07, 0.08, 0.09, 0.1, 0.11])
                         + _runs("dcp_async", [0.9, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5]) + _runs("none", [0.5, 0.6, 0.7])
                         + _runs("sync", sync, "kill") + _runs("async", sync[:6], "kill"))
    strat = tables.headline_strategies(frame[frame["cell.fault"] == "none"], {"write_GBps": 1.0}).set_index(
        "strategy")
    a = strat.loc["async"]
    assert (a["ckpt_stall_s"], a["ckpt_stall_s_n"], a["ckpt_stall_s_low"], a["ckpt_stall_s_high"]) == (0.08, 7, 0.05,
                                                                                                       0.11)
    assert a["ckpt_stall_s_exact"] and not strat.loc["none", "ckpt_stall_s_exact"]
    assert a["ckpt_stall_s_vs_sync_verdict"] == "lower"
    assert (a["ckpt_stall_s_vs_sync_low"], a["ckpt_stall_s_vs_sync_high"]) == pytest.approx((0.05 / 1.6, 0.11 / 1.0))
    assert strat.loc["dcp_async", "ckpt_stall_s_vs_sync_verdict"] == stats.NO_DIFFERENCE
    assert strat.loc["none", "ckpt_stall_s_vs_sync_verdict"] == stats.NO_INTERVAL
    assert pd.isna(strat.loc["sync", "ckpt_stall_s_vs_sync_verdict"])
    faults = tables.headline_faults(frame).set_index("strategy")
    assert faults.loc["async", "recovery_time_s_n"] == 6  # 6 runs: a 95% interval, but none for the ratio (7)
    assert faults.loc["async", "recovery_time_s_vs_sync_verdict"] == stats.NO_DIFFERENCE
    assert pd.isna(faults.loc["async", "recovery_time_s_vs_sync_low"])

    page = html.table(strat.reset_index(), [("strategy", "strategy"), ("ckpt_stall_s", "stall")], text=["strategy"],
                      ratios={"ckpt_stall_s": "ckpt_stall_s_vs_sync"}, intervals=tables.STRATEGY_METRICS)
    assert "n=7, 95% CI 0.05-0.11" in page and "x0.06 vs sync (95% CI 0.031-0.11)" in page
    assert "x0.92 vs sync: no measurable difference" in page
    assert "n=3, range 0.5-0.7 (n too small for an interval)" in page
    assert "x0.46 vs sync (n too small for an interval)" in page
