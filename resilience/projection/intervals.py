"""Checkpoint interval formulas (all times in seconds; arrays broadcast).

``interval`` is the compute time between the end of one checkpoint stall and the start of the next; ``stall`` is
the training-visible checkpoint cost C; ``mtbf`` is the job's mean time between failures M.
"""

from __future__ import annotations

import numpy as np


def young_interval(stall_s: float | np.ndarray, mtbf_s: float | np.ndarray) -> float | np.ndarray:
    """Young (1974), "A first order approximation to the optimum checkpoint interval": sqrt(2 C M), for C << M."""
    return _scalar(np.sqrt(2.0 * np.asarray(stall_s, float) * np.asarray(mtbf_s, float)))


def daly_interval(stall_s: float | np.ndarray, mtbf_s: float | np.ndarray) -> float | np.ndarray:
    """Daly (2006), "A higher order estimate of the optimum checkpoint interval for restart dumps",
    Future Generation Computer Systems 22(3).

    sqrt(2 C M) * [1 + (1/3) sqrt(C / 2M) + (1/9) (C / 2M)] - C   for C < 2M,   else M.
    """
    c = np.asarray(stall_s, float)
    m = np.asarray(mtbf_s, float)
    x = c / (2.0 * m)
    tau = np.sqrt(2.0 * c * m) * (1.0 + np.sqrt(x) / 3.0 + x / 9.0) - c
    return _scalar(np.where(c < 2.0 * m, tau, m))


def optimal_interval(stall_s: float | np.ndarray, mtbf_s: float | np.ndarray,
                     lag_s: float | np.ndarray | None = None) -> float | np.ndarray:
    """Exact maximiser of the closed-form goodput (:func:`resilience.projection.goodput.goodput`).

    With failure rate lam = 1/M and tau >= L - C the goodput is lam*tau*A*exp(-lam*(tau+L)) / (1 - exp(-lam*(tau+C)));
    setting the derivative of its log to zero gives ``lam*tau = 1 - exp(-lam*(tau + C))``, whose left minus right
    side grows strictly in tau, so bisection on (0, M] finds the unique root. Neither the recovery time nor the
    durability lag L enters the root: they scale goodput by constants. Below L - C a save waits for the previous
    one, the goodput is then proportional to tau*exp(-lam*tau), rising up to tau = M; so the optimum is
    max(root, min(L - C, M)).
    """
    c, m = np.broadcast_arrays(np.asarray(stall_s, float), np.asarray(mtbf_s, float))
    lam = 1.0 / m
    lo, hi = np.zeros_like(m), m.copy()  # g(0) = exp(-lam C) - 1 < 0 and g(M) = exp(-1 - lam C) > 0
    for _ in range(100):  # 100 halvings take the bracket far below float resolution
        mid = 0.5 * (lo + hi)
        g = lam * mid - 1.0 + np.exp(-lam * (mid + c))
        lo, hi = np.where(g < 0, mid, lo), np.where(g < 0, hi, mid)
    tau = 0.5 * (lo + hi)
    if lag_s is not None:
        tau = np.maximum(tau, np.minimum(np.asarray(lag_s, float) - c, m))
    return _scalar(tau)


def _scalar(x: np.ndarray) -> float | np.ndarray:
    x = np.asarray(x)
    return float(x) if x.ndim == 0 else x
