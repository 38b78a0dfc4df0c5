"""Figures of the projection, built from the tables in :mod:`resilience.projection.sweeps`.

Every title starts with "projection:" so a figure can never be mistaken for a measurement.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # files only; no display is needed (or available on a cluster node)

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402


def _palette(strategies: list[str]) -> dict[str, tuple[float, float, float]]:
    """One fixed colour per strategy, shared by all figures of a run."""
    return dict(zip(strategies, sns.color_palette("colorblind", len(strategies))))


def goodput_vs_interval(sweep: pd.DataFrame, title: str) -> Figure:
    """Goodput against checkpoint interval, one curve per strategy, the optimum of each marked and labelled."""
    strategies = list(dict.fromkeys(sweep["strategy"]))
    colors = _palette(strategies)
    fig, ax = plt.subplots(figsize=(8, 5))
    labels = {}
    for name, best in sweep[sweep["is_optimum"]].groupby("strategy", sort=False):
        row = best.iloc[0]
        labels[name] = name
        if np.isfinite(row["goodput"]):
            ax.scatter(row["interval_s"], row["goodput"], color=colors[name], marker="*", s=160, zorder=5,
                       edgecolor="black")
            # In the legend rather than next to the star: strategies with the same stall share an optimum.
            labels[name] = f"{name}: optimum {row['interval_s'] / 60:.1f} min, goodput {row['goodput']:.2f}"
    for name, rows in sweep.groupby("strategy", sort=False):
        ax.plot(rows["interval_s"], rows["goodput"], color=colors[name], label=labels.get(name, name))
    ax.legend(fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("checkpoint interval (s of compute between checkpoints)")
    ax.set_ylabel("goodput (fraction of wall time)")
    finite = sweep["goodput"][np.isfinite(sweep["goodput"])]
    if len(finite):
        ax.set_ylim(max(0.0, float(finite.max()) - 0.3), min(1.0, float(finite.max()) + 0.03))
    ax.set_title(f"projection: goodput vs checkpoint interval (\u2605 optimum)\n{title}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    return fig


def goodput_vs_cluster(sweep: pd.DataFrame, title: str, mc: pd.DataFrame | None = None) -> Figure:
    """Goodput at each strategy's optimal interval against GPU count; Monte Carlo means as markers if given."""
    strategies = list(dict.fromkeys(sweep["strategy"]))
    colors = _palette(strategies)
    fig, ax = plt.subplots(figsize=(8, 5))
    sns.lineplot(data=sweep, x="gpus", y="goodput", hue="strategy", palette=colors, marker="o", ax=ax)
    if "goodput_band_low" in sweep and sweep["goodput_band_low"].notna().any():
        for name, rows in sweep.groupby("strategy", sort=False):
            ax.fill_between(rows["gpus"], rows["goodput_band_low"], rows["goodput_band_high"], color=colors[name],
                            alpha=0.15, lw=0)
        title += "\nshaded: the failure band (per-GPU failure rates implied by the published figures)"
    if mc is not None and len(mc):
        for name, rows in mc.groupby("strategy"):
            ax.errorbar(rows["gpus"], rows["goodput_monte_carlo"], yerr=rows["goodput_monte_carlo_ci95"],
                        fmt="x", color=colors.get(name, "black"), capsize=3, label=f"{name} (Monte Carlo)")
        ax.legend(fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("goodput at the optimal interval")
    ax.set_title(f"projection: goodput vs cluster size\n{title}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    return fig


def winner_heatmap(grid: pd.DataFrame, title: str) -> Figure:
    """Which strategy gives the best goodput at each (GPU count, checkpoint size); cells show its goodput."""
    strategies = list(dict.fromkeys(grid["strategy"]))
    winners = grid[grid["winner"]]
    code = {name: i for i, name in enumerate(strategies)}
    index, columns = sorted(grid["ckpt_TB"].unique()), sorted(grid["gpus"].unique())
    codes = winners.pivot(index="ckpt_TB", columns="gpus", values="strategy").reindex(index=index, columns=columns)
    values = winners.pivot(index="ckpt_TB", columns="gpus", values="goodput").reindex(index=index, columns=columns)
    numeric = codes.apply(lambda col: col.map(code)).astype(float)
    # Margin over the best other feasible strategy: how much the choice matters in that cell.
    second = grid[~grid["winner"]].groupby(["ckpt_TB", "gpus"])["goodput"].max()
    margin = (values.stack() - second.reindex(values.stack().index)).unstack().reindex(index=index, columns=columns)
    # Where another rate inside the failure band crowns another strategy, the cell says which (and is hatched).
    changes = winners.pivot(index="ckpt_TB", columns="gpus", values="winners_in_band").reindex(
        index=index, columns=columns) if "winners_in_band" in winners else None
    # The Monte Carlo's own winner where it was run (winner_trials), named in a cell where it differs
    checked = grid[grid["winner_monte_carlo"]].pivot(index="ckpt_TB", columns="gpus", values="strategy").reindex(
        index=index, columns=columns) if "winner_monte_carlo" in grid else None
    text = np.empty(codes.shape, dtype=object)
    for i in range(codes.shape[0]):
        for j in range(codes.shape[1]):
            name, v, d = codes.iat[i, j], values.iat[i, j], margin.iat[i, j]
            text[i, j] = "none\nfeasible" if pd.isna(name) else \
                f"{name}\n{v:.2f}" + (f"\n(+{d:.2f})" if np.isfinite(d) else "")
            if changes is not None and isinstance(changes.iat[i, j], str) and " / " in changes.iat[i, j]:
                text[i, j] = changes.iat[i, j].replace(" / ", " ->\n") + f"\n{v:.2f}"
            if checked is not None and isinstance(checked.iat[i, j], str) and checked.iat[i, j] != name:
                text[i, j] += f"\nMC: {checked.iat[i, j]}"
    fig, ax = plt.subplots(figsize=(1.1 * len(columns) + 3, 0.75 * len(index) + 2.5))
    colors = ListedColormap(list(_palette(strategies).values()))
    sns.heatmap(numeric, annot=text, fmt="", cmap=colors, vmin=-0.5, vmax=len(strategies) - 0.5, cbar=False,
                linewidths=0.5, annot_kws={"fontsize": 7}, ax=ax)
    if changes is not None:
        for i in range(codes.shape[0]):
            for j in range(codes.shape[1]):
                if isinstance(changes.iat[i, j], str) and " / " in changes.iat[i, j]:
                    ax.add_patch(plt.Rectangle((j, i), 1, 1, fill=False, hatch="///", edgecolor="black", lw=0))
        title += ("\nhatched: the winner changes inside the failure band (winners from the most failures to the "
                  "fewest;\ncolour and goodput: at the scenario's calibration)")
    if checked is not None:
        differ = int(((checked != codes) & checked.notna()).sum().sum())
        title += (f"\nMonte Carlo check ({int(grid['monte_carlo_trials'].max())} trials per strategy and cell): "
                  + ("the same winner in every cell" if not differ else f"another winner in {differ} cell(s), "
                                                                        "named in them (MC: ...)"))
    ax.invert_yaxis()  # small checkpoints at the bottom
    ax.set_xlabel("GPUs")
    ax.set_ylabel("checkpoint size (TB)")
    ax.set_title(f"projection: best strategy, its goodput at its optimal interval (+ lead over the next)\n{title}",
                 fontsize=10)
    return fig


def failure_band(table: pd.DataFrame, low_h: float, high_h: float, title: str) -> Figure:
    """The per-GPU MTTF each published figure implies, the band they span and the scenario's own calibration."""
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(table) + 2))
    y = np.arange(len(table))
    ax.axvspan(low_h, high_h, color="tab:orange", alpha=0.15, label="failure band")
    ax.scatter(table["implied_per_gpu_mttf_h"], y, color="black", zorder=5)
    for yi, row in zip(y, table.itertuples()):
        ax.annotate(f"{row.published}, {row.gpus:,} GPUs", (row.implied_per_gpu_mttf_h, yi), fontsize=7,
                    xytext=(6, 3), textcoords="offset points")
    point = float(table["scenario_per_gpu_mttf_h"].iloc[0])
    ax.axvline(point, color="tab:blue", lw=1.5, label=f"scenario's calibration ({point:,.0f} GPU-h)")
    ax.set_yticks(y, table["figure"], fontsize=8)
    ax.set_xscale("log")
    ax.set_xlim(low_h / 2, high_h * 2.5)
    ax.set_xlabel("per-GPU MTTF implied by the figure (GPU-hours; job MTBF = this / GPUs)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(f"projection: the failure rate each published figure implies\n{title}", fontsize=10)
    ax.grid(True, which="both", axis="x", alpha=0.3)
    return fig


def close(fig: Figure) -> None:
    """Free a figure's memory (pyplot keeps every open figure alive)."""
    plt.close(fig)
