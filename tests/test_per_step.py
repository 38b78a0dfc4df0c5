"""The report's per-step techniques (reports/per_step.py) and the shadow's lag in result.json (record/metrics.py)."""

from __future__ import annotations

import pandas as pd
import pytest

from reports.per_step import has_per_step, per_step_table
from resilience.record.metrics import _shadow


def test_the_shadows_lag_over_a_run_weighs_each_report_by_its_steps():
    lag = lambda steps, mean, worst, behind: {"kind": "shadow_lag", "steps": steps, "lag_s_mean": mean,  # noqa: E731
                                              "lag_s_max": worst, "apply_s_mean": 0.005, "lag_steps_max": behind}
    got = _shadow([lag(10, 0.01, 0.03, 0), lag(30, 0.002, 0.05, 1), {"kind": "step_end"}])
    assert got["applied_steps"] == 40 and got["lag_s_mean"] == pytest.approx((0.1 + 0.06) / 40)
    assert got["lag_s_max"] == 0.05 and got["lag_steps_max"] == 1
    assert _shadow([{"kind": "step_end"}]) is None  # another strategy: no field to read as zero lag


def test_each_per_step_technique_is_set_against_training_without_checkpoints():
    frame = pd.DataFrame({
        "state": ["ok"] * 8, "cell.fault_label": ["none"] * 6 + ["kill"] * 2,
        "cell.strategy": ["none"] * 3 + ["shadow"] * 3 + ["shadow"] * 2,
        "step_time_s": [0.05, 0.05, 0.05, 0.06, 0.06, 0.06, 9.0, 9.0],  # the killed runs' steps are left out
        "shadow.lag_s_mean": [None] * 3 + [0.01, 0.02, 0.03, 5.0, 5.0],
        "shadow.lag_s_max": [None] * 3 + [0.04, 0.05, 0.06, 5.0, 5.0],
        "shadow.lag_steps_max": [None] * 3 + [0, 1, 1, 9, 9]})
    assert has_per_step(frame) and not has_per_step(frame.assign(**{"cell.strategy": "sync"}))
    rows = per_step_table(frame).set_index("technique")
    assert list(rows.index) == ["none", "shadow"]
    assert rows.loc["shadow", "step_ms"] == pytest.approx(60.0) and rows.loc["shadow", "vs_none"].startswith("x1.200")
    assert rows.loc["shadow", "lag_mean_ms"] == pytest.approx(20.0) and rows.loc["shadow", "lag_steps_max"] == 1
