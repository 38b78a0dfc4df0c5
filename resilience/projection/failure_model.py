"""Failure model: how often a job at a given size is interrupted, and what kind of recovery each interruption needs.

Calibration source: Llama team, "The Llama 3 Herd of Models", arXiv:2407.21783, sec. 3.3.4, Table 5 -- 419
unexpected interruptions in a 54-day snapshot of Llama 3 405B pre-training on 16,384 H100 GPUs (see
``conf/scenario/data/llama3_405b_interruptions.csv``). That gives a job MTBF of 54 * 24 h / 419 = 3.09 h and a
per-GPU MTTF of 3.09 h * 16,384 = about 50,700 GPU-hours.

Interruptions of a job on N GPUs are modelled as a renewal process with mean (per-GPU MTTF) / N: the job stops when
any of its GPUs (or the node, switch or software around it) fails, so failure rates add up linearly in N.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np

from resilience.projection.validation import ConfigError, as_choice, as_float, fail, read_csv_rows

#: Recovery kinds, in the order used for arrays of per-kind values.
#: restart: the job is relaunched on the same nodes and loads the last durable checkpoint.
#: node_replacement: a node is swapped for a spare first (repair time), then as ``restart``.
#: hang: nothing crashes; the job stalls until a watchdog (e.g. the NCCL timeout) fires, then as ``restart``.
#: rollback: silent data corruption runs undetected for a while; the work since then (and the checkpoints taken
#: during it) is discarded, then as ``restart``.
RECOVERY_KINDS: tuple[str, ...] = ("restart", "node_replacement", "hang", "rollback")

DISTRIBUTIONS: tuple[str, ...] = ("exponential", "weibull")

SECONDS_PER_HOUR = 3600.0


@dataclass(frozen=True)
class FailureTable:
    """Interruption counts by root cause, as published (one row per component)."""

    components: tuple[str, ...]
    categories: tuple[str, ...]
    counts: tuple[int, ...]

    @property
    def total(self) -> int:
        return int(sum(self.counts))

    @classmethod
    def from_csv(cls, path: str | Path, field: str) -> "FailureTable":
        """Read a CSV with columns ``component``, ``category``, ``count``; ``field`` names the config entry."""
        path = Path(path)
        rows = read_csv_rows(path, field)
        for column in ("component", "category", "count"):
            if column not in rows[0]:
                fail(field, path, f"must have a column '{column}' (columns: component, category, count)")
        counts = []
        for i, row in enumerate(rows):
            try:
                count = int(row["count"])
            except (TypeError, ValueError):
                count = -1
            if count < 0:
                fail(f"{field}[row {i + 1}].count", row["count"], "must be an integer >= 0")
            counts.append(count)
        if sum(counts) <= 0:
            fail(field, path, "counts must sum to more than 0")
        return cls(tuple(r["component"] for r in rows), tuple(r["category"] for r in rows), tuple(counts))

    def row_kinds(self, by_component: Mapping[str, str], by_category: Mapping[str, str],
                  field: str) -> tuple[str, ...]:
        """The recovery kind of each row; a component rule wins over its category rule.

        Every row must be covered by one of the two mappings, so that a new root cause in the data cannot be
        silently dropped from the failure mix.
        """
        kinds = []
        for component, category in zip(self.components, self.categories):
            if component in by_component:
                kind, source = by_component[component], f"{field}.kind_by_component.{component}"
            elif category in by_category:
                kind, source = by_category[category], f"{field}.kind_by_category.{category}"
            else:
                raise ConfigError(f"{field}: no recovery kind for component '{component}' (category '{category}'); "
                                  f"add it to kind_by_component or kind_by_category")
            kinds.append(as_choice(kind, source, RECOVERY_KINDS))
        return tuple(kinds)

    def kind_counts(self, row_kinds: tuple[str, ...]) -> dict[str, int]:
        """Interruptions per recovery kind (every kind present, zero if unused)."""
        counts = {kind: 0 for kind in RECOVERY_KINDS}
        for kind, count in zip(row_kinds, self.counts):
            counts[kind] += count
        return counts


def per_gpu_mttf_hours(interruptions: int, gpus: int, days: float) -> float:
    """Per-GPU MTTF in GPU-hours: GPU-hours observed per interruption (Llama 3: 16,384 * 54 * 24 / 419 = 50,700)."""
    if interruptions <= 0:
        raise ConfigError(f"interruptions={interruptions}: must be an integer >= 1")
    return gpus * days * 24.0 / interruptions


@dataclass(frozen=True)
class RecoveryKind:
    """Time a recovery kind adds before the restart proper: detecting the failure and repairing the hardware."""

    name: str
    detection_s: float  # failure -> someone (runtime, watchdog, loss monitor) notices
    repair_s: float  # notice -> replacement hardware is ready (0 when the same nodes are reused)


@dataclass(frozen=True)
class FailureModel:
    """Interruption process of a job: per-GPU MTTF, inter-failure distribution, and the mix of recovery kinds.

    ``kind_shares`` holds the probability of each kind in :data:`RECOVERY_KINDS` order and sums to 1.
    With ``distribution="weibull"`` the job-level inter-failure times are Weibull with ``weibull_shape`` and the
    same mean as the exponential case; shape < 1 means failures come in bursts, shape > 1 more regularly.
    """

    per_gpu_mttf_h: float
    kind_shares: tuple[float, ...]
    distribution: str = "exponential"
    weibull_shape: float = 1.0

    def __post_init__(self) -> None:
        as_float(self.per_gpu_mttf_h, "failures.per_gpu_mttf_h", gt=0)
        as_choice(self.distribution, "failures.distribution", DISTRIBUTIONS)
        as_float(self.weibull_shape, "failures.weibull_shape", gt=0)
        if len(self.kind_shares) != len(RECOVERY_KINDS) or abs(sum(self.kind_shares) - 1.0) > 1e-9 or \
                min(self.kind_shares) < 0:
            fail("failures.kind_shares", self.kind_shares,
                 f"must be {len(RECOVERY_KINDS)} non-negative shares summing to 1")

    def job_mtbf_s(self, gpus: int | np.ndarray) -> float | np.ndarray:
        """Mean time between interruptions of a job on ``gpus`` GPUs, in seconds (= per-GPU MTTF / gpus)."""
        mtbf = self.per_gpu_mttf_h * SECONDS_PER_HOUR / np.asarray(gpus, dtype=float)
        return float(mtbf) if mtbf.ndim == 0 else mtbf

    def draw_interarrivals(self, rng: np.random.Generator, mean_s: float, size: tuple[int, ...]) -> np.ndarray:
        """Inter-failure times (seconds) with mean ``mean_s``."""
        if self.distribution == "exponential":
            return rng.exponential(mean_s, size)
        # Weibull with shape k has mean scale * Gamma(1 + 1/k); pick the scale that keeps the mean at mean_s.
        scale = mean_s / math.gamma(1.0 + 1.0 / self.weibull_shape)
        return scale * rng.weibull(self.weibull_shape, size)

    @classmethod
    def from_counts(cls, per_gpu_mttf_h: float, kind_counts: Mapping[str, int], distribution: str = "exponential",
                    weibull_shape: float = 1.0) -> "FailureModel":
        total = sum(kind_counts.values())
        if total <= 0:
            fail("failures.kind_counts", dict(kind_counts), "must sum to more than 0")
        shares = tuple(kind_counts.get(kind, 0) / total for kind in RECOVERY_KINDS)
        return cls(per_gpu_mttf_h, shares, distribution, weibull_shape)
