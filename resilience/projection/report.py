"""The human-readable summary the CLI prints."""

from __future__ import annotations

import numpy as np
import pandas as pd

from resilience.projection.calibration import FailureBand, decimals
from resilience.projection.goodput import goodput
from resilience.projection.intervals import daly_interval, optimal_interval, young_interval
from resilience.projection.scenario import Scenario
from resilience.projection.sweeps import TB, evaluate


def _duration(seconds: float) -> str:
    """Seconds as the most readable unit (s, min or h); "-" for none (NaN: e.g. no checkpoint interval)."""
    if not np.isfinite(seconds):
        return "-"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def _count(n: float) -> str:
    """405e9 -> '405B', 1e12 -> '1T'."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if n >= scale:
            return f"{n / scale:.4g}{unit}"
    return f"{n:.4g}"


def _interval(seconds: float) -> str:
    """An interval in seconds with minutes alongside (the formulas are usually checked in seconds)."""
    return f"{seconds:,.0f} s ({seconds / 60:.1f} min)"


def calibration_lines(band: FailureBand, calibration: pd.DataFrame, gpus: int) -> list[str]:
    """The published figures, what each implies per GPU, and the model's reproduction at the scenario's rate."""
    lines = ["", f"Failure band: per-GPU MTTF {band.low_h:,.0f} to {band.high_h:,.0f} GPU-hours (job MTBF "
                 f"{_duration(band.low_h / gpus * 3600)} to {_duration(band.high_h / gpus * 3600)} at {gpus:,} GPUs), "
                 f"from {len(calibration)} published figures",
             f"  {'figure':<24} {'GPUs':>8} {'published':<36} {'per-GPU MTTF':>12} {'model':>9} {'error':>7}  source"]
    for row in calibration.itertuples():
        lines.append(f"  {row.figure:<24} {row.gpus:>8,} {row.published:<36} {row.implied_per_gpu_mttf_h:>12,.0f} "
                     f"{row.model_value:>9.3g} {row.relative_error:>+7.0%}  {row.source}")
    lines.append("  (model: the failure model at the scenario's per-GPU MTTF; error: model / published - 1)")
    return lines


def format_summary(scn: Scenario, summary: pd.DataFrame, example_stalls_s: tuple[float, ...], mc_seconds: float,
                   trials: int, outputs: str, measured: str | None, band: FailureBand | None = None,
                   calibration: pd.DataFrame | None = None, winners: pd.DataFrame | None = None) -> str:
    """Summary of a projection run; ``summary`` is :func:`resilience.projection.sweeps.strategy_summary`'s table.
    Goodput is printed to the precision the failure band supports, with the band beside it."""
    f = scn.failure
    mtbf = scn.mtbf_s
    mix = ", ".join(f"{kind} {share:.1%}" for kind, share in
                    sorted(zip((k.name for k in scn.kinds), f.kind_shares), key=lambda x: -x[1]) if share > 0)
    shape = f" (shape {f.weibull_shape:g})" if f.distribution == "weibull" else ""
    lines = [
        f"projection: {scn.name} -- {scn.gpus:,} GPUs, {scn.duration_days:g} days"
        + (f"\n  {scn.description}" if scn.description else ""),
        "",
        f"Failure model (table: {scn.table_path.name}, {scn.table.total} interruptions)",
        f"  per-GPU MTTF      {f.per_gpu_mttf_h:,.0f} GPU-hours",
        f"  job MTBF          {mtbf / 3600:.2f} h at {scn.gpus:,} GPUs "
        f"(~{scn.horizon_s / mtbf:,.0f} interruptions expected in {scn.duration_days:g} days)",
        f"  inter-failure     {f.distribution}{shape}",
        f"  recovery mix      {mix}",
    ]
    if band is not None and calibration is not None:
        lines += calibration_lines(band, calibration, scn.gpus)
    ref = next(iter(scn.strategies))
    p = evaluate(scn, ref)
    lines += ["", f"Checkpoint interval at job MTBF {mtbf / 3600:.2f} h "
                  f"(synchronous save; recovery as '{ref}', mean {_duration(p.mean_recovery_s)})",
              f"  {'stall':>7}  {'Young':>18}  {'Daly':>18}  {'exact optimum':>18}  {'goodput at Daly':>15}"]
    for stall in example_stalls_s:
        young, daly = young_interval(stall, mtbf), daly_interval(stall, mtbf)
        best = optimal_interval(stall, mtbf)
        g = goodput(daly, mtbf, stall, stall, p.recovery_s, p.shares)
        lines.append(f"  {stall:>5g} s  {_interval(young):>18}  {_interval(daly):>18}  {_interval(best):>18}"
                     f"  {g:>15.3f}")
    source = f"fitted from {measured}" if measured else "scenario defaults"
    w = max([12, *(len(str(n)) for n in summary["strategy"])])  # swift_log_selective is wider than 12
    lines += ["", f"Strategies at {scn.gpus:,} GPUs, checkpoint {scn.ckpt_bytes / TB:.2f} TB "
                  f"({_count(scn.params)} params x {scn.bytes_per_param:g} B); costs: {source}",
              f"  {'strategy':<{w}} {'stall':>8} {'durable':>9} {'recovery':>9} {'Daly':>9} {'optimum':>9} "
              f"{'goodput (failure band)':>22}  {'Monte Carlo':<12}"]
    for row in summary.itertuples():
        if not row.feasible:
            lines.append(f"  {row.strategy:<{w}} infeasible: checkpoint shard exceeds the strategy's memory limit")
            continue
        # The simulation's own 95% CI (a few 1e-4) is far narrower than the band: the band sets the digits.
        d = decimals(row.goodput_band_low, row.goodput_band_high) if band is not None else 3
        mc = f"{row.goodput_monte_carlo:.{d}f}" if np.isfinite(row.goodput_monte_carlo) else "-"
        good = row.goodput_shown if band is not None else f"{row.goodput_closed_form:.3f}"
        lines.append(f"  {row.strategy:<{w}} {_duration(row.stall_s):>8} {_duration(row.durable_s):>9} "
                     f"{_duration(row.mean_recovery_s):>9} {_duration(row.daly_interval_s):>9} "
                     f"{_duration(row.optimal_interval_s):>9} {good:>22}  {mc:<12}")
    notes = summary[summary.get("cost_note", pd.Series("", index=summary.index)).fillna("").astype(str) != ""]
    for r in notes.itertuples():  # the pipeline techniques' rules: the lost work, then the step overhead
        lines += [f"  {r.strategy}: {part}" for part in r.cost_note.split("; ", 1)]
    if f.distribution != "exponential":
        lines.append(f"  (goodput: closed form for exponential failures with the same MTBF; Monte Carlo: "
                     f"{f.distribution}{shape})")
    if winners is not None and "winner_changes_in_band" in winners:
        cells = winners[winners["winner"]]
        changed = cells[cells["winner_changes_in_band"]]
        lines += ["", f"Winner map: the winner changes inside the failure band in {len(changed)} of {len(cells)} cells"
                      + "".join(f"\n  {r.gpus:,} GPUs, {r.ckpt_TB:g} TB: {r.winners_in_band}"
                                for r in changed.head(5).itertuples())]
        if "winner_monte_carlo" in winners:
            checked = winners[winners["winner_monte_carlo"]].set_index(["gpus", "ckpt_TB"])
            named = cells.set_index(["gpus", "ckpt_TB"])["strategy"]
            same = (checked["strategy"] == named.reindex(checked.index)).sum()
            lines += [f"Winner map, Monte Carlo check ({int(winners['monte_carlo_trials'].max())} trials per strategy "
                      f"and cell): the same winner in {same} of {len(checked)} cells, its 95% interval clear of "
                      f"every other's in {int(checked['monte_carlo_separated'].sum())}"]
    lines += ["", f"Monte Carlo: {len(summary)} strategies x {trials:,} trials x {scn.duration_days:g} days "
                  f"({f.distribution} failures) in {mc_seconds:.2f} s",
              f"Outputs: {outputs}"]
    return "\n".join(line.rstrip() for line in lines)
