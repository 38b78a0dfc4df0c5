"""The report's measured figures, each returned with the data it draws (written as CSV beside the report).

Every function takes the summary table and returns ``(Figure, DataFrame)``; with nothing to draw, the figure says
so rather than being missing (the report and ``snakemake --report`` expect every file). Every median drawn carries
its n and its interval with the interval's level (``reports.stats``: 95% from 6 runs, the runs' range at its own
level below), in the figure and in its CSV (``<m>_n``, ``_low``, ``_high``, ``_level``).
"""

from __future__ import annotations

import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from reports import stats  # noqa: E402
from reports.tables import col, interval_columns, medians, ok_runs, order, way  # noqa: E402

PHASES = ("detect", "restart", "load", "replay")
sns.set_theme(style="whitegrid", context="notebook", palette="colorblind")


def wrap_label(label: str, width: int = 28) -> str:
    """A fault label (``kill.phase=during_checkpoint.at_step=10``) broken after its dots to fit an axis."""
    lines = [""]
    for part in re.split(r"(?<=\.)", label):
        if lines[-1] and len(lines[-1]) + len(part) > width:
            lines.append("")
        lines[-1] += part
    return "\n".join(lines)


def empty(title: str, reason: str) -> Figure:
    fig, ax = plt.subplots(figsize=(8, 1.6))
    ax.axis("off")
    ax.text(0.5, 0.5, f"{title}\nno data: {reason}", ha="center", va="center")
    return fig


def interval_bars(ax, table: pd.DataFrame, measures: list[str], labels: list[str]) -> None:
    """Horizontal bars, one group per row of ``table`` and one bar per measure: the median, and as error bar its
    interval (``<m>_low`` / ``<m>_high`` at ``<m>_level``, from ``reports.tables.medians``)."""
    y = np.arange(len(table))[::-1]
    height = 0.8 / len(measures)
    for k, (m, color) in enumerate(zip(measures, sns.color_palette("colorblind", len(measures)))):
        mid = table[m].astype(float).to_numpy()
        low = np.nan_to_num(mid - table[f"{m}_low"].astype(float).to_numpy())
        high = np.nan_to_num(table[f"{m}_high"].astype(float).to_numpy() - mid)
        ax.barh(y + (len(measures) / 2 - k - 0.5) * height, np.nan_to_num(mid), height=height, color=color,
                label=m, xerr=[low, high], error_kw={"elinewidth": 1, "capsize": 2})
    ax.set_yticks(y, labels, fontsize=9)
    ax.legend(fontsize=8, frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1))


def median_ci(values: pd.Series) -> tuple[float, float]:
    """Seaborn's ``errorbar``: the median's interval (95% from 6 runs, else the runs' range at its level)."""
    est = stats.median_interval(values)
    return (est.low, est.high) if est.n else (np.nan, np.nan)


def recovery_breakdown(frame: pd.DataFrame) -> tuple[Figure, pd.DataFrame]:
    """Stacked bars: median detect / restart / load / replay seconds per (strategy, fault) of recovered runs."""
    ok = ok_runs(frame)
    recovered = ok[ok.get("recovered", pd.Series(False, index=ok.index)).isin([True, "True"])]
    rows, ways = [], way(recovered)  # torchrun's or NVRx's restart: its own bar (tables.way)
    for fault in order(recovered, "cell.fault_label"):
        for strategy in order(recovered.assign(way=ways), "way"):
            mine = recovered[(ways == strategy) & (recovered["cell.fault_label"] == fault)]
            if mine.empty:
                continue
            row = {"strategy": strategy, "fault": fault, "runs": len(mine)}
            row.update(medians({p: col(mine, f"recovery_breakdown_s.{p}").fillna(0) for p in PHASES}))
            row.update(medians({"recovery_time_s": col(mine, "recovery_time_s")}))
            rows.append(row)
    data = pd.DataFrame(rows, columns=["strategy", "fault", "runs", *PHASES, "recovery_time_s",
                                       *interval_columns(["recovery_time_s", *PHASES])])
    if data.empty:
        return empty("Recovery time breakdown", "no recovered run"), data
    fig, ax = plt.subplots(figsize=(9, 0.75 * len(data) + 1.6))
    labels = [f"{r.strategy}  |  {wrap_label(r.fault, 40)}" for r in data.itertuples()]
    y = np.arange(len(data))[::-1]
    left = np.zeros(len(data))
    for phase, color in zip(PHASES, sns.color_palette("colorblind", len(PHASES))):
        ax.barh(y, data[phase], left=left, color=color, label=phase, height=0.6)
        left += data[phase].to_numpy()
    for yi, r in zip(y, data.itertuples()):
        low, high = r.recovery_time_s_low, r.recovery_time_s_high
        ax.errorbar(r.recovery_time_s, yi, xerr=[[r.recovery_time_s - low], [high - r.recovery_time_s]], fmt="none",
                    ecolor="black", elinewidth=1, capsize=3)
        spread = stats.interval_text(r.recovery_time_s_n, low, high, r.recovery_time_s_exact)
        ax.text(high, yi, f"  {r.recovery_time_s:.2f} s, {spread}", va="center", fontsize=8)
    ax.set_yticks(y, labels, fontsize=9)
    ax.set_xlabel("seconds from fault injection until training is back at the fault's step (median of n runs; "
                  "bar: the total's CI at the level shown,\n95% from 6 runs, else the runs' range; each phase's n "
                  "and interval in recovery_breakdown.csv)")
    ax.set_xlim(0, float(data["recovery_time_s_high"].max()) * 1.6)
    ax.legend(ncols=4, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    ax.set_title("Recovery time breakdown by strategy and fault", pad=28)
    fig.tight_layout()
    return fig, data


def n_label(name: str, sizes, per: str = "point") -> str:
    """A legend or axis entry: the runs behind each of its medians (``sizes``, one per point or bar) and the
    level of their intervals: "sync (n=3 per point, 75% CI)"; a range where they differ."""
    ns = sorted(set(int(n) for n in sizes)) or [0]
    levels = sorted({stats.interval_level(n, n >= stats.MIN_N) or 0 for n in ns})
    n = str(ns[0]) if len(ns) == 1 else f"{ns[0]}-{ns[-1]}"
    ci = "/".join(stats.level_text(lv) for lv in levels if lv) or "no"
    return f"{name} (n={n} per {per}, {ci} CI)"


def ckpt_overhead(frame: pd.DataFrame) -> tuple[Figure, pd.DataFrame]:
    """Stall and time-until-durable per checkpoint, and the stall's share of training time: against the interval
    where the matrix runs several, else per strategy at its one interval. Fault-free runs only (a row never pools
    faults); a run counts with a stall (in-memory snapshots stall training without a durable checkpoint)."""
    ok = ok_runs(frame)
    ok = ok[ok.get("cell.fault_label", pd.Series("none", index=ok.index)).astype(str) == "none"]
    saved = ok[col(ok, "ckpt_stall_s").notna()]
    data = pd.DataFrame({
        "cell": saved.get("cell"), "strategy": saved.get("cell.strategy"), "fault": saved.get("cell.fault_label"),
        "checkpoint_every": col(saved, "cell.checkpoint.every"), "ckpt_stall_s": col(saved, "ckpt_stall_s"),
        "ckpt_durable_s": col(saved, "ckpt_durable_s"), "step_time_s": col(saved, "step_time_s"),
    })
    if data.empty:
        return empty("Checkpoint overhead vs interval", "no run saved a checkpoint"), data
    data["overhead_pct"] = 100 * data["ckpt_stall_s"] / (data["checkpoint_every"] * data["step_time_s"])
    label = {s: n_label(s, data[data["strategy"] == s].groupby("checkpoint_every").size())
             for s in order(data, "strategy")}
    data["runs"] = data["strategy"].map(label)  # every point's n and interval level is in its legend entry
    if data["checkpoint_every"].nunique() < 2:
        return _overhead_at_one_interval(data), data
    long = data.melt(id_vars=["strategy", "checkpoint_every"], value_vars=["ckpt_stall_s", "ckpt_durable_s"],
                     var_name="measure", value_name="seconds")
    long["measure"] = long["measure"].map({"ckpt_stall_s": "stall", "ckpt_durable_s": "until durable"})
    hue_order = list(label.values())
    long = long.assign(strategy=long["strategy"].map(dict(zip(data["strategy"], data["runs"]))))
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    sns.lineplot(long, x="checkpoint_every", y="seconds", hue="strategy", style="measure", hue_order=hue_order,
                 estimator="median", errorbar=median_ci, markers=True, ax=a)
    sns.scatterplot(data, x="checkpoint_every", y="ckpt_stall_s", hue="runs", hue_order=hue_order, alpha=0.35,
                    legend=False, ax=a)
    a.set(xlabel="checkpoint interval (steps)", ylabel="seconds per checkpoint\n(median and CI as in the legend; "
                                                        "dots: runs)",
          title="Cost of one checkpoint", ylim=(0, None))
    sns.lineplot(data, x="checkpoint_every", y="overhead_pct", hue="runs", hue_order=hue_order,
                 estimator="median", errorbar=median_ci, marker="o", ax=b)
    b.set(xlabel="checkpoint interval (steps)", ylabel="stall / training time between checkpoints (%)",
          title="Checkpoint overhead", ylim=(0, None))
    for ax in (a, b):
        ax.set_xticks(sorted(data["checkpoint_every"].dropna().unique()))
        sns.move_legend(ax, "upper left", bbox_to_anchor=(1.01, 1), frameon=False, fontsize=9, title_fontsize=9)
    fig.tight_layout()
    return fig, data


def _overhead_at_one_interval(data: pd.DataFrame) -> Figure:
    """The overhead figure of a matrix with one checkpoint interval: per strategy, not a line over one point."""
    every = int(data["checkpoint_every"].dropna().iloc[0]) if data["checkpoint_every"].notna().any() else None
    rows = []
    for strategy in order(data, "strategy"):
        mine = data[data["strategy"] == strategy]
        rows.append({"strategy": strategy, **medians({"stall": mine["ckpt_stall_s"],
                                                       "until durable": mine["ckpt_durable_s"],
                                                       "overhead": mine["overhead_pct"]})})
    table = pd.DataFrame(rows)
    labels = [n_label(s, [n], "bar") for s, n in zip(table["strategy"], table["stall_n"])]
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 0.5 * len(table) + 2))
    interval_bars(a, table, ["stall", "until durable"], labels)
    a.set(xscale="log", xlabel="seconds per checkpoint (median; bar: its CI)",
          title=f"Cost of one checkpoint, every {every} steps")
    interval_bars(b, table, ["overhead"], labels)
    b.set(xlabel="stall / training time between checkpoints (%)",
          title=f"Overhead at this matrix's one interval ({every} steps); matrix=full sweeps it")
    b.get_legend().remove()
    fig.tight_layout()
    return fig


def cell_note(r) -> str:
    """A heatmap cell: coverage of n runs with its 95% interval; the median latency of the detected runs with
    their n and interval."""
    if r is None or not r.runs:
        return "not armed"
    text = f"{r.coverage:.0%} of {r.runs} (95% CI {r.coverage_low:.0%}-{r.coverage_high:.0%})"
    if not r.latency_s_n:
        return text
    spread = "n=1, no interval" if r.latency_s_n == 1 else stats.interval_text(
        r.latency_s_n, r.latency_s_low * 1000, r.latency_s_high * 1000, r.latency_s_exact, r.latency_s_level) + " ms"
    return f"{text}\n{r.latency_s * 1000:.0f} ms ({spread})"


def detection(frame: pd.DataFrame) -> tuple[Figure, pd.DataFrame]:
    """Heatmap of fault x detector: share of runs in which that detector reported the fault first, and how fast."""
    faulted = frame[(frame.get("cell.fault", pd.Series(dtype=object)) != "none") & frame.get(
        "fault_injected", pd.Series(False, index=frame.index)).isin([True, "True"])]
    detectors = list(dict.fromkeys(d for ds in frame.get("cell.detectors", pd.Series(dtype=object)).dropna()
                                   for d in str(ds).split("+")))
    rows = []
    for fault in order(faulted, "cell.fault_label"):
        mine = faulted[faulted["cell.fault_label"] == fault]
        for det in detectors:
            armed = mine[mine["cell.detectors"].str.split("+").apply(lambda ds, d=det: d in ds)]
            hits = armed[armed.get("detector", pd.Series(dtype=object)) == det]
            share = stats.proportion_interval(len(hits), len(armed))
            rows.append({"fault": fault, "detector": det, "runs": len(armed), "detected": len(hits),
                         "coverage": len(hits) / len(armed) if len(armed) else np.nan,
                         "coverage_low": share[0] if share else np.nan, "coverage_high": share[1] if share else np.nan,
                         **medians({"latency_s": col(hits, "detection_latency_s")})})
    data = pd.DataFrame(rows, columns=["fault", "detector", "runs", "detected", "coverage", "coverage_low",
                                       "coverage_high", "latency_s", *interval_columns(["latency_s"])])
    if data.empty:
        return empty("Detection coverage", "no run with an injected fault"), data
    cov = data.pivot(index="fault", columns="detector", values="coverage").reindex(
        index=order(data, "fault"), columns=detectors)
    cells = {(r.fault, r.detector): r for r in data.itertuples()}
    annot = cov.copy().astype(object)
    for f in cov.index:
        for d in cov.columns:
            annot.loc[f, d] = cell_note(cells.get((f, d)))
    fig, ax = plt.subplots(figsize=(3.2 * len(detectors) + 4, 1.1 * len(cov) + 1.8))
    sns.heatmap(cov.astype(float), annot=annot.to_numpy(), fmt="", vmin=0, vmax=1, cmap="Greens", cbar_kws={
        "label": "coverage"}, linewidths=1, linecolor="white", annot_kws={"fontsize": 8}, ax=ax)
    ax.set_yticks(np.arange(len(cov)) + 0.5, [wrap_label(f, 40) for f in cov.index], rotation=0, fontsize=9)
    ax.set(xlabel="detector", ylabel="fault", title="Detection coverage (95% CI) and median detection latency "
                                                     "(n runs, CI at the level shown)")
    fig.tight_layout()
    return fig, data
