"""Small lookups over a run's event list, shared by the metric modules."""

from __future__ import annotations

import statistics
from typing import Any


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def first(events: list[dict], kind: str, **match: Any) -> dict | None:
    return next((e for e in events if e["kind"] == kind and all(e.get(k) == v for k, v in match.items())), None)


def pairs(rank0: list[dict], start: str, end: str) -> list[float]:
    """Durations from each ``start`` event to the ``end`` event of the same (attempt, step)."""
    begins = {(e["attempt"], e["step"]): e["t_mono"] for e in rank0 if e["kind"] == start}
    return [e["t_mono"] - begins[(e["attempt"], e["step"])] for e in rank0
            if e["kind"] == end and (e["attempt"], e["step"]) in begins]
