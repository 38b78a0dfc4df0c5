"""Atomic output files: a reader (or a crash) never sees a half-written CSV or PNG.

Uses the project's durable-write primitive (:func:`resilience.record.fsio.atomic_write_bytes`: temp file, fsync,
``os.replace``, fsync of the directory), so projection outputs follow the same rule as every other result.
"""

from __future__ import annotations

import io
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from resilience.record.fsio import atomic_write_bytes


def write_csv(frame: pd.DataFrame, path: str | Path) -> Path:
    """Write ``frame`` as CSV (no index) atomically; returns the path."""
    path = Path(path)
    atomic_write_bytes(path, frame.to_csv(index=False).encode())
    return path


def write_png(fig: Figure, path: str | Path, dpi: int = 120) -> Path:
    """Render ``fig`` to PNG in memory, then write it atomically; returns the path."""
    path = Path(path)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    atomic_write_bytes(path, buf.getvalue())
    return path
