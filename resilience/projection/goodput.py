"""Closed-form expected goodput under exponential (Poisson) failures; the derivation is in docs/projection.md.

Goodput is the long-run fraction of wall time spent on work that is never lost. With failure rate lam = 1/M,
compute time tau between checkpoints, training-visible stall C, time from checkpoint start to durable L >= C, and
recovery kinds i with probabilities p_i and recovery times R_i (failures may also strike during a recovery)::

    G = lam * tau * A * exp(-lam * (tau + L)) / (1 - exp(-lam * P)),   A = sum_i p_i exp(-lam * R_i),
    P = max(tau + C, L)

P is the spacing of durable checkpoints: a save cannot start before the previous one is durable, so when
tau < L - C training waits L - C - tau extra per checkpoint. For a synchronous save (L = C) and a single recovery
time R this is Daly's (2006) model, G = tau / (M exp(R/M) (exp((tau + C)/M) - 1)).

A failure whose lost work costs only a share f of the time since the restart point (Swift's pipeline logging: one
of S stages replays it, f = 1/S) gives the same form with lam * f in every term but A (docs/projection.md)::

    G = lam f * tau * A * exp(-lam f * (tau + L)) / (1 - exp(-lam f * P))
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def recovery_survival(mtbf_s: float | np.ndarray, recovery_s: float | np.ndarray | Sequence[float],
                      shares: Sequence[float] | None = None) -> np.ndarray:
    """A = sum_i p_i exp(-R_i / M): the probability that a recovery completes before the next failure.

    Without ``shares``, ``recovery_s`` is one recovery time (broadcast against ``mtbf_s``); with ``shares``, it
    lists one time per kind and the result has the shape of ``mtbf_s``.
    """
    lam = 1.0 / np.asarray(mtbf_s, dtype=float)
    r = np.asarray(recovery_s, dtype=float)
    if shares is None:
        return np.exp(-lam * r)
    p = np.asarray(shares, dtype=float)
    if p.shape != r.shape or p.ndim != 1:
        raise ValueError(f"shares={p.shape}: must be 1-D and match recovery_s={r.shape}")
    return np.sum(p * np.exp(-np.expand_dims(lam, -1) * r), axis=-1)


def goodput(interval_s: float | np.ndarray, mtbf_s: float | np.ndarray, stall_s: float | np.ndarray,
            lag_s: float | np.ndarray, recovery_s: float | np.ndarray | Sequence[float],
            shares: Sequence[float] | None = None, lost_work_factor: float = 1.0) -> float | np.ndarray:
    """Expected goodput (0..1] for exponential failures; all arguments in seconds and broadcast together.

    ``recovery_s``/``shares`` as in :func:`recovery_survival`. ``lag_s`` below ``stall_s`` is read as ``stall_s``.
    ``lost_work_factor`` in (0, 1]: the share of the time since the restart point a failure costs (1: all of it).
    """
    if not 0 < lost_work_factor <= 1:
        raise ValueError(f"lost_work_factor={lost_work_factor}: must be in (0, 1]")
    tau = np.asarray(interval_s, dtype=float)
    m = np.asarray(mtbf_s, dtype=float)
    c = np.asarray(stall_s, dtype=float)
    lag = np.maximum(np.asarray(lag_s, dtype=float), c)
    period = np.maximum(tau + c, lag)  # the next save blocks until the previous one is durable
    a = recovery_survival(m, recovery_s, shares)  # recoveries are struck at the full rate, whatever is replayed
    lost = lost_work_factor / m  # lam * f: a failure costs the time since the restart point times f
    # -expm1(-x) = 1 - exp(-x) without cancellation when lam * P is tiny (huge MTBF).
    g = lost * tau * a * np.exp(-lost * (tau + lag)) / -np.expm1(-lost * period)
    return float(g) if np.ndim(g) == 0 else g


def predicted_goodput(interval_s: float | np.ndarray, mtbf_s: float | np.ndarray, stall_s: float | np.ndarray,
                      durable_s: float | np.ndarray, recovery_s: float | np.ndarray) -> float | np.ndarray:
    """Goodput the model predicts for a run with these measured costs: the entry point for a parity plot.

    Takes one row (or arrays of rows) of a measured run: the interval between checkpoints, the injected MTBF,
    mean checkpoint stall, mean time to durable, and mean recovery time (detection + restart + load), all in
    seconds. Returns the closed-form goodput to compare with the measured one.
    """
    return goodput(interval_s, mtbf_s, stall_s, durable_s, recovery_s)

