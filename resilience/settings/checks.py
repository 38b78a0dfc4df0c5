"""The checks every setting goes through: one line naming the key, the value and what is allowed.

A failed check raises ``ValueError``; the command line turns it into that one line and exit status 2.
"""

from __future__ import annotations

from typing import Any, Iterable


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)  # True is an int to Python, not to us


def require_int(key: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    """``value`` if it is an integer in [``minimum``, ``maximum``]; otherwise a ValueError naming ``key``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum or (maximum is not None
                                                                                    and value > maximum):
        allowed = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{key}={value}: must be an integer {allowed}")
    return value


def require_number(key: str, value: Any, above: float | None = None, at_least: float | None = None) -> float:
    """``value`` as a float if it is a number > ``above`` (or >= ``at_least``); otherwise a ValueError."""
    if not _is_number(value) or (above is not None and value <= above) or (at_least is not None
                                                                           and value < at_least):
        allowed = f"> {above}" if above is not None else f">= {at_least}" if at_least is not None else ""
        raise ValueError(f"{key}={value}: must be a number {allowed}".rstrip())
    return float(value)


def require_choice(key: str, value: Any, allowed: Iterable[str]) -> str:
    """``value`` if it is one of ``allowed``; otherwise a ValueError listing them."""
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"{key}={value}: must be one of {', '.join(allowed)}")
    return value


def require_bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{key}={value}: must be true or false")
    return value
