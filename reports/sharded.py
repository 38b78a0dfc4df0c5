"""Sharded training (``parallel=fsdp|hsdp``, docs/sharded.md): one row per parallel setting x strategy x fault.

Each row: the shards one replica holds the state in (``parallel.shards_per_replica`` of result.json: 4 for FSDP on
4 ranks, 2 for HSDP 2x2), the median checkpoint save (training-visible stall) and time to durable, the load after
the fault (the slowest rank's; resharded for ``recovery=shrink``), the recovery time, each with its n and 95%
interval (``reports.stats``), and the verdict: bit-exact against the fault-free run of the same parallel setting,
or, for a shrunk run, its final loss against that run (it cannot be bit-exact, ``SHRINK_NOTE``). Timings come from
ok runs that are not noisy; a row without any keeps its place with "not measured" and why (``tables.not_measured``).
The note under the figure has the table and the per-shard cost fit the projection uses
(``resilience.projection.sharded``).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
from markupsafe import Markup

from reports.figures import empty, interval_bars
from reports.html import render_template, table
from reports.tables import bit_exact, col, finished, medians, not_measured, order, timed_runs
from resilience.bench.sharded import step_rates
from resilience.projection.sharded import per_shard_fit
from resilience.record.events import read_events

SHARDED = ("fsdp", "hsdp")
MEASURES = {"save_s": "ckpt_stall_s", "durable_s": "ckpt_durable_s", "load_s": "recovery_load_s",
            "recovery_s": "recovery_time_s"}
SHRINK_NOTE = ("A run shrunk after a node loss cannot be bit-exact against the fault-free run: on fewer ranks each "
               "step sums fewer ranks' batches, so the global batch changes (and with it the update and the "
               "summation groups). It is reported by its final loss against the fault-free run of the same "
               "parallel setting.")
COLUMNS = [("parallel", "parallel"), ("strategy", "strategy"), ("fault", "fault"), ("shards", "shards per replica"),
           ("cells", "cells"), ("runs", "finished"), ("save_s", "save (s)"), ("durable_s", "durable (s)"),
           ("load_s", "load after fault (s)"), ("loaded_MB", "recovery bytes (MB)"), ("recovery_s", "recovery (s)"),
           ("throughput", "steps/s before -> after the fault"), ("bit_exact", "bit-exact"),
           ("loss_delta", "loss vs fault-free"), ("note", "")]


def sharded_cells(summary: pd.DataFrame) -> pd.DataFrame:
    """The matrix's cells of a sharded parallel setting (ran or not)."""
    if summary.empty or "cell.parallel" not in summary:  # a matrix without the parallel axis: no sharded cell
        return summary.iloc[0:0].assign(**{"cell.parallel": pd.Series(dtype=object)})
    return summary[summary["cell.parallel"].isin(SHARDED)]


def _shards(rows: pd.DataFrame) -> str:
    """Shards per replica as recorded by the runs ("4"), or from the parallel setting where none ran."""
    seen = col(rows, "parallel.shards_per_replica").dropna().astype(int).unique()
    return ", ".join(map(str, sorted(seen))) if len(seen) else "-"


def _is_shrink(rows: pd.DataFrame) -> bool:
    return bool((rows.get("cell.recovery", pd.Series(dtype=object)).astype(str) == "shrink").any())


def _loss_delta(rows: pd.DataFrame, summary: pd.DataFrame) -> float | None:
    """The median final loss of ``rows`` minus that of each one's reference cell."""
    loss = dict(zip(summary["cell"], col(summary, "final_loss")))
    deltas = [own - loss.get(ref, float("nan")) for own, ref in zip(col(rows, "final_loss"), rows["reference_cell"])]
    delta = pd.Series(deltas, dtype=float).median()
    return None if pd.isna(delta) else float(delta)


def _throughput(timed: pd.DataFrame) -> str:
    """Steps per second of the first and the last attempt (median over the runs; from their events), with the
    world sizes: "0.67 -> 1.14 (4 -> 2 ranks)" after a shrink. "-" without runs whose events are at hand."""
    firsts, lasts, worlds = [], [], set()
    for run_dir in timed.get("run_dir", pd.Series(dtype=object)).dropna():
        if not (Path(run_dir) / "events.jsonl").exists():
            continue
        sizes, rate = step_rates(read_events(Path(run_dir)))
        if rate and sizes:
            firsts.append(rate[min(rate)])
            lasts.append(rate[max(rate)])
            worlds.add((sizes[0], sizes[-1]))
    first, last = pd.Series(firsts, dtype=float).median(), pd.Series(lasts, dtype=float).median()
    if pd.isna(first) or pd.isna(last):
        return "-"
    sizes = " / ".join(f"{a} -> {b} ranks" for a, b in sorted(worlds))
    return f"{first:.2f} -> {last:.2f} ({sizes}; n={len(firsts)})"


def has_sharded_cells(summary: pd.DataFrame) -> bool:
    """Whether the matrix asked for a sharded cell (parallel=fsdp|hsdp): the report's section is left out without."""
    return len(sharded_cells(summary)) > 0


def sharded_table(summary: pd.DataFrame) -> pd.DataFrame:
    """One row per (parallel, strategy, fault) of the sharded cells, in the matrix's order (module docstring)."""
    cells = sharded_cells(summary)
    if len(cells):
        cells = cells[cells["cell.strategy"] != "none"]  # the fault-free reference: no checkpoint to time
    out = []
    for (parallel, strategy, fault), rows in (cells.groupby(["cell.parallel", "cell.strategy", "cell.fault_label"],
                                                           sort=False) if len(cells) else ()):
        ran, timed = finished(rows), timed_runs(rows)
        shrink = _is_shrink(rows)
        out.append({"parallel": parallel, "strategy": strategy, "fault": fault, "shards": _shards(rows),
                    "cells": len(rows), "runs": len(ran),
                    **medians({m: col(timed, c) for m, c in MEASURES.items()}), "throughput": _throughput(timed),
                    # what the recovery loaded (result.json recovery_bytes): one shard's for a replica recovery
                    "loaded_MB": col(ran, "recovery_bytes").median() / 1e6 if len(ran) else None,
                    "bit_exact": ("not by design (world size changes)" if shrink and len(ran) else bit_exact(ran)),
                    "loss_delta": _loss_delta(ran, summary) if shrink and len(ran) else None,
                    "note": not_measured(rows)})
    return pd.DataFrame(out, columns=[c for c, _ in COLUMNS] + [
        f"{m}_{p}" for m in MEASURES for p in ("n", "low", "high", "exact")])


def _label(row: pd.Series) -> str:
    return f"{row['parallel']} ({row['shards']} shards) {row['strategy']}\n{row['fault']}"


def sharded(summary: pd.DataFrame):
    """Checkpoint save and load time per shard count (median, 95% interval or the runs' range)."""
    data = sharded_table(summary)
    shown = data.dropna(subset=["save_s", "load_s"], how="all")
    if shown.empty:
        why = ("the matrix ran no sharded cell (parallel=fsdp|hsdp)" if data.empty or not data["runs"].any() else
               "no sharded run is ok and quiet (a noisy run's timings are left out; its verdicts are in the table)")
        return empty("Sharded training", why), data
    fig, ax = plt.subplots(figsize=(9, 0.7 * len(shown) + 1.5))
    interval_bars(ax, shown, ["save_s", "load_s"], [_label(r) for _, r in shown.iterrows()])
    ax.set(xlabel="seconds (median of ok, quiet runs; bar: the median's interval, 95% from 6 runs, "
                  "else the runs' range at its level)")
    fig.tight_layout()
    return fig, data


def sharded_note(summary: pd.DataFrame) -> str:
    """The table under the figure, the shrink sentence and the per-shard fit (HTML)."""
    data = sharded_table(summary)
    if data.empty:
        return ""
    fit = per_shard_fit(summary)
    return str(render_template(
        "sharded.html.j2", table=table(data, COLUMNS, text=["parallel", "strategy", "fault", "shards", "throughput",
                                                             "bit_exact", "note"], intervals=list(MEASURES)),
        shrink_note=SHRINK_NOTE if (data["loss_delta"].notna().any() or "shrink" in " ".join(order(
            sharded_cells(summary), "cell.recovery"))) else "",
        fit=fit_html(fit)))


def fit_html(fit: pd.DataFrame) -> Markup:
    """The per-shard cost fit as a short table (also the projection section's), or why there is none."""
    return render_template("sharded_fit.html.j2", rows=fit.to_dict("records"))


def projection_html(folder: Path) -> Markup:
    """The projection section's statement of the per-shard fit it used (``projection_per_shard.csv``), if any."""
    path = folder / "projection_per_shard.csv"
    fit = pd.read_csv(path) if path.exists() and path.stat().st_size > 1 else pd.DataFrame()
    if fit.empty:
        return Markup("")
    return Markup("<h3>Sharded runs: per-shard costs</h3>") + fit_html(fit) + Markup(
        f'<p class="caption">Data: {folder.name}/projection_per_shard.csv.</p>')
