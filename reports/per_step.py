"""Techniques that work at every step instead of on an interval: a gradient shadow (``strategy=shadow``, Checkmate)
and just-in-time checkpointing (``strategy=jit``: nothing periodic, its per-rank parts kept each step). What each
costs a step against training with no checkpoint code (``none``), fault-free runs, and how far behind the training
the shadow ran (``shadow`` of result.json, from its ``shadow_lag`` events): a lag of a step or more is a step a
failure would lose.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
from markupsafe import Markup

from reports import stats
from reports.figures import empty, interval_bars
from reports.html import table
from reports.tables import col, medians, timed_runs, way

PER_STEP = ("shadow", "jit")
BASELINE = "none"
COLUMNS = [("technique", "technique"), ("step_ms", "step (ms)"), ("vs_none", "step / none's"),
           ("lag_mean_ms", "shadow's lag, mean (ms)"), ("lag_max_ms", "shadow's lag, max (ms)"),
           ("lag_steps_max", "steps behind, max")]


def has_per_step(summary: pd.DataFrame) -> bool:
    return "cell.strategy" in summary and summary["cell.strategy"].isin(PER_STEP).any()


def _fault_free(summary: pd.DataFrame) -> pd.DataFrame:
    ok = timed_runs(summary)
    return ok[ok.get("cell.fault_label", pd.Series("none", index=ok.index)).astype(str) == "none"]


def per_step_table(summary: pd.DataFrame) -> pd.DataFrame:
    """One row per technique of ``PER_STEP`` and the baseline: the step time's median with its interval, its
    ratio to the baseline's, and the shadow's lag (medians over its runs of each run's mean and max)."""
    runs = _fault_free(summary)
    ways = way(runs)
    base = col(runs[ways == BASELINE], "step_time_s")
    rows = []
    for technique in [BASELINE, *PER_STEP]:
        mine = runs[ways == technique]
        if mine.empty:
            continue
        step = col(mine, "step_time_s")
        ratio = stats.ratio_estimate(step, base) if technique != BASELINE else None
        point = step.median() / base.median() if technique != BASELINE and len(base.dropna()) else None
        rows.append({"technique": technique, **medians({"step_ms": step * 1000}),
                     "vs_none": "-" if point is None else f"x{point:.3f}" + (
                         f" [{ratio.low:.3f}, {ratio.high:.3f}] at {stats.level_text(ratio.level)}" if ratio else ""),
                     "lag_mean_ms": _median(col(mine, "shadow.lag_s_mean") * 1000),
                     "lag_max_ms": _median(col(mine, "shadow.lag_s_max") * 1000),
                     "lag_steps_max": _median(col(mine, "shadow.lag_steps_max"))})
    return pd.DataFrame(rows)


def _median(values: pd.Series) -> float | None:
    values = values.dropna()
    return round(float(values.median()), 3) if len(values) else None


def per_step(summary: pd.DataFrame) -> tuple[plt.Figure, pd.DataFrame]:
    data = per_step_table(summary)
    if data.empty or not data["technique"].isin(PER_STEP).any():
        return empty("Per-step techniques", "no timed fault-free run of shadow or jit"), data
    fig, ax = plt.subplots(figsize=(8, 0.6 + 0.5 * len(data)))
    interval_bars(ax, data, ["step_ms"], list(data["technique"]))
    ax.set(xlabel="step time, fault-free (ms; median and its interval)", title="What a step costs")
    fig.tight_layout()
    return fig, data


def per_step_note(summary: pd.DataFrame) -> Markup:
    data = per_step_table(summary)
    if data.empty:
        return Markup("")
    return table(data, COLUMNS, text=["technique", "vs_none"], intervals=["step_ms"])
