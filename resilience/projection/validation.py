"""Checks for configuration values: every rejection names the field and the allowed range in one line.

The CLI prints the message of a :class:`ConfigError` as its only output on stderr, so the message must stand on
its own: ``"scenario.gpus=0: must be an integer >= 1"``.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any, NoReturn, Sequence


class ConfigError(ValueError):
    """A configuration or input value is outside its allowed range (a ``ValueError``, so callers may catch either)."""


def fail(field: str, value: Any, rule: str) -> NoReturn:
    """Raise :class:`ConfigError` as ``"<field>=<value>: <rule>"``."""
    raise ConfigError(f"{field}={value}: {rule}")


def _is_number(value: Any) -> bool:
    # bool is an int subclass; "gpus=true" is a typo, not 1 GPU.
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def as_int(value: Any, field: str, minimum: int = 1) -> int:
    """``value`` as an int >= ``minimum``; integral floats (``1024.0``) are accepted, ``1.5`` is not."""
    rule = f"must be an integer >= {minimum}"
    if not _is_number(value) or not math.isfinite(value) or int(value) != value or value < minimum:
        fail(field, value, rule)
    return int(value)


def as_float(value: Any, field: str, *, gt: float | None = None, ge: float | None = None,
             le: float | None = None) -> float:
    """``value`` as a finite float within the given bounds (``gt``: strictly greater, ``ge``/``le``: inclusive)."""
    parts = []
    if gt is not None:
        parts.append(f"> {gt:g}")
    if ge is not None:
        parts.append(f">= {ge:g}")
    if le is not None:
        parts.append(f"<= {le:g}")
    rule = "must be a finite number" + (" " + " and ".join(parts) if parts else "")
    if not _is_number(value) or not math.isfinite(value):
        fail(field, value, rule)
    if (gt is not None and not value > gt) or (ge is not None and not value >= ge) or \
            (le is not None and not value <= le):
        fail(field, value, rule)
    return float(value)


def as_optional_float(value: Any, field: str, *, gt: float | None = None, ge: float | None = None) -> float | None:
    """Like :func:`as_float`, but ``None`` (YAML ``null``) passes through; it means "unlimited" or "derive it"."""
    if value is None:
        return None
    try:
        return as_float(value, field, gt=gt, ge=ge)
    except ConfigError as err:
        raise ConfigError(f"{err} (or null)") from None


def as_choice(value: Any, field: str, choices: Sequence[str]) -> str:
    """``value`` as one of ``choices``."""
    if value not in choices:
        fail(field, value, "must be one of " + ", ".join(choices))
    return str(value)


def as_bool(value: Any, field: str) -> bool:
    """``value`` as a bool (YAML ``true``/``false`` only)."""
    if not isinstance(value, bool):
        fail(field, value, "must be true or false")
    return value


def as_name(value: Any, field: str) -> str:
    """A non-empty string."""
    if not isinstance(value, str) or not value.strip():
        fail(field, value, "must be a non-empty string")
    return value


def require_keys(node: Any, field: str, keys: Sequence[str]) -> None:
    """Every key in ``keys`` is present in the mapping ``node`` (a missing one is named)."""
    if node is None or not hasattr(node, "keys"):
        fail(field, node, "must be a mapping with keys " + ", ".join(keys))
    for key in keys:
        if key not in node:
            raise ConfigError(f"{field}.{key}: missing (required)")


def read_csv_rows(path: str | Path, field: str) -> list[dict[str, str]]:
    """The rows of a CSV whose lines starting with ``#`` are comments; at least one row, else an error."""
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(row for row in f if not row.lstrip().startswith("#")))
    except OSError as err:
        fail(field, path, f"cannot be read ({err.strerror})")
    if not rows:
        fail(field, path, "must be a CSV with a header and at least one row")
    return rows
