"""The recovery policy interface."""

from __future__ import annotations


class RecoveryPolicy:
    """How the supervisor reacts to a detected failure, within a restart budget of ``max_restarts``."""

    name: str = "base"

    def __init__(self, max_restarts: int) -> None:
        if int(max_restarts) != max_restarts or max_restarts < 0:
            raise ValueError(f"recovery.max_restarts={max_restarts}: must be an integer >= 0")
        self.max_restarts = int(max_restarts)
