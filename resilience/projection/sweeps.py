"""Tables of the projection (pandas DataFrames, each with ``label = "projection"``): the closed form evaluated
over checkpoint intervals, cluster sizes and checkpoint sizes, and the per-strategy summary at the scenario.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from resilience.projection.calibration import FailureBand, shown
from resilience.projection.cost_model import CostsAtScale
from resilience.projection.goodput import goodput, recovery_survival
from resilience.projection.intervals import daly_interval, optimal_interval, young_interval
from resilience.projection.scenario import Scenario
from resilience.projection.simulator import SimulationResult, simulate

LABEL = "projection"
TB = 1e12


@dataclass(frozen=True)
class Point:
    """One strategy at one (GPU count, checkpoint size): its costs, recovery mix and best interval."""

    costs: CostsAtScale
    mtbf_s: float
    recovery_s: np.ndarray  # per recovery kind
    shares: np.ndarray
    interval_s: float  # exact optimum of the closed form; NaN for a strategy that does not checkpoint

    @property
    def goodput(self) -> float:
        if not self.costs.feasible:
            return float("nan")
        return self.goodput_at(self.interval_s)

    def goodput_at(self, interval_s: float | np.ndarray) -> float | np.ndarray:
        c = self.costs
        per_step = 1.0 - c.step_overhead  # what a per-step technique costs every step (a gradient shadow's copy)
        if not c.checkpoints:
            # Nothing is ever lost, so every second outside a recovery counts: G = A, the closed form's limit
            # for a zero interval at zero stall and lag (docs/projection.md); the interval does not matter.
            a = per_step * float(recovery_survival(self.mtbf_s, self.recovery_s, self.shares))
            return a if np.ndim(interval_s) == 0 else np.full(np.shape(interval_s), a)
        return per_step * goodput(interval_s, self.mtbf_s, c.stall_s, c.lag_s, self.recovery_s, self.shares,
                                  c.lost_work_factor)

    @property
    def lost_work_mtbf_s(self) -> float:
        """M / f: the MTBF the interval formulas see when a failure costs only f of the work since the checkpoint
        (the closed form is the usual one at that MTBF, times A at the true one; docs/projection.md)."""
        return self.mtbf_s / self.costs.lost_work_factor

    @property
    def mean_recovery_s(self) -> float:
        return float(np.dot(self.shares, self.recovery_s))


def evaluate(scn: Scenario, strategy: str, gpus: int | None = None, ckpt_bytes: float | None = None) -> Point:
    """The closed-form view of ``strategy`` at ``gpus`` GPUs (default: the scenario's) and ``ckpt_bytes``."""
    costs = scn.costs_at(strategy, gpus, ckpt_bytes)
    mtbf = scn.failure.job_mtbf_s(scn.gpus if gpus is None else gpus)
    lost_mtbf = mtbf / costs.lost_work_factor  # Point.lost_work_mtbf_s
    tau = optimal_interval(costs.stall_s, lost_mtbf, costs.lag_s) if costs.checkpoints else float("nan")
    return Point(costs, mtbf, costs.recovery_s(scn.kinds), np.asarray(scn.failure.kind_shares), tau)


def band_goodput(scn: Scenario, band: FailureBand | None, strategy: str, gpus: int | None = None,
                 ckpt_bytes: float | None = None) -> tuple[float, float]:
    """Goodput at the band's most and fewest failures (each at its own optimal interval); NaN without a band."""
    if band is None:
        return float("nan"), float("nan")
    low, high = (evaluate(scn.with_per_gpu_mttf(h), strategy, gpus, ckpt_bytes).goodput
                 for h in (band.low_h, band.high_h))
    return low, high


def strategy_summary(scn: Scenario, mc: dict[str, SimulationResult] | None = None,
                     band: FailureBand | None = None) -> pd.DataFrame:
    """Per strategy at the scenario's size: costs, Young/Daly/optimal interval, closed-form and Monte Carlo goodput,
    and the goodput at the failure band's edges (``goodput_shown``: rounded to what the band supports)."""
    rows = []
    for name in scn.strategies:
        p = evaluate(scn, name)
        low, high = band_goodput(scn, band, name)
        c = p.costs
        young, daly = young_interval(c.stall_s, p.lost_work_mtbf_s), daly_interval(c.stall_s, p.lost_work_mtbf_s)
        if not c.checkpoints:
            young = daly = float("nan")
        sim = (mc or {}).get(name)
        rows.append({
            "label": LABEL, "scenario": scn.name, "strategy": name, "gpus": scn.gpus, "ckpt_TB": scn.ckpt_bytes / TB,
            "job_mtbf_h": p.mtbf_s / 3600, "stall_s": c.stall_s, "durable_s": c.lag_s, "load_s": c.load_s,
            "restart_s": c.restart_s, "mean_recovery_s": p.mean_recovery_s, "feasible": c.feasible,
            "young_interval_s": young, "daly_interval_s": daly, "optimal_interval_s": p.interval_s,
            "goodput_young": p.goodput_at(young) if c.feasible else np.nan,
            "goodput_daly": p.goodput_at(daly) if c.feasible else np.nan,
            "goodput_closed_form": p.goodput,
            "goodput_band_low": low, "goodput_band_high": high, "goodput_shown": shown(p.goodput, low, high),
            "lost_work_factor": c.lost_work_factor, "step_overhead": c.step_overhead,
            "cost_note": scn.strategies[name].note,
            "goodput_monte_carlo": sim.mean if sim else np.nan,
            "goodput_monte_carlo_ci95": sim.ci95 if sim else np.nan,
            # the two models disagree by more than the simulation's own 95% error: a gap to read before a ranking
            "closed_minus_monte_carlo": p.goodput - sim.mean if sim else np.nan,
            "gap_flagged": bool(sim and abs(p.goodput - sim.mean) > sim.ci95),
            "monte_carlo_trials": sim.goodput.size if sim else 0,
            "failure_distribution": scn.failure.distribution,
        })
    return pd.DataFrame(rows)


def interval_sweep(scn: Scenario, points: int) -> pd.DataFrame:
    """Goodput vs checkpoint interval per strategy, on a log grid spanning every strategy's optimum x/÷ 20."""
    best = {name: evaluate(scn, name) for name in scn.strategies}
    optima = [p.interval_s for p in best.values() if p.costs.checkpoints] or [3600.0]
    grid = np.geomspace(max(min(optima) / 20.0, 1e-3), max(optima) * 20.0, points)
    frames = []
    for name, p in best.items():
        # The optimum itself is on the curve; a strategy without checkpoints is flat and has none.
        taus = np.sort(np.append(grid, p.interval_s)) if p.costs.checkpoints else grid
        g = p.goodput_at(taus) if p.costs.feasible else np.full(taus.shape, np.nan)
        frames.append(pd.DataFrame({"label": LABEL, "scenario": scn.name, "strategy": name, "gpus": scn.gpus,
                                    "interval_s": taus, "goodput": g, "is_optimum": taus == p.interval_s}))
    return pd.concat(frames, ignore_index=True)


def cluster_sweep(scn: Scenario, sizes: tuple[int, ...], band: FailureBand | None = None) -> pd.DataFrame:
    """Goodput vs GPU count, each strategy at its own optimal interval (checkpoint size fixed), with the band."""
    rows = []
    for gpus in sizes:
        for name in scn.strategies:
            p = evaluate(scn, name, gpus)
            low, high = band_goodput(scn, band, name, gpus)
            rows.append({"label": LABEL, "scenario": scn.name, "strategy": name, "gpus": gpus,
                         "job_mtbf_h": p.mtbf_s / 3600, "stall_s": p.costs.stall_s, "durable_s": p.costs.lag_s,
                         "mean_recovery_s": p.mean_recovery_s, "optimal_interval_s": p.interval_s,
                         "feasible": p.costs.feasible, "goodput": p.goodput, "goodput_band_low": low,
                         "goodput_band_high": high})
    return pd.DataFrame(rows)


def _winner(scn: Scenario, gpus: int, ckpt_bytes: float) -> tuple[list[tuple[str, Point]], np.ndarray, int]:
    cell = [(name, evaluate(scn, name, gpus, ckpt_bytes)) for name in scn.strategies]
    scores = np.asarray([p.goodput for _, p in cell])
    return cell, scores, int(np.nanargmax(scores)) if np.any(np.isfinite(scores)) else -1


def winner_grid(scn: Scenario, sizes: tuple[int, ...], ckpt_sizes_TB: tuple[float, ...],
                band: FailureBand | None = None, trials: int = 0, seed: int = 0) -> pd.DataFrame:
    """Best goodput per strategy over GPU count x checkpoint size; ``winner`` marks the best feasible one, and
    ``winners_in_band`` the winner at each rate of the failure band, from the most failures to the fewest.

    With ``trials``, each feasible strategy of each cell is also simulated (the Monte Carlo, which carries the
    variance of failures and recoveries that the closed form's expectation does not): ``winner_monte_carlo`` marks
    its winner, and ``monte_carlo_separated`` whether that winner's 95% interval clears every other's."""
    rates = band.rates_h(scn.failure.per_gpu_mttf_h) if band else np.array([])
    rows = []
    for gpus in sizes:
        for tb in ckpt_sizes_TB:
            cell, scores, win = _winner(scn, gpus, tb * TB)
            in_band = []
            for h in rates:
                c, _, w = _winner(scn.with_per_gpu_mttf(h), gpus, tb * TB)
                in_band.append(c[w][0] if w >= 0 else "none")
            names = list(dict.fromkeys(in_band))
            simulated = _simulated(scn, cell, gpus, trials, seed) if trials else None
            for i, (name, p) in enumerate(cell):
                row = {"label": LABEL, "scenario": scn.name, "gpus": gpus, "ckpt_TB": tb, "strategy": name,
                       "optimal_interval_s": p.interval_s, "feasible": p.costs.feasible,
                       "goodput": scores[i], "winner": i == win, "winners_in_band": " / ".join(names),
                       "winner_changes_in_band": len(names) > 1}
                if simulated is not None:
                    row.update(simulated[i])
                rows.append(row)
    return pd.DataFrame(rows)


def _simulated(scn: Scenario, cell: list[tuple[str, Point]], gpus: int, trials: int, seed: int) -> list[dict]:
    """The Monte Carlo's goodput of each strategy of a cell, its winner and whether the winner stands apart."""
    means, halves = np.full(len(cell), np.nan), np.full(len(cell), np.nan)
    for i, (_, p) in enumerate(cell):
        if p.costs.feasible:
            sim = simulate(p.costs, scn.failure, scn.kinds, gpus=gpus, interval_s=p.interval_s,
                           horizon_s=scn.horizon_s, trials=trials, seed=seed + i)
            means[i], halves[i] = sim.mean, sim.ci95
    win = int(np.nanargmax(means)) if np.any(np.isfinite(means)) else -1
    others = [j for j in range(len(cell)) if j != win and np.isfinite(means[j])]
    apart = win >= 0 and all(means[win] - halves[win] > means[j] + halves[j] for j in others)
    return [{"goodput_monte_carlo": means[i], "goodput_monte_carlo_ci95": halves[i],
             "winner_monte_carlo": i == win, "monte_carlo_separated": bool(apart), "monte_carlo_trials": trials}
            for i in range(len(cell))]


def failure_mix(scn: Scenario) -> pd.DataFrame:
    """The calibration table: each published root cause with its count, share and recovery kind."""
    t = scn.table
    return pd.DataFrame({"label": LABEL, "component": t.components, "category": t.categories, "count": t.counts,
                         "share": np.asarray(t.counts) / t.total, "recovery_kind": scn.row_kinds})
