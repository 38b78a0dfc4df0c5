"""The predictions for a trace on the wall clock (``fault.clock=wall``, ``python -m resilience.bench.trace``):
failures arrive as a Poisson process over the run's wall time, recoveries included, which is what the projection's
closed form (``predicted_goodput``) models, so it is checked here on what it models.

The step clock's other predictions (the closed form for failures in steps, the schedule) need each failure's step,
which on the wall clock is known only as the run goes (every recovery before a failure moves its step); they are
not made for this clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from injectors.trace import MIXES, draw_wall
from resilience.projection.goodput import predicted_goodput
from resilience.projection.run_model import RunCosts

NOMINAL, ARRIVALS = "closed form, failures in wall time", "closed form, the trace's arrivals"


@dataclass(frozen=True)
class Cycle:
    """A checkpoint's cycle as the predictions model it: every steps of t_w, then the stall C (``costs``); per
    failure kind, each measured save's lag from its stall's end until it is recoverable (``lags``) and its own stall
    beside it (``stalls``; a kind without any: each save's stall taken as C); and the every steps' own lengths after
    a stall (``steps``, from the fit runs; None: each t_w)."""

    costs: RunCosts
    lags: dict[str, list[float]]
    stalls: dict[str, list[float]] = field(default_factory=dict)
    steps: list[float] | None = None

    def lengths(self) -> list[float]:
        """The length of each of the every steps after a checkpoint, summing to every x t_w: measured (``steps``,
        scaled to that sum: only their shares count), or each t_w. A background persist slows the steps beside it:
        async's first step after a stall took 0.172 s and its fourth 0.087 s (gpt_tiny's fit runs, 2026-11-28), so a
        failure lands more often where fewer steps are lost than equal steps say."""
        costs = self.costs
        if not self.steps:
            return [costs.step_wall_s] * costs.every
        scale = costs.every * costs.step_wall_s / sum(self.steps)
        return [length * scale for length in self.steps]

    def exposed(self, kind: str) -> float:
        """The part of a save's stall before the save is recoverable after a failure of ``kind``, on average: its
        whole stall, or for a save recoverable before its stall ends (a lag below 0: in-memory's snapshot is
        committed while every few saves also persist to disk, inside the stall) the stall before that point, never
        below 0. Paired save by save: in-memory's long stalls are the disk saves, recoverable from their first
        ~10 ms (gpt_tiny's fit runs, 2026-11-28: 0.011 s exposed a save, paired; 0.040 s from the mean stall and the
        mean lag)."""
        stall, stalls = self.costs.stall_s, self.stalls.get(kind)
        measured = np.asarray(self.lags[kind], dtype=float)
        # the one place for the docstring's rule: a kind whose fit runs measured no stall (absent, or an empty list)
        own = np.full_like(measured, stall) if stalls is None or not len(stalls) else np.asarray(stalls, dtype=float)
        if own.size and own.mean() > 0:  # each save's share of the loop's C (a rank's own stall events differ by ms)
            own = own * stall / own.mean()
        return float(np.mean(np.clip(own + np.minimum(measured, 0.0), 0.0, own))) if len(measured) else stall

    def lag(self, kind: str) -> float:
        """The mean measured lag of ``kind`` after a stall, at most the interval's compute (every x t_w): how long
        after its stall a failure still loses the previous interval too. Not below 0: a save recoverable inside its
        stall is counted in ``exposed``."""
        tw, every = self.costs.step_wall_s, self.costs.every
        return float(np.mean(np.clip(np.asarray(self.lags[kind]), 0.0, every * tw)))

    def median_lag(self, kind: str) -> float:
        """The median measured lag of ``kind``, not below 0: C plus it, weighed by the mix, is the closed form's L
        (a checkpoint's start until it is recoverable)."""
        return max(float(np.median(self.lags[kind])), 0.0)

    def lost(self, kind: str) -> float:
        """The steps a failure of ``kind`` at a uniform point of the cycle (every steps of t_w, then the stall C)
        loses: d in a step d steps after the checkpoint (each step weighed by its own length: ``lengths``); every in
        the stall until the save is recoverable (the save it interrupts is not: ``exposed``), and every more while
        the previous checkpoint's lag runs after its stall (``lag``: the mean measured lag, at most the interval's
        compute)."""
        tw, every, stall = self.costs.step_wall_s, self.costs.every, self.costs.stall_s
        since = sum(d * length for d, length in enumerate(self.lengths()))
        return (since + every * (self.exposed(kind) + self.lag(kind))) / (every * tw + stall)

    def spread(self, share: dict[str, float]) -> tuple[float, float]:
        """The mean and the standard deviation of one failure's lost steps under ``lost``'s model, over the mix
        ``share`` (kind -> share): d steps with probability t_w / cycle each, ``every`` in the exposed stall,
        ``every`` more in the lag after it (taken as falling in the cycle's first step). What chance alone spreads K
        failures' total over: its sd is sqrt(K) x this sd (for sync's gpt_tiny cycle ~0.62 of the mean a failure:
        ~11% of the total at K = 33)."""
        tw, every, stall = self.costs.step_wall_s, self.costs.every, self.costs.stall_s
        cycle = every * tw + stall
        mean = square = 0.0
        for kind, weight in share.items():
            mean += weight * self.lost(kind)
            square += weight * (sum(d * d * length for d, length in enumerate(self.lengths()))
                                + every ** 2 * (self.exposed(kind) + self.lag(kind))) / cycle
        return mean, math.sqrt(max(square - mean * mean, 0.0))


def predict_wall(cycle: Cycle, mtbf_s: float, seed: int, mix: str = "llama3",
                 how: str = "poisson") -> dict[str, dict[str, float]]:
    """Wall time to N steps, ETTR and steps lost by the closed form over ``cycle`` (its lost steps: ``Cycle.lost``):
    at the given MTBF (``NOMINAL``: the projection's own use), and at the rate of the seeded arrivals that fall in
    the window it predicts (``ARRIVALS``: M = W / K, the count the run meets, known before it, drawn as ``how``
    says, the trace runs' fault.arrivals; a Poisson count scatters by sqrt(K) around W / M, a stratified one far
    less)."""
    costs, weights = cycle.costs, MIXES[mix]
    nominal = {kind: w / sum(weights.values()) for kind, w in weights.items()}
    out = {NOMINAL: at_mtbf(cycle, nominal, mtbf_s)}
    lo, hi = costs.steps * costs.step_wall_s, 100 * costs.steps * costs.step_wall_s
    for _ in range(60):  # the window W whose own arrivals, as an MTBF, give back W (bisection: K(W) is a staircase)
        mid = (lo + hi) / 2
        got = at_arrivals(cycle, draw_wall(mix, mtbf_s, seed, mid, how), mid)
        lo, hi = (mid, hi) if got["wall_s"] > mid else (lo, mid)
    arrived = draw_wall(mix, mtbf_s, seed, hi, how)
    out[ARRIVALS] = {**at_arrivals(cycle, arrived, hi), "failures": float(len(arrived))}
    return out


def at_arrivals(cycle: Cycle, arrived: list[tuple[float, str]], window_s: float) -> dict[str, float]:
    """The closed form at the MTBF and the mix of ``arrived``, the failures in a window of ``window_s``."""
    if not arrived:
        return at_mtbf(cycle, {kind: 0.0 for kind in cycle.lags}, math.inf)
    share = {kind: sum(1 for _, k in arrived if k == kind) / len(arrived) for kind in cycle.lags}
    return at_mtbf(cycle, share, window_s / len(arrived))


def at_mtbf(cycle: Cycle, share: dict[str, float], mtbf_s: float) -> dict[str, float]:
    """The training phase's goodput g at interval every x t_w, stall C, L (C + the median lag, by the mix) and R;
    wall = N x t_w / g, ETTR = g x t_d / t_w, and the steps lost by the K = wall / M failures of which a share
    A = exp(-R / M) strike training (the rest strike a recovery, which loses no step more)."""
    costs = cycle.costs
    tw, every = costs.step_wall_s, costs.every
    lag_s = sum(w * cycle.median_lag(kind) for kind, w in share.items())
    if math.isinf(mtbf_s):
        g = every * tw / (every * tw + costs.stall_s)
    else:
        g = float(predicted_goodput(every * tw, mtbf_s, costs.stall_s, costs.stall_s + lag_s, costs.recovery_s))
    wall = costs.steps * tw / g
    training = 0.0 if math.isinf(mtbf_s) else wall / mtbf_s * math.exp(-costs.recovery_s / mtbf_s)
    lost = training * sum(w * cycle.lost(kind) for kind, w in share.items())
    return {"wall_s": wall, "ettr": g * costs.step_s / tw, "lost_steps": lost}
