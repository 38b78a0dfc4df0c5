"""Monte Carlo simulation of a long training job with failures, checkpoints and recoveries (numpy-vectorised).

Model (the same as the closed form in :mod:`resilience.projection.goodput`, so the two can be checked against
each other, but with any inter-failure distribution and with bootstrapped costs):

- Failures form a renewal process independent of what the job is doing: F_k = F_{k-1} + X_k with X_k drawn from
  the failure model (exponential or Weibull with mean = job MTBF).
- Failure k starts a recovery of R_k seconds (kind drawn from the failure mix). A failure during a recovery
  abandons it and starts a new one, so training resumes at F_k + R_k only if F_{k+1} comes later.
- From a resume, the job computes ``interval`` seconds, stalls C, computes again...; checkpoint j (j = 1, 2, ...)
  is durable at tau + L + (j - 1) * P after the resume, P = max(tau + C, L) (a save waits for the previous one to
  be durable). Only durable checkpoints survive a failure, so an
  uninterrupted stretch of u seconds contributes tau * n(u) useful seconds, n(u) = checkpoints durable within u.

Because every recovery ends at F_k + R_k regardless of history, each stretch is u_k = min(F_{k+1}, H) - F_k - R_k
(clipped at 0) and the whole job needs no sequential loop: one array op per quantity over (trials, failures).
Costs are drawn per failure (recovery) and per uninterrupted stretch (stall and lag; their per-checkpoint spread
averages out over the many checkpoints of a stretch, what matters is the level at the failure).

A failure that costs only a share f < 1 of the work since the restart point (``costs.lost_work_factor``; Swift's
pipeline logging: one of S stages replays it while the others wait) keeps the job's place in its schedule: after
the recovery the job replays from the restart point of its newest durable checkpoint to where it was, in f of the
time, and goes on from there; a failure during the replay starts a recovery and the same replay again. Where the
job stands carries from one failure to the next, so that case loops over the failures (vectorised over the trials),
with stall and lag drawn once per trial. At f = 1 it gives what the stretches above give.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from resilience.projection.cost_model import CostsAtScale
from resilience.projection.failure_model import FailureModel, RecoveryKind

#: Keep each (trials x failures) array of a chunk at or under this many elements (~32 MB of float64).
CHUNK_ELEMENTS = 4_000_000


@dataclass(frozen=True)
class SimulationResult:
    """Per-trial goodput and failure counts, plus the wall-clock seconds the simulation took."""

    goodput: np.ndarray
    failures: np.ndarray
    seconds: float

    @property
    def mean(self) -> float:
        return float(self.goodput.mean())

    @property
    def ci95(self) -> float:
        """Half-width of a normal-approximation 95% confidence interval of the mean goodput."""
        n = self.goodput.size
        return float(1.96 * self.goodput.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")


def simulate(costs: CostsAtScale, failure: FailureModel, kinds: Sequence[RecoveryKind], *, gpus: int,
             interval_s: float, horizon_s: float, trials: int, seed: int | np.random.Generator = 0,
             bootstrap: bool = False) -> SimulationResult:
    """Simulate ``trials`` independent jobs of ``horizon_s`` wall seconds on ``gpus`` GPUs.

    ``kinds`` must be in the order of ``failure.kind_shares``. With ``bootstrap`` the costs are resampled from the
    residuals of the measured samples they were fitted from (constant where there are none). For a strategy that
    does not checkpoint (``costs.checkpoints`` False) ``interval_s`` is ignored: all time outside recoveries counts.
    """
    if not costs.checkpoints:
        interval_s = 1.0  # unused
    if interval_s <= 0 or horizon_s <= 0 or trials < 1:
        raise ValueError(f"interval_s={interval_s}, horizon_s={horizon_s}, trials={trials}: must all be > 0")
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    started = time.perf_counter()
    mtbf = failure.job_mtbf_s(gpus)
    expected = horizon_s / mtbf
    # Enough failure slots for almost every trial; the rare trial that needs more gets them in _failure_times.
    slots = int(expected + 6.0 * math.sqrt(expected) + 16)
    per_chunk = max(1, CHUNK_ELEMENTS // slots)
    goodputs, counts = [], []
    for first in range(0, trials, per_chunk):
        n = min(per_chunk, trials - first)
        g, c = _simulate_chunk(costs, failure, kinds, rng, n, slots, mtbf, interval_s, horizon_s, bootstrap)
        goodputs.append(g)
        counts.append(c)
    return SimulationResult(np.concatenate(goodputs), np.concatenate(counts), time.perf_counter() - started)


def _failure_times(failure: FailureModel, rng: np.random.Generator, trials: int, slots: int, mtbf: float,
                   horizon_s: float) -> np.ndarray:
    """Failure times (trials, k) with every row reaching past the horizon."""
    times = np.cumsum(failure.draw_interarrivals(rng, mtbf, (trials, slots)), axis=1)
    while times[:, -1].min() < horizon_s:  # rare: a trial with many more failures than expected
        more = np.cumsum(failure.draw_interarrivals(rng, mtbf, (trials, slots)), axis=1)
        times = np.hstack([times, times[:, -1:] + more])
    return times


def _simulate_chunk(costs: CostsAtScale, failure: FailureModel, kinds: Sequence[RecoveryKind],
                    rng: np.random.Generator, trials: int, slots: int, mtbf: float, tau: float, horizon: float,
                    bootstrap: bool) -> tuple[np.ndarray, np.ndarray]:
    fail_at = _failure_times(failure, rng, trials, slots, mtbf, horizon)
    shape = fail_at.shape
    kind_index = rng.choice(len(kinds), size=shape, p=np.asarray(failure.kind_shares))
    recovery = costs.draw_recovery(kinds, kind_index, rng, bootstrap)
    # Stretch k runs from the end of recovery k-1 (time 0 for the first) to failure k or the horizon.
    resume = np.empty(shape)
    resume[:, 0] = 0.0
    resume[:, 1:] = fail_at[:, :-1] + recovery[:, :-1]
    up = np.maximum(np.minimum(fail_at, horizon) - resume, 0.0)
    per_step = 1.0 - costs.step_overhead  # a per-step technique's cost, as in the closed form
    failures = (fail_at < horizon).sum(axis=1)
    if not costs.checkpoints:  # no work is ever lost: every stretch counts whole
        return per_step * up.sum(axis=1) / horizon, failures
    stall = costs.draw("stall", rng, shape, bootstrap)
    lag = np.maximum(costs.draw("durable", rng, shape, bootstrap), stall)
    first = tau + lag  # resume -> first durable checkpoint (nothing in flight to wait for)
    period = np.maximum(tau + stall, lag)  # durable -> next durable: a save waits for the previous one
    if costs.lost_work_factor < 1:
        reached = _replayed_progress(fail_at, recovery, first[:, 0], period[:, 0], costs.lost_work_factor, horizon)
        return per_step * tau * _durable(reached, first[:, 0], period[:, 0]) / horizon, failures
    return per_step * tau * _durable(up, first, period).sum(axis=1) / horizon, failures


def _durable(progress: np.ndarray, first: np.ndarray, period: np.ndarray) -> np.ndarray:
    """Checkpoints durable within ``progress`` seconds of the schedule (the first at ``first``, then every period)."""
    return np.where(progress >= first, 1.0 + np.floor((progress - first) / period), 0.0)


def _replayed_progress(fail_at: np.ndarray, recovery: np.ndarray, first: np.ndarray, period: np.ndarray,
                       factor: float, horizon: float) -> np.ndarray:
    """Where each trial's schedule stands at the horizon when a failure costs ``factor`` of the work since the
    restart point (module docstring). Checkpoint n's restart point is n * period into the schedule (checkpoint
    n + 1 is durable ``first`` after it, as after a resume), 0 before the first is durable."""
    reached = np.zeros(fail_at.shape[0])
    resume = np.zeros(fail_at.shape[0])
    for k in range(fail_at.shape[1]):
        since = reached - _durable(reached, first, period) * period  # the work a failure would cost, times factor
        up = np.minimum(fail_at[:, k], horizon) - resume - factor * since  # new work after the replay
        reached += np.maximum(up, 0.0)
        resume = fail_at[:, k] + recovery[:, k]
        if fail_at[:, k].min() >= horizon:
            break
    return reached
