"""The human-readable summary the CLI prints."""

from __future__ import annotations

import numpy as np
import pandas as pd

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


def format_summary(scn: Scenario, summary: pd.DataFrame, example_stalls_s: tuple[float, ...], mc_seconds: float,
                   trials: int, outputs: str, measured: str | None) -> str:
    """Summary of a projection run; ``summary`` is :func:`resilience.projection.sweeps.strategy_summary`'s table."""
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
                     f"  {g:>15.4f}")
    source = f"fitted from {measured}" if measured else "scenario defaults"
    lines += ["", f"Strategies at {scn.gpus:,} GPUs, checkpoint {scn.ckpt_bytes / TB:.2f} TB "
                  f"({_count(scn.params)} params x {scn.bytes_per_param:g} B); costs: {source}",
              f"  {'strategy':<12} {'stall':>8} {'durable':>9} {'recovery':>9} {'Daly':>9} {'optimum':>9} "
              f"{'goodput':>8}  {'Monte Carlo (95% CI)':<20}"]
    for row in summary.itertuples():
        if not row.feasible:
            lines.append(f"  {row.strategy:<12} infeasible: checkpoint shard exceeds the strategy's memory limit")
            continue
        mc = f"{row.goodput_monte_carlo:.4f} +/- {row.goodput_monte_carlo_ci95:.4f}" \
            if np.isfinite(row.goodput_monte_carlo) else "-"
        lines.append(f"  {row.strategy:<12} {_duration(row.stall_s):>8} {_duration(row.durable_s):>9} "
                     f"{_duration(row.mean_recovery_s):>9} {_duration(row.daly_interval_s):>9} "
                     f"{_duration(row.optimal_interval_s):>9} {row.goodput_closed_form:>8.4f}  {mc:<20}")
    if f.distribution != "exponential":
        lines.append(f"  (goodput: closed form for exponential failures with the same MTBF; Monte Carlo: "
                     f"{f.distribution}{shape})")
    lines += ["", f"Monte Carlo: {len(summary)} strategies x {trials:,} trials x {scn.duration_days:g} days "
                  f"({f.distribution} failures) in {mc_seconds:.2f} s",
              f"Outputs: {outputs}"]
    return "\n".join(line.rstrip() for line in lines)
