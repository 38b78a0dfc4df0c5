"""The soak bench's slope: growth per save with a 95% interval that holds 0 for noise and not for a leak."""

from __future__ import annotations

import random

import pytest

from resilience.bench.soak import fit, verdict


def test_a_steady_leak_is_a_slope_and_noise_is_not():
    rng = random.Random(0)
    noise = [100 + rng.gauss(0, 1) for _ in range(200)]
    leak = [100 + 0.05 * i + rng.gauss(0, 1) for i in range(200)]
    assert fit(noise).contains_zero
    slope = fit(leak)
    assert not slope.contains_zero and slope.per_save == pytest.approx(0.05, abs=0.01)


def test_the_verdict_names_the_rank_that_grows_and_leaves_the_warmup_out():
    flat = [{"rss_mb": 500.0, "fds": 40, "shm_mb": 0.0} for _ in range(50)]
    growing = [{"rss_mb": 500.0 + 2 * i, "fds": 40, "shm_mb": 0.0} for i in range(50)]
    warm = [{"rss_mb": 300.0 + 20 * i, "fds": 40 + i, "shm_mb": 0.0} for i in range(10)] + flat  # settles, then flat
    said = verdict({"readings": {0: warm, 1: growing}}, warmup=10, tolerance=0.01)
    assert said["fds"] == "flat" and said["shm_mb"] == "flat"
    assert said["rss_mb"].startswith("rank 1: +2/save") and "rank 0" not in said["rss_mb"]


def test_a_slope_needs_three_readings():
    with pytest.raises(ValueError, match="at least 3 readings"):
        fit([1.0, 2.0])
