"""The report's measured figures, each returned with the data it draws (written as CSV beside the report).

Every function takes the summary table and returns ``(Figure, DataFrame)``; with nothing to draw, the figure says
so rather than being missing (the report and ``snakemake --report`` expect every file).
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
from reports.tables import col, interval_columns, medians, ok_runs, order  # noqa: E402

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
    95% interval or the runs' range (``<m>_low`` / ``<m>_high``, from ``reports.tables.medians``)."""
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
    """Seaborn's ``errorbar``: the median's 95% interval, or the runs' range where n < 6 (reports.stats)."""
    est = stats.median_interval(values)
    return (est.low, est.high) if est.n else (np.nan, np.nan)


def recovery_breakdown(frame: pd.DataFrame) -> tuple[Figure, pd.DataFrame]:
    """Stacked bars: median detect / restart / load / replay seconds per (strategy, fault) of recovered runs."""
    ok = ok_runs(frame)
    recovered = ok[ok.get("recovered", pd.Series(False, index=ok.index)).isin([True, "True"])]
    rows = []
    for fault in order(recovered, "cell.fault_label"):
        for strategy in order(frame, "cell.strategy"):
            mine = recovered[(recovered["cell.strategy"] == strategy) & (recovered["cell.fault_label"] == fault)]
            if mine.empty:
                continue
            row = {"strategy": strategy, "fault": fault, "runs": len(mine)}
            row.update({p: col(mine, f"recovery_breakdown_s.{p}").fillna(0).median() for p in PHASES})
            row.update(medians({"recovery_time_s": col(mine, "recovery_time_s")}))
            rows.append(row)
    data = pd.DataFrame(rows, columns=["strategy", "fault", "runs", *PHASES, "recovery_time_s",
                                       *interval_columns(["recovery_time_s"])])
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
        ax.text(high, yi, f"  {r.recovery_time_s:.2f} s ({spread})", va="center", fontsize=8)
    ax.set_yticks(y, labels, fontsize=9)
    ax.set_xlabel("seconds from fault injection until training is back at the fault's step (median; bar: 95% CI "
                  "of the total, or the runs' range where n < 6)")
    ax.set_xlim(0, float(data["recovery_time_s_high"].max()) * 1.6)
    ax.legend(ncols=4, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    ax.set_title("Recovery time breakdown by strategy and fault", pad=28)
    fig.tight_layout()
    return fig, data


def ckpt_overhead(frame: pd.DataFrame) -> tuple[Figure, pd.DataFrame]:
    """Stall and time-until-durable per checkpoint, and the stall's share of training time, against the interval."""
    ok = ok_runs(frame)
    saved = ok[col(ok, "ckpt_count") > 0]
    data = pd.DataFrame({
        "cell": saved.get("cell"), "strategy": saved.get("cell.strategy"), "fault": saved.get("cell.fault_label"),
        "checkpoint_every": col(saved, "cell.checkpoint.every"), "ckpt_stall_s": col(saved, "ckpt_stall_s"),
        "ckpt_durable_s": col(saved, "ckpt_durable_s"), "step_time_s": col(saved, "step_time_s"),
    })
    if data.empty:
        return empty("Checkpoint overhead vs interval", "no run saved a checkpoint"), data
    data["overhead_pct"] = 100 * data["ckpt_stall_s"] / (data["checkpoint_every"] * data["step_time_s"])
    long = data.melt(id_vars=["strategy", "checkpoint_every"], value_vars=["ckpt_stall_s", "ckpt_durable_s"],
                     var_name="measure", value_name="seconds")
    long["measure"] = long["measure"].map({"ckpt_stall_s": "stall", "ckpt_durable_s": "until durable"})
    runs = data["strategy"].value_counts()
    data["runs"] = data["strategy"].map(lambda s: f"{s} (n={runs[s]})")  # every point's n is in its legend entry
    hue_order = [f"{s} (n={runs[s]})" for s in order(data, "strategy")]
    long = long.assign(strategy=long["strategy"].map(dict(zip(data["strategy"], data["runs"]))))
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    sns.lineplot(long, x="checkpoint_every", y="seconds", hue="strategy", style="measure", hue_order=hue_order,
                 estimator="median", errorbar=median_ci, markers=True, ax=a)
    sns.scatterplot(data, x="checkpoint_every", y="ckpt_stall_s", hue="runs", hue_order=hue_order, alpha=0.35,
                    legend=False, ax=a)
    a.set(xlabel="checkpoint interval (steps)", ylabel="seconds per checkpoint\n(median, 95% CI or range; dots: runs)",
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
            rows.append({"fault": fault, "detector": det, "runs": len(armed), "detected": len(hits),
                         "coverage": len(hits) / len(armed) if len(armed) else np.nan,
                         "latency_s_median": col(hits, "detection_latency_s").median() if len(hits) else np.nan})
    data = pd.DataFrame(rows, columns=["fault", "detector", "runs", "detected", "coverage", "latency_s_median"])
    if data.empty:
        return empty("Detection coverage", "no run with an injected fault"), data
    cov = data.pivot(index="fault", columns="detector", values="coverage").reindex(
        index=order(data, "fault"), columns=detectors)
    notes = data.pivot(index="fault", columns="detector", values="latency_s_median").reindex_like(cov)
    counts = data.pivot(index="fault", columns="detector", values="runs").reindex_like(cov)
    annot = cov.copy().astype(object)
    for f in cov.index:
        for d in cov.columns:
            c, lat, n = cov.loc[f, d], notes.loc[f, d], counts.loc[f, d]
            annot.loc[f, d] = "not armed" if not n else f"{c:.0%} of {n:.0f}" + (
                f"\n{lat * 1000:.0f} ms" if pd.notna(lat) else "")
    fig, ax = plt.subplots(figsize=(2.6 * len(detectors) + 4, 0.7 * len(cov) + 1.6))
    sns.heatmap(cov.astype(float), annot=annot.to_numpy(), fmt="", vmin=0, vmax=1, cmap="Greens", cbar_kws={
        "label": "coverage"}, linewidths=1, linecolor="white", ax=ax)
    ax.set_yticks(np.arange(len(cov)) + 0.5, [wrap_label(f, 40) for f in cov.index], rotation=0, fontsize=9)
    ax.set(xlabel="detector", ylabel="fault", title="Detection coverage (and median detection latency)")
    fig.tight_layout()
    return fig, data
