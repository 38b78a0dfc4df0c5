"""Intervals for the report's medians, their ratios to sync, and when a difference may be called one.

Every measured median carries its n and an interval with the interval's stated confidence level.

* **Median** of n runs: the exact distribution-free confidence interval from order statistics (Conover, *Practical
  Nonparametric Statistics*, 3rd ed., 1999, §3.2; Hahn & Meeker, *Statistical Intervals*, 1991, §5.2). For any
  continuous distribution the number of runs below the true median is Binomial(n, 1/2), so
  ``[x_(k), x_(n-k+1)]`` covers it with probability ``1 - 2 P(B <= k-1)``. From ``MIN_N`` (= 6) runs, ``k`` is
  the largest rank that keeps this at or above 95%: a **95% interval**. Below that no rank reaches 95%
  (n=5: 1 - 2/2^5 = 93.75%), and the interval shown is the runs' range ``[x_(1), x_(n)]`` **at its own exact level**
  ``1 - 2/2^n``: 50% at n=2, 75% at n=3, 87.5% at n=4, 93.75% at n=5 ("[0.08, 0.11] n=3 at 75%"). One run has
  no interval.
* **Ratio** of two medians (a strategy over sync): each median's exact interval, combined conservatively,
  ``[low_a / high_b, high_a / low_b]``. If the two cover with probabilities ``ca`` and ``cb``, both cover together
  with probability at least ``1 - (1 - ca) - (1 - cb)`` (Bonferroni), and then the true ratio lies between those
  ends, with no assumption about the distributions. The ranks on each side are chosen from n alone (never from
  the data): the narrowest pair whose combined level reaches 95%, stated as 95% (from 7 runs on each side, or
  fewer on one side against more on the other); where no pair does, the runs' ranges with their combined level
  stated (n=3 against n=3: 1 - 0.25 - 0.25 = 50%). A denominator interval that reaches 0 gives no interval.
* **A difference** is called one only when the two medians' 95% intervals are disjoint; overlapping 95% intervals
  are "no measurable difference", and a side without a 95% interval is "not compared: fewer than 6 runs" ("one
  run: no interval" for a single run): an interval at a lower level describes the spread of the runs but does
  not call a difference. Disjoint 95%
  intervals are a conservative test (they imply a difference at a stricter level than 5%).
* **A proportion** (a detector's coverage, k of n runs): the exact Clopper-Pearson 95% interval (Clopper &
  Pearson, Biometrika 26(4), 1934, 404-413), by bisection on the binomial distribution function.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

LEVEL = 0.95
NO_INTERVAL = "one run: no interval"
NO_95 = "not compared: fewer than 6 runs"  # the verdict where a side has only a lower-level interval
NO_DIFFERENCE = "no measurable difference"
VERDICTS = ("lower", "higher")
# The rule in words, under the report's headline tables.
INTERVAL_RULE = ("Each figure reads median [low, high] n: the median of n runs and its exact 95% interval (from "
                 "order statistics) from 6 runs; below that, [low, high] is the runs' range, at its own level, "
                 "written after it (\"n=3 at 75%\"; 50% at n=2, 87.5% at n=4, 93.75% at n=5). A ratio to sync "
                 "reads x ratio [low, high], its interval Bonferroni over the two medians' (95% unless a level is "
                 "written). A strategy is called lower or higher than sync only where the two medians' 95% "
                 "intervals do not overlap; otherwise \"" + NO_DIFFERENCE + "\", or \"" + NO_95 + "\" (Methods).")


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
MIN_N_RATIO = _min_n(1 - (1 - LEVEL) / 2)      # 7: 97.5% on each side


def interval_level(n: int, exact: bool) -> float | None:
    """The stated level of a median's interval: 95% where ``exact`` (n >= MIN_N), else the exact coverage of the
    runs' range, 1 - 2/2^n; None for fewer than 2 runs."""
    if exact:
        return LEVEL
    return coverage(n, (1, n)) if n >= 2 else None


def level_text(level: float) -> str:
    """"95%", "87.5%", "93.75%": the level in percent, rounded down to two decimals (never overstated)."""
    return f"{math.floor(level * 10000 + 1e-6) / 100:.2f}".rstrip("0").rstrip(".") + "%"


@dataclass(frozen=True)
class Median:
    """The median of n runs with its interval (``low``, ``high``) at ``level``: 95% where ``exact`` (n >= MIN_N),
    else the runs' range at its exact level (``interval_level``); only a 95% interval may call a difference."""

    median: float | None
    n: int
    low: float | None
    high: float | None
    exact: bool
    level: float | None = None

    def text(self) -> str:
        """"[0.08, 0.11] n=7", "[0.08, 0.11] n=3 at 75%", "n=1, one run: no interval" or "n=0"."""
        return interval_text(self.n, self.low, self.high, self.exact, self.level)


def interval_text(n: int, low: float | None, high: float | None, exact: bool, level: float | None = None) -> str:
    """A median's n and interval as the report prints it under the figure (see :meth:`Median.text`)."""
    if not n or low is None or high is None:
        return f"n={n or 0}"
    level = level if level is not None else interval_level(n, exact)
    if level is None:
        return f"n={n}, {NO_INTERVAL}"
    return f"[{low:.3g}, {high:.3g}] n={n}" + ("" if level >= LEVEL else f" at {level_text(level)}")


def ratio_text(ratio: float, low: float | None, high: float | None, verdict: str | None,
               level: float | None = None) -> str:
    """"x0.06 [0.04, 0.09] vs sync: lower"; "x0.93 [0.7, 1.2] vs sync: no measurable difference";
    "x0.46 [0.3, 0.7] at 73.43% vs sync: not compared: fewer than 6 runs"; without an interval, why."""
    head = f"x{ratio:.2f} vs sync"
    if low is not None and high is not None:
        at = "" if level is None or level >= LEVEL else f" at {level_text(level)}"
        head = f"x{ratio:.2f} [{low:.2g}, {high:.2g}]{at} vs sync"
    elif verdict in (*VERDICTS, NO_DIFFERENCE):
        head += " (no interval for the ratio: sync's interval reaches 0)"
    elif not verdict:
        return f"{head} ({NO_INTERVAL})"
    return f"{head}: {verdict}" if verdict else head


def median_interval(values: Iterable[float], level: float = LEVEL) -> Median:
    """The median of ``values`` (NaN dropped) and its exact order-statistic interval at ``level``, or, where n is
    too small for that level, the runs' range at its own level."""
    xs = sorted(float(v) for v in values if v is not None and not math.isnan(float(v)))
    n = len(xs)
    if not n:
        return Median(None, 0, None, None, False)
    mid = n // 2
    median = xs[mid] if n % 2 else (xs[mid - 1] + xs[mid]) / 2
    ranks = median_ranks(n, level)
    if ranks is None:
        return Median(median, n, xs[0], xs[-1], False, interval_level(n, False))
    return Median(median, n, xs[ranks[0] - 1], xs[ranks[1] - 1], level >= LEVEL, level)


@dataclass(frozen=True)
class Ratio:
    """An interval for median(a) / median(b) and its stated level (``level``: at least that coverage)."""

    low: float
    high: float
    level: float


def ratio_ranks(na: int, nb: int, level: float = LEVEL) -> tuple[int, int, float] | None:
    """(k_a, k_b, combined level): the order-statistic ranks on each side (from n alone) for a ratio interval, the
    narrowest pair whose Bonferroni level ``1 - (1 - ca) - (1 - cb)`` reaches ``level``, else the runs' ranges
    (k = 1) with their combined level; None where that level is not above 0 (or a side has < 2 runs)."""
    if na < 2 or nb < 2:
        return None
    best = None
    for ka in range(1, na // 2 + 1):
        ca = coverage(na, (ka, na - ka + 1))
        for kb in range(1, nb // 2 + 1):
            joint = ca + coverage(nb, (kb, nb - kb + 1)) - 1
            if joint >= level and (best is None or (ka + kb, joint) > (best[0] + best[1], best[2])):
                best = (ka, kb, joint)
    if best is None:
        joint = coverage(na, (1, na)) + coverage(nb, (1, nb)) - 1
        best = (1, 1, joint) if joint > 0 else None
    return best


def ratio_estimate(a: Iterable[float], b: Iterable[float], level: float = LEVEL) -> Ratio | None:
    """An interval for median(a) / median(b) with its stated level (``level`` where the combined level reaches it,
    else the combined level itself, rounded down by ``level_text``), or None: a side with fewer than 2 runs, or b's
    interval not strictly positive (a ratio sign or infinity)."""
    xa = sorted(float(v) for v in a if v is not None and not math.isnan(float(v)))
    xb = sorted(float(v) for v in b if v is not None and not math.isnan(float(v)))
    ranks = ratio_ranks(len(xa), len(xb), level)
    if ranks is None:
        return None
    ka, kb, joint = ranks
    a_low, a_high, b_low, b_high = xa[ka - 1], xa[len(xa) - ka], xb[kb - 1], xb[len(xb) - kb]
    if b_low <= 0 or a_low < 0:
        return None
    return Ratio(a_low / b_high, a_high / b_low, min(level, joint))


def ratio_interval(a: Iterable[float], b: Iterable[float], level: float = LEVEL) -> tuple[float, float] | None:
    """A >= ``level`` interval for median(a) / median(b) (:func:`ratio_estimate`), or None where the runs give
    none at that level."""
    est = ratio_estimate(a, b, level)
    return (est.low, est.high) if est and est.level >= level else None


def difference(a: Median, b: Median) -> str:
    """"lower" or "higher" (a against b) only when the two 95% intervals are disjoint; otherwise
    "no measurable difference", or, when either side has no 95% interval, "not compared: fewer than 6 runs" ("one
    run: no interval" where a side has a single run)."""
    if min(a.n, b.n) < 2:
        return NO_INTERVAL
    if not (a.exact and b.exact):
        return NO_95
    if a.high < b.low:
        return "lower"
    if a.low > b.high:
        return "higher"
    return NO_DIFFERENCE


def proportion_interval(k: int, n: int, level: float = LEVEL) -> tuple[float, float] | None:
    """The exact Clopper-Pearson interval for a proportion of k successes in n trials; None for n = 0."""
    if n <= 0:
        return None
    tail = (1 - level) / 2

    def cdf(p: float, upto: int) -> float:  # P(X <= upto), X ~ Binomial(n, p)
        return sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(upto + 1))

    def solve(f) -> float:  # the p in [0, 1] where the decreasing f(p) crosses 0
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if f(mid) > 0 else (lo, mid)
        return (lo + hi) / 2

    low = 0.0 if k == 0 else solve(lambda p: tail - (1 - cdf(p, k - 1)))  # P(X >= k) = tail
    high = 1.0 if k == n else solve(lambda p: cdf(p, k) - tail)  # P(X <= k) = tail
    return low, high


PERMUTATIONS = 20000  # drawn (seeded) where the exact enumeration of a rank test's groupings would be larger


def rank_test(a: Iterable[float], b: Iterable[float]) -> float | None:
    """The two-sided p-value of the Mann-Whitney rank-sum test (Mann & Whitney, Ann. Math. Statist. 18(1), 1947),
    by permutation: the share of the groupings of the pooled runs into two sets of the same sizes whose U statistic
    is at least as far from its mean as the one seen (midranks for ties). Every grouping is enumerated where there
    are at most ``PERMUTATIONS`` (6 against 6: 924), else that many are drawn with a fixed seed. None where a side
    has no run. Distribution-free and exact for small n, where a normal approximation is not."""
    xa = [float(v) for v in a if v is not None and not math.isnan(float(v))]
    xb = [float(v) for v in b if v is not None and not math.isnan(float(v))]
    na, nb = len(xa), len(xb)
    if not na or not nb:
        return None
    pooled = xa + xb
    order = sorted(range(na + nb), key=lambda i: pooled[i])
    ranks = [0.0] * (na + nb)
    i = 0
    while i < len(order):  # midranks over runs of equal values
        j = i
        while j + 1 < len(order) and pooled[order[j + 1]] == pooled[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    mean = na * (na + nb + 1) / 2  # the rank sum of a's runs under no difference

    def far(members: Iterable[int]) -> float:
        return abs(sum(ranks[m] for m in members) - mean)

    seen = far(range(na)) - 1e-9
    if math.comb(na + nb, na) <= PERMUTATIONS:
        import itertools
        groupings = list(itertools.combinations(range(na + nb), na))
    else:
        import random
        draw = random.Random(0)
        groupings = [draw.sample(range(na + nb), na) for _ in range(PERMUTATIONS)]
    return sum(far(g) >= seen for g in groupings) / len(groupings)


def runs_needed(a: Median, b: Median, cap: int = 100) -> int | None:
    """About how many runs per side would make the two medians' 95% intervals disjoint at the spread these runs
    show (an interval's width shrinks as 1/sqrt(n)): at least ``MIN_N``; None where that is over ``cap`` (the
    medians are too close for any practical number of runs) or a side has no interval."""
    if None in (a.median, b.median, a.low, a.high, b.low, b.high):
        return None
    gap = abs(a.median - b.median)
    spread = (a.high - a.low) / 2 * math.sqrt(a.n) + (b.high - b.low) / 2 * math.sqrt(b.n)
    if gap <= 0:
        return None
    n = max(MIN_N, math.ceil((spread / gap) ** 2))
    return n if n <= cap else None
