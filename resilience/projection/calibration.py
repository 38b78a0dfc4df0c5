"""The failure band: the per-GPU failure rate each published figure implies, and the range they span.

The failure model has one parameter that matters most, the per-GPU MTTF (job MTBF = per-GPU MTTF / GPUs). The
scenarios calibrate it on one source each, and independent sources disagree by up to 6x per GPU
(``conf/scenario/data/published_failure_figures.csv``). Rather than pick one, the projection draws the range they
span as a band: every goodput is also computed at the band's two edges, printed with the precision the band leaves
(:func:`shown`), and the winner maps mark where the winner changes inside it.

Each figure is inverted through the model itself (:meth:`PublishedFigure.implied_mttf_h`), so the model at that
rate reproduces the figure exactly (:meth:`PublishedFigure.model_value`; a test checks the round trip) and the
calibration table shows what the model at the scenario's rate says of every other figure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from resilience.projection.goodput import recovery_survival
from resilience.projection.validation import (ConfigError, as_choice, as_float, as_int, as_name, fail,
                                              read_csv_rows)

QUANTITIES = ("interruptions", "job_mttf_h", "job_mttf_min", "ettr")
UNITS = {"interruptions": "interruptions", "job_mttf_h": "h", "job_mttf_min": "min", "ettr": "ETTR"}
HOUR = 3600.0


@dataclass(frozen=True)
class PublishedFigure:
    """One published number about a job's failures, as printed (``quantity`` in :data:`QUANTITIES`)."""

    name: str
    gpus: int
    quantity: str
    value: float
    source: str
    note: str = ""
    days: float | None = None          # interruptions: the observation window
    recovery_min: float | None = None  # ettr: the whole job's stall per failure
    # figures that come from one measurement (one rate projected to two sizes, one cluster's two settings) share a
    # source: the band counts each source once
    source_id: str = ""
    # "lower": the figure only says the per-GPU MTTF is at least what it implies (an ETTR that blames every lost
    # second on failures: other losses would mean fewer failures); "" a point estimate
    bound: str = ""

    def model_value(self, per_gpu_mttf_h: float) -> float:
        """What the failure model says of this figure when the per-GPU MTTF is ``per_gpu_mttf_h``."""
        job_h = per_gpu_mttf_h / self.gpus
        if self.quantity == "interruptions":
            return self.days * 24.0 / job_h
        if self.quantity == "job_mttf_h":
            return job_h
        if self.quantity == "job_mttf_min":
            return job_h * 60.0
        # Every failure costs the job recovery_min and loses nothing else; failures also strike recoveries: the
        # closed form's goodput for a strategy without checkpoints (G = A = exp(-R/M)).
        return float(recovery_survival(job_h * HOUR, self.recovery_min * 60.0))

    def implied_mttf_h(self) -> float:
        """The per-GPU MTTF (GPU-hours) at which :meth:`model_value` reproduces the published value."""
        if self.quantity == "interruptions":
            return self.gpus * self.days * 24.0 / self.value
        if self.quantity == "job_mttf_h":
            return self.value * self.gpus
        if self.quantity == "job_mttf_min":
            return self.value / 60.0 * self.gpus
        return self.recovery_min / 60.0 / -math.log(self.value) * self.gpus

    @property
    def published(self) -> str:
        """The value as the source states it, with its unit."""
        if self.quantity == "interruptions":
            return f"{self.value:g} in {self.days:g} days"
        if self.quantity == "ettr":
            return f"ETTR {self.value:.0%} at {self.recovery_min:g} min per recovery"
        return f"MTTF {self.value:g} {UNITS[self.quantity]}"


BOUNDS = ("", "lower")  # a point estimate of the per-GPU MTTF, or a lower bound on it


def read_figures(path: str | Path, field: str) -> list[PublishedFigure]:
    """The figures of a CSV (``#`` lines are comments); every value is checked, naming its row and column."""
    rows = read_csv_rows(path, field)
    figures = []
    for i, row in enumerate(rows, 1):
        at = f"{field}[row {i}]"
        quantity = as_choice(row.get("quantity"), f"{at}.quantity", QUANTITIES)
        value = _number(row.get("value"), f"{at}.value", gt=0)
        if quantity == "ettr" and value >= 1:
            fail(f"{at}.value", value, "an ETTR must be in (0, 1)")
        figures.append(PublishedFigure(
            name=as_name(row.get("name"), f"{at}.name"), gpus=as_int(_number(row.get("gpus"), f"{at}.gpus", gt=0),
                                                                      f"{at}.gpus", 1),
            quantity=quantity, value=value, source=as_name(row.get("source"), f"{at}.source"),
            note=row.get("note") or "",
            days=_number(row.get("days"), f"{at}.days", gt=0) if quantity == "interruptions" else None,
            recovery_min=_number(row.get("recovery_min"), f"{at}.recovery_min", gt=0) if quantity == "ettr" else None,
            source_id=row.get("source_id") or row.get("name") or "",
            bound=as_choice(row.get("bound") or "", f"{at}.bound", BOUNDS)))
    names = [f.name for f in figures]
    if len(set(names)) != len(names):
        fail(field, path, "figure names must be unique")
    return figures


def _number(text: str | None, field: str, gt: float) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        fail(field, text, f"must be a number > {gt:g}")
    return as_float(value, field, gt=gt)


def select(figures: Sequence[PublishedFigure], use: Sequence[str] | None, field: str) -> list[PublishedFigure]:
    """The figures named in ``use`` (all when ``None``); an unknown name is an error naming the known ones."""
    if use is None:
        return list(figures)
    known = {f.name: f for f in figures}
    for name in use:
        if name not in known:
            raise ConfigError(f"{field}={name}: no such figure (known: {', '.join(known)})")
    if len(use) < 1:
        fail(field, list(use), "must name at least one figure")
    return [known[name] for name in use]


@dataclass(frozen=True)
class FailureBand:
    """The per-GPU MTTF range (GPU-hours) the figures span: ``low_h`` the most failures, ``high_h`` the fewest."""

    low_h: float
    high_h: float
    figures: tuple[PublishedFigure, ...]

    @classmethod
    def of(cls, figures: Sequence[PublishedFigure]) -> "FailureBand":
        """The edges from the point estimates; a lower bound (the MTTF is at least that) can only raise the
        fewest-failures edge, never set the most-failures one."""
        points = [f.implied_mttf_h() for f in figures if not f.bound] or [f.implied_mttf_h() for f in figures]
        bounds = [f.implied_mttf_h() for f in figures if f.bound == "lower"]
        return cls(min(points), max(points + bounds), tuple(figures))

    @property
    def sources(self) -> int:
        """Independent sources among the figures (a source's figures count once)."""
        return len({f.source_id for f in self.figures})

    def rates_h(self, point_h: float) -> np.ndarray:
        """Every rate the band's verdicts are checked at: its edges, each figure's rate, and the point estimate."""
        return np.unique([self.low_h, self.high_h, point_h, *(f.implied_mttf_h() for f in self.figures)])

    def table(self, point_h: float, scenario: str) -> pd.DataFrame:
        """Each figure, its source, and the model's reproduction at the scenario's rate and at the band's edges."""
        rows = []
        for f in self.figures:
            model = f.model_value(point_h)
            rows.append({
                "label": "projection", "scenario": scenario, "figure": f.name, "source": f.source, "note": f.note,
                "source_id": f.source_id, "bound": f.bound or "point", "independent_sources": self.sources,
                "gpus": f.gpus, "quantity": f.quantity, "published": f.published, "published_value": f.value,
                "implied_per_gpu_mttf_h": f.implied_mttf_h(), "scenario_per_gpu_mttf_h": point_h,
                "model_value": model, "relative_error": model / f.value - 1,
                "model_at_band_low": f.model_value(self.low_h), "model_at_band_high": f.model_value(self.high_h),
            })
        return pd.DataFrame(rows)


def decimals(low: float, high: float, most: int = 3) -> int:
    """Decimals a value in [low, high] deserves: two significant digits of the band's width (0.27 wide: 0.01)."""
    width = abs(high - low)
    if not np.isfinite(width):
        return 0
    if width <= 10 ** -most:
        return most
    return int(min(most, max(0, math.ceil(-math.log10(width)) + 1)))


def shown(point: float, low: float, high: float) -> str:
    """``0.86 (0.62-0.89)``: a goodput and its band, both rounded to the precision the band supports."""
    if not all(np.isfinite((point, low, high))):
        return "-"
    d = decimals(low, high)
    return f"{point:.{d}f} ({min(low, high):.{d}f}-{max(low, high):.{d}f})"
