"""Pipeline parallelism side by side (``conf/matrix/pipeline.yaml``, issue 34 item 5): what each technique costs a
fault-free step and what it pays when a stage's rank dies, one row per parallel setting (``pp 2``, ``pp_dp 2x2``)
and technique.

Fault-free runs give the step time (its ratio to ``none`` of the same setting: no checkpoint and no log), the
bytes the boundary log took per step and the most it held (``stage_log`` of result.json, summed over the stages;
"-" for a technique that keeps no log) and the run's peak memory (``host_memory_peak_bytes``: the process tree's
PSS, every rank's). Killed runs give the recovery time and its parts (``recovery_breakdown_s``), the steps the
pipeline trained again (``lost_steps``), the stage-steps recomputed (every rank's share of each lost step, plus the
steps a replaced stage replayed alone: ``stage_log.replayed_stage_steps``) and the lost work's time
(``lost_work_s``). Timings are medians of ok runs that are not noisy (``tables.timed_runs``), each with its n and
interval; counts (bytes, steps) come from every ok run, a busy host changing times, not bytes. ``noisy`` says how
many ok runs were left out of the timings.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd

from reports import stats
from reports.figures import empty, interval_bars
from reports.html import table
from reports.tables import bit_exact, col, medians, noisy, not_measured, ok_runs, timed_runs

PIPELINES = ("pp", "pp_dp")
BASELINE = "none"
PARTS = ("detect", "restart", "load", "replay")
TIMED = ["step_ms", "recovery_s", *(f"{p}_s" for p in PARTS), "stage_replay_s", "lost_work_s"]
COLUMNS = [("parallel", "parallel"), ("technique", "technique"), ("step_ms", "step, fault-free (ms)"),
           ("vs_none", "step / none's"), ("log_B_step", "logged per step (B)"), ("log_held_MB", "log held, max (MB)"),
           ("peak_MB", "peak memory, all ranks (MB)"), ("recovery_s", "recovery (s)"),
           *((f"{p}_s", f"{p} (s)") for p in PARTS), ("stage_replay_s", "of which a stage's replay (s)"),
           ("lost_steps", "steps trained again"),
           ("recomputed", "stage-steps recomputed"), ("lost_work_s", "lost work (s)"), ("bit_exact", "bit-exact"),
           ("noisy", "noisy (left out)"), ("note", "")]
TEXT = ["parallel", "technique", "vs_none", "bit_exact", "noisy", "note"]


def stage_cells(summary: pd.DataFrame) -> pd.DataFrame:
    """The matrix's cells of a pipeline setting (ran or not)."""
    if summary.empty or "cell.parallel" not in summary:
        return summary.iloc[0:0]
    return summary[summary["cell.parallel"].isin(PIPELINES)]


def has_stage_cells(summary: pd.DataFrame) -> bool:
    return len(stage_cells(summary)) > 0


def _fault_free(rows: pd.DataFrame) -> pd.Series:
    return rows.get("cell.fault_label", pd.Series("none", index=rows.index)).astype(str) == "none"


def _count(values: pd.Series) -> float | None:
    """The median of a count over the runs that have it (None: none has)."""
    values = values.dropna()
    return float(values.median()) if len(values) else None


def _recomputed(killed: pd.DataFrame) -> pd.Series:
    """Per run: every rank trains each lost step again (a stage-step per rank), and a replaced stage replays alone."""
    world = col(killed, "cell.world_size")
    return col(killed, "lost_steps") * world + col(killed, "stage_log.replayed_stage_steps").fillna(0)


def _vs_none(step: pd.Series, base: pd.Series, technique: str) -> str:
    """The step time's ratio to none's: the ratio of the medians, with its interval where both have runs."""
    if technique == BASELINE or not len(base.dropna()) or not len(step.dropna()):
        return "-"
    ratio = stats.ratio_estimate(step, base)
    said = f"x{step.median() / base.median():.3f}"
    return said + (f" [{ratio.low:.3f}, {ratio.high:.3f}] at {stats.level_text(ratio.level)}" if ratio else "")


def _row(parallel: str, technique: str, rows: pd.DataFrame, base_step: pd.Series) -> dict:
    ok, timed = ok_runs(rows), timed_runs(rows)
    free, killed = timed[_fault_free(timed)], timed[~_fault_free(timed)]
    ok_free, ok_killed = ok[_fault_free(ok)], ok[~_fault_free(ok)]
    step = col(free, "step_time_s") * 1000
    parts = {f"{p}_s": col(killed, f"recovery_breakdown_s.{p}") for p in PARTS}
    # swift_log's replay of the lost stage happens before its load ends: part of "load", shown on its own
    parts["stage_replay_s"] = col(killed, "stage_log.replay_s")
    held = _count(col(ok_free, "stage_log.held_peak_bytes"))
    peak = _count(col(free, "host_memory_peak_bytes"))
    return {"parallel": parallel, "technique": technique,
            **medians({"step_ms": step, "recovery_s": col(killed, "recovery_time_s"), **parts,
                       "lost_work_s": col(killed, "lost_work_s")}),
            "vs_none": _vs_none(step, base_step, technique),
            "log_B_step": _count(col(ok_free, "stage_log.bytes_per_step")),
            "log_held_MB": None if held is None else held / 1e6, "peak_MB": None if peak is None else peak / 1e6,
            "lost_steps": _count(col(ok_killed, "lost_steps")), "recomputed": _count(_recomputed(ok_killed)),
            "bit_exact": bit_exact(ok_killed) if len(ok_killed) else "-",
            "noisy": f"{int(noisy(ok).sum())} of {len(ok)}", "note": not_measured(rows)}


def stage_table(summary: pd.DataFrame) -> pd.DataFrame:
    """One row per (parallel setting, technique), in the matrix's order (the module's docstring)."""
    cells = stage_cells(summary)
    out = []
    if len(cells):
        label = cells["parallel"] if "parallel" in cells else cells["cell.parallel"]
        for parallel, rows in cells.groupby(label, sort=False):
            timed = timed_runs(rows)
            base = col(timed[(timed["cell.strategy"] == BASELINE) & _fault_free(timed)], "step_time_s") * 1000
            for technique, mine in rows.groupby("cell.strategy", sort=False):
                out.append(_row(str(parallel), str(technique), mine, base))
    return pd.DataFrame(out, columns=[c for c, _ in COLUMNS] + [f"{m}_{p}" for m in TIMED
                                                                 for p in ("n", "low", "high", "exact", "level")])


def stage_recovery(summary: pd.DataFrame):
    """Left: the fault-free step per technique; right: the recovery from a killed stage's rank, its parts."""
    data = stage_table(summary)
    if data.dropna(subset=["step_ms", "recovery_s"], how="all").empty:
        return empty("Pipeline parallelism", "no ok, quiet run of a pipeline cell (parallel=pp|pp_dp)"), data
    labels = [f"{r.parallel} {r.technique}" for r in data.itertuples()]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 0.6 * len(data) + 1.5))
    interval_bars(left, data, ["step_ms"], labels)
    left.set(xlabel="step, fault-free (ms; median and its interval)", title="What a step costs")
    interval_bars(right, data, ["recovery_s", "restart_s", "load_s", "replay_s"], labels)
    right.set(xlabel="seconds after the kill (median and its interval)", title="Recovery and its parts")
    fig.tight_layout()
    return fig, data


def stage_recovery_note(summary: pd.DataFrame) -> str:
    data = stage_table(summary)
    if data.empty:
        return ""
    return str(table(data, COLUMNS, text=TEXT, intervals=TIMED))
