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


def test_below_six_runs_the_interval_is_the_range_at_its_own_level():
    assert [stats.median_ranks(n) for n in range(1, 6)] == [None] * 5  # n=5: 1 - 2/32 = 0.9375 < 0.95
    assert (stats.MIN_N, stats.MIN_N_RATIO) == (6, 7)  # 97.5% per side for the ratio: n=6 gives 0.969
    # the range [x_(1), x_(n)] covers the median with 1 - 2/2^n: by hand 1/2, 3/4, 7/8, 15/16
    assert [stats.interval_level(n, False) for n in range(1, 6)] == [None, 0.5, 0.75, 0.875, 0.9375]
    est = stats.median_interval([3.0, 1.0, float("nan"), 2.0])
    assert (est.median, est.n, est.low, est.high, est.exact, est.level) == (2.0, 3, 1.0, 3.0, False, 0.75)
    assert est.text() == "[1, 3] n=3 at 75%"
    assert stats.median_interval([1, 2, 3, 4]).text() == "[1, 4] n=4 at 87.5%"
    assert stats.median_interval([1, 2, 3, 4, 5]).text() == "[1, 5] n=5 at 93.75%"
    assert stats.median_interval([]).text() == "n=0"
    assert stats.median_interval([4.0]).text() == "n=1, one run: no interval"
    est = stats.median_interval(range(10, 0, -1))  # 1..10: ranks 2 and 9
    assert (est.median, est.low, est.high, est.exact, est.level) == (5.5, 2.0, 9.0, True, 0.95)
    assert est.text() == "[2, 9] n=10"
    assert stats.level_text(0.734375) == "73.43%"  # rounded down, never overstated
    with pytest.raises(ValueError, match="level=1.5"):
        stats.median_ranks(10, 1.5)


DISTRIBUTIONS = [  # (draw n runs, the true median)
    (lambda rng, size: rng.exponential(1.0, size), math.log(2)),
    (lambda rng, size: rng.lognormal(0.0, 1.0, size), 1.0),
    (lambda rng, size: 3.0 + rng.standard_normal(size), 3.0),
]


@pytest.mark.parametrize("draw,true_median", DISTRIBUTIONS)
def test_the_stated_level_is_the_empirical_coverage_for_3_to_8_runs(draw, true_median):
    """Simulated: for n = 3..8 the interval covers the true median as often as its exact coverage, which is the
    stated level below 6 runs and at least the stated 95% from 6."""
    rng, trials = np.random.default_rng(17), 3000
    for n in range(3, 9):
        ests = [stats.median_interval(x) for x in draw(rng, (trials, n))]
        hits = sum(e.low <= true_median <= e.high for e in ests) / trials
        exact = stats.coverage(n, stats.median_ranks(n) or (1, n))
        assert {e.level for e in ests} == {0.95 if n >= 6 else 1 - 2 / 2 ** n}
        # 3000 trials: standard error <= 0.008; 4 of them
        assert abs(hits - exact) < 0.032 and hits > ests[0].level - 0.032, (n, hits, exact)


@pytest.mark.parametrize("na,nb", [(3, 3), (3, 7), (4, 5), (6, 6), (7, 7), (6, 10)])
def test_the_ratio_interval_covers_the_true_ratio_at_least_as_often_as_its_stated_level(na, nb):
    rng, trials, hits = np.random.default_rng(18), 3000, 0
    levels = set()
    for _ in range(trials):  # medians 0.2 ln2 and ln2: true ratio 0.2
        est = stats.ratio_estimate(rng.exponential(0.2, na), rng.exponential(1.0, nb))
        hits += est.low <= 0.2 <= est.high
        levels.add(est.level)
    level = levels.pop()
    assert not levels  # chosen from n alone, never from the data
    assert level == pytest.approx(min(0.95, 1 - 2 / 2 ** na - 2 / 2 ** nb) if (na, nb) != (6, 10) else 0.95)
    assert hits / trials >= level - 0.02, (na, nb, hits / trials, level)


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


def test_ratio_interval_covers_the_true_ratio_at_least_95_percent_from_seven_runs_a_side():
    rng, trials, hits = np.random.default_rng(16), 3000, 0
    for _ in range(trials):  # medians 0.2 ln2 and ln2: true ratio 0.2
        low, high = stats.ratio_interval(rng.exponential(0.2, 8), rng.exponential(1.0, 10))
        hits += low <= 0.2 <= high
    assert hits / trials >= 0.95
    assert stats.ratio_interval([1.0] * 6, [2.0] * 6) is None      # 6 and 6 runs: 1 - 2/64 - 2/64 < 95%
    assert stats.ratio_estimate([1.0] * 6, [2.0] * 6).level == 1 - 4 / 64
    assert stats.ratio_interval([1.0] * 7, [2.0] * 7) == (0.5, 0.5)
    assert stats.ratio_interval([1.0] * 7, [0.0] * 7) is None       # a denominator that may be 0
    assert stats.ratio_estimate([1.0], [2.0] * 9) is None            # one run: no interval
    assert stats.ratio_ranks(10, 10) == (2, 2, pytest.approx(1 - 2 * 2 * 11 / 1024))  # 97.5% each side


def test_the_proportion_interval_is_clopper_pearson():
    # by hand: P(X >= 2 | p) = 0.025 and P(X <= 2 | p) = 0.025 for X ~ Binomial(3, p); 0 of 5: 1 - 0.025^(1/5)
    low, high = stats.proportion_interval(2, 3)
    assert 3 * low ** 2 * (1 - low) + low ** 3 == pytest.approx(0.025)
    assert 1 - high ** 3 == pytest.approx(0.025)
    assert stats.proportion_interval(0, 5) == pytest.approx((0.0, 1 - 0.025 ** 0.2))
    assert stats.proportion_interval(0, 0) is None


def test_a_difference_is_called_only_when_the_intervals_separate():
    sync = stats.median_interval([10, 11, 12, 13, 14, 15, 16])
    faster = stats.median_interval([1, 2, 3, 4, 5, 6, 7])
    overlapping = stats.median_interval([5, 8, 9, 10, 11, 12, 30])
    assert stats.difference(faster, sync) == "lower" and stats.difference(sync, faster) == "higher"
    assert stats.difference(overlapping, sync) == stats.NO_DIFFERENCE == "no measurable difference"
    # medians 2 and 13, but 3 runs on one side: a 75% interval, no 95% one, so no difference may be called
    assert stats.difference(stats.median_interval([1, 2, 3]), sync) == stats.NO_95
    assert stats.difference(stats.median_interval([1]), sync) == stats.NO_INTERVAL  # one run: no interval at all


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
    assert strat.loc["none", "ckpt_stall_s_vs_sync_verdict"] == stats.NO_95
    assert strat.loc["none", "ckpt_stall_s_level"] == 0.75
    assert strat.loc["none", "ckpt_stall_s_vs_sync_level"] == pytest.approx(1 - 2 / 8 - 2 / 128)
    assert pd.isna(strat.loc["sync", "ckpt_stall_s_vs_sync_verdict"])
    faults = tables.headline_faults(frame).set_index("strategy")
    assert faults.loc["async", "recovery_time_s_n"] == 6  # 6 runs against 7: a 95% interval, and one for the ratio
    assert faults.loc["async", "recovery_time_s_vs_sync_verdict"] == stats.NO_DIFFERENCE
    assert faults.loc["async", "recovery_time_s_vs_sync_level"] == 0.95  # 1 - 2/64 - 2/128 = 0.953

    page = html.table(strat.reset_index(), [("strategy", "strategy"), ("ckpt_stall_s", "stall")], text=["strategy"],
                      ratios={"ckpt_stall_s": "ckpt_stall_s_vs_sync"}, intervals=tables.STRATEGY_METRICS)
    assert "[0.05, 0.11] n=7" in page and "x0.06 [0.031, 0.11] vs sync: lower" in page
    assert "x0.92 [0.56, 1.5] vs sync: no measurable difference" in page
    assert "[0.5, 0.7] n=3 at 75%" in page
    assert "x0.46 [0.31, 0.7] at 73.43% vs sync: not compared: fewer than 6 runs" in page
