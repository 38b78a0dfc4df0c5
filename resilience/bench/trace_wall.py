"""The predictions for a trace on the wall clock (``fault.clock=wall``, ``python -m resilience.bench.trace``):
failures arrive as a Poisson process over the run's wall time, recoveries included, which is what the projection's
closed form (``predicted_goodput``) models, so it is checked here on what it models.

The step clock's other predictions (the closed form for failures in steps, the schedule) need each failure's step,
which on the wall clock is known only as the run goes (every recovery before a failure moves its step); they are
not made for this clock.
"""

from __future__ import annotations

import math

import numpy as np

from injectors.trace import MIXES, draw_wall
from resilience.projection.goodput import predicted_goodput
from resilience.projection.run_model import RunCosts

NOMINAL, ARRIVALS = "closed form, failures in wall time", "closed form, the trace's arrivals"


def predict_wall(costs: RunCosts, lags: dict[str, list[float]], mtbf_s: float, seed: int,
                 mix: str = "llama3", how: str = "poisson", stalls: dict[str, list[float]] | None = None,
                 steps: list[float] | None = None) -> dict[str, dict[str, float]]:
    """Wall time to N steps, ETTR and steps lost by the closed form: at the given MTBF (``NOMINAL``: the
    projection's own use), and at the rate of the seeded arrivals that fall in the window it predicts (``ARRIVALS``:
    M = W / K, the count the run meets, known before it, drawn as ``how`` says, the trace runs' fault.arrivals; a
    Poisson count scatters by sqrt(K) around W / M, a stratified one far less). ``stalls``: each measured save's
    own stall beside its lag, per kind, and ``steps`` the steps' lengths after a stall (``lost_per_failure``)."""
    weights = MIXES[mix]
    nominal = {kind: w / sum(weights.values()) for kind, w in weights.items()}
    out = {NOMINAL: at_mtbf(costs, lags, nominal, mtbf_s, stalls, steps)}
    lo, hi = costs.steps * costs.step_wall_s, 100 * costs.steps * costs.step_wall_s
    for _ in range(60):  # the window W whose own arrivals, as an MTBF, give back W (bisection: K(W) is a staircase)
        mid = (lo + hi) / 2
        got = at_arrivals(costs, lags, draw_wall(mix, mtbf_s, seed, mid, how), mid, stalls, steps)
        lo, hi = (mid, hi) if got["wall_s"] > mid else (lo, mid)
    arrived = draw_wall(mix, mtbf_s, seed, hi, how)
    out[ARRIVALS] = {**at_arrivals(costs, lags, arrived, hi, stalls, steps), "failures": float(len(arrived))}
    return out


def at_arrivals(costs: RunCosts, lags: dict[str, list[float]], arrived: list[tuple[float, str]],
                window_s: float, stalls: dict[str, list[float]] | None = None,
                steps: list[float] | None = None) -> dict[str, float]:
    """The closed form at the MTBF and the mix of ``arrived``, the failures in a window of ``window_s``."""
    if not arrived:
        return at_mtbf(costs, lags, {kind: 0.0 for kind in lags}, math.inf, stalls, steps)
    share = {kind: sum(1 for _, k in arrived if k == kind) / len(arrived) for kind in lags}
    return at_mtbf(costs, lags, share, window_s / len(arrived), stalls, steps)


def at_mtbf(costs: RunCosts, lags: dict[str, list[float]], share: dict[str, float],
            mtbf_s: float, stalls: dict[str, list[float]] | None = None,
            steps: list[float] | None = None) -> dict[str, float]:
    """The training phase's goodput g at interval every x t_w, stall C, L (C + the median lag, by the mix) and R;
    wall = N x t_w / g, ETTR = g x t_d / t_w, and the steps lost by the K = wall / M failures of which a share
    A = exp(-R / M) strike training (the rest strike a recovery, which loses no step more)."""
    tw, every = costs.step_wall_s, costs.every
    lag_s = sum(w * max(float(np.median(lags[kind])), 0.0) for kind, w in share.items())
    if math.isinf(mtbf_s):
        g = every * tw / (every * tw + costs.stall_s)
    else:
        g = float(predicted_goodput(every * tw, mtbf_s, costs.stall_s, costs.stall_s + lag_s, costs.recovery_s))
    wall = costs.steps * tw / g
    training = 0.0 if math.isinf(mtbf_s) else wall / mtbf_s * math.exp(-costs.recovery_s / mtbf_s)
    lost = training * sum(w * lost_per_failure(costs, lags[kind], (stalls or {}).get(kind), steps)
                          for kind, w in share.items())
    return {"wall_s": wall, "ettr": g * costs.step_s / tw, "lost_steps": lost}


def lost_per_failure(costs: RunCosts, lags: list[float], stalls: list[float] | None = None,
                     steps: list[float] | None = None) -> float:
    """The steps a failure at a uniform point of a checkpoint's cycle (every steps of t_w, then the stall C) loses:
    d in a step d steps after the checkpoint; every in the stall until the save is recoverable (the save it
    interrupts is not), and every more while the previous checkpoint's lag runs after its stall (the mean measured
    lag, at most the interval's compute). ``stalls``: each save's own stall, beside its lag (default: each C);
    ``steps``: the every steps' own lengths after a stall (``step_lengths``; default: each t_w)."""
    tw, every, stall = costs.step_wall_s, costs.every, costs.stall_s
    lag = float(np.mean(np.clip(np.asarray(lags), 0.0, every * tw)))
    since = sum(d * length for d, length in enumerate(step_lengths(costs, steps)))
    return (since + every * (exposed_stall(costs, lags, stalls) + lag)) / (every * tw + stall)


def step_lengths(costs: RunCosts, steps: list[float] | None = None) -> list[float]:
    """The length of each of the every steps after a checkpoint, summing to every x t_w: measured (``steps``,
    scaled to that sum: only their shares count), or each t_w. A background persist slows the steps beside it:
    async's first step after a stall took 0.172 s and its fourth 0.087 s (gpt_tiny's fit runs, 2026-11-28), so a
    failure lands more often where fewer steps are lost than equal steps say."""
    if not steps:
        return [costs.step_wall_s] * costs.every
    scale = costs.every * costs.step_wall_s / sum(steps)
    return [length * scale for length in steps]


def exposed_stall(costs: RunCosts, lags: list[float], stalls: list[float] | None = None) -> float:
    """The part of a save's stall before the save is recoverable, on average: its whole stall, or for a save
    recoverable before its stall ends (a lag below 0: in-memory's snapshot is committed while every few saves also
    persist to disk, inside the stall) the stall before that point, never below 0. Paired save by save: in-memory's
    long stalls are the disk saves, recoverable from their first ~10 ms (gpt_tiny's fit runs, 2026-11-28: 0.011 s
    exposed a save, paired; 0.040 s from the mean stall and the mean lag)."""
    measured = np.asarray(lags, dtype=float)
    own = np.full_like(measured, costs.stall_s) if stalls is None else np.asarray(stalls, dtype=float)
    if own.size and own.mean() > 0:  # each save's share of the loop's C (a rank's own stall events differ by ms)
        own = own * costs.stall_s / own.mean()
    return float(np.mean(np.clip(own + np.minimum(measured, 0.0), 0.0, own))) if len(measured) else costs.stall_s


def lost_spread(costs: RunCosts, lags: dict[str, list[float]], share: dict[str, float],
                stalls: dict[str, list[float]] | None = None, steps: list[float] | None = None
                ) -> tuple[float, float]:
    """The mean and the standard deviation of one failure's lost steps under ``lost_per_failure``'s model, over the
    mix: d steps with probability t_w / cycle each, ``every`` in the exposed stall, ``every`` more in the lag after
    it (taken as falling in the cycle's first step). What chance alone spreads K failures' total over: its sd is
    sqrt(K) x this sd (for sync's gpt_tiny cycle ~0.62 of the mean a failure: ~11% of the total at K = 33)."""
    tw, every, stall = costs.step_wall_s, costs.every, costs.stall_s
    cycle = every * tw + stall
    mean = square = 0.0
    for kind, weight in share.items():
        own = (stalls or {}).get(kind)
        exposed = exposed_stall(costs, lags[kind], own)
        lag = float(np.mean(np.clip(np.asarray(lags[kind]), 0.0, every * tw)))
        mean += weight * lost_per_failure(costs, lags[kind], own, steps)
        square += weight * (sum(d * d * length for d, length in enumerate(step_lengths(costs, steps)))
                            + every ** 2 * (exposed + lag)) / cycle
    return mean, math.sqrt(max(square - mean * mean, 0.0))
