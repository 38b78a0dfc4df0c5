"""Intervals for the report's medians, their ratios to sync, and when a difference may be called one.

* **Median** of n runs: the exact distribution-free confidence interval from order statistics (Conover, *Practical
  Nonparametric Statistics*, 3rd ed., 1999, §3.2; Hahn & Meeker, *Statistical Intervals*, 1991, §5.2). For any
  continuous distribution the number of runs below the true median is Binomial(n, 1/2), so
  ``[x_(k), x_(n-k+1)]`` covers it with probability ``1 - 2 P(B <= k-1)``; ``k`` is the largest rank that keeps
  this at or above the level. No such ``k`` exists below ``MIN_N`` (= 6 runs at 95%: 1 - 2/2^5 = 93.75% < 95%):
  then there is no interval, and the report shows the range of the runs with "n too small for an interval".
* **Ratio** of two medians (a strategy over sync): the two medians' exact intervals at 97.5% each, combined
  conservatively, ``[low_a / high_b, high_a / low_b]``. Both cover with probability >= 95% (Bonferroni), and then
  the true ratio lies between those ends, so the ratio's interval has >= 95% coverage with no assumption about the
  distributions; it needs ``MIN_N_RATIO`` (= 7) runs on each side and a positive interval for the denominator.
* **A difference** is called one only when the two medians' 95% intervals are disjoint; overlapping intervals are
  "no measurable difference", and a side without an interval is "n too small for an interval". Disjoint 95%
  intervals are a conservative test (they imply a difference at a stricter level than 5%).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

LEVEL = 0.95
NO_INTERVAL = "n too small for an interval"
NO_DIFFERENCE = "no measurable difference"


def median_ranks(n: int, level: float = LEVEL) -> tuple[int, int] | None:
    """1-based ranks (k, n-k+1) of the exact order-statistic interval for the median, or None when n is too small."""
    if not 0 < level < 1:
        raise ValueError(f"level={level}: must be in (0, 1)")
    best, below = None, 0  # below: P(B <= k-1) * 2^n, B ~ Binomial(n, 1/2)
    for k in range(1, n // 2 + 1):
        below += math.comb(n, k - 1)
        if 1 - 2 * below / 2 ** n < level:
            break
        best = k
    return (best, n - best + 1) if best else None


def coverage(n: int, ranks: tuple[int, int]) -> float:
    """The exact coverage of ``[x_(k), x_(n-k+1)]`` for the median of n runs of any continuous distribution."""
    k = ranks[0]
    return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2 ** n


def _min_n(level: float) -> int:
    return next(n for n in range(1, 200) if median_ranks(n, level))


MIN_N = _min_n(LEVEL)                          # 6
MIN_N_RATIO = _min_n(1 - (1 - LEVEL) / 2)      # 7


@dataclass(frozen=True)
class Median:
    """The median of n runs with its 95% interval (``low``, ``high``), or, when ``exact`` is False (n < MIN_N), the
    runs' range in their place: then it is no interval and may not be used to call a difference."""

    median: float | None
    n: int
    low: float | None
    high: float | None
    exact: bool

    def text(self) -> str:
        """"n=7, 95% CI 0.08-0.11", "n=3, range 0.08-0.11 (n too small for an interval)", "n=1 (...)" or "n=0"."""
        return interval_text(self.n, self.low, self.high, self.exact)


def interval_text(n: int, low: float | None, high: float | None, exact: bool) -> str:
    """A median's n and interval as the report prints it under the figure (see :meth:`Median.text`)."""
    if not n or low is None or high is None:
        return f"n={n or 0}"
    if exact:
        return f"n={n}, 95% CI {low:.3g}-{high:.3g}"
    if n == 1:
        return f"n=1 ({NO_INTERVAL})"
    return f"n={n}, range {low:.3g}-{high:.3g} ({NO_INTERVAL})"


def ratio_text(ratio: float, low: float | None, high: float | None, verdict: str | None) -> str:
    """"x0.06 vs sync (95% CI 0.04-0.09)" where the medians differ; "x0.93 vs sync: no measurable difference"
    where their intervals overlap; the reason where there is no interval."""
    head = f"x{ratio:.2f} vs sync"
    if verdict == NO_DIFFERENCE:
        return f"{head}: {NO_DIFFERENCE}"
    differs = verdict in ("lower", "higher")
    if low is not None and high is not None:
        return f"{head} (95% CI {low:.2g}-{high:.2g})" + ("" if differs or not verdict else f" ({verdict})")
    if differs:
        return f"{head} ({verdict}; its ratio's interval needs n >= {MIN_N_RATIO} on both sides)"
    return f"{head} ({verdict or NO_INTERVAL})"


def median_interval(values: Iterable[float], level: float = LEVEL) -> Median:
    """The median of ``values`` (NaN dropped) and its exact order-statistic interval at ``level``."""
    xs = sorted(float(v) for v in values if v is not None and not math.isnan(float(v)))
    n = len(xs)
    if not n:
        return Median(None, 0, None, None, False)
    mid = n // 2
    median = xs[mid] if n % 2 else (xs[mid - 1] + xs[mid]) / 2
    ranks = median_ranks(n, level)
    if ranks is None:
        return Median(median, n, xs[0], xs[-1], False)
    return Median(median, n, xs[ranks[0] - 1], xs[ranks[1] - 1], True)


def ratio_interval(a: Iterable[float], b: Iterable[float], level: float = LEVEL) -> tuple[float, float] | None:
    """A >= ``level`` interval for median(a) / median(b) (Bonferroni over the two medians' exact intervals), or None
    when either side has too few runs or b's interval is not strictly positive (a ratio sign or infinity)."""
    per_side = 1 - (1 - level) / 2
    ia, ib = median_interval(a, per_side), median_interval(b, per_side)
    if not (ia.exact and ib.exact) or ib.low <= 0 or ia.low < 0:
        return None
    return ia.low / ib.high, ia.high / ib.low


def difference(a: Median, b: Median) -> str:
    """"lower" or "higher" (a against b) only when the two 95% intervals are disjoint; otherwise
    "no measurable difference", or "n too small for an interval" when either side has none."""
    if not (a.exact and b.exact):
        return NO_INTERVAL
    if a.high < b.low:
        return "lower"
    if a.low > b.high:
        return "higher"
    return NO_DIFFERENCE
