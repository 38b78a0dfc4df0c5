"""No recovery: the first failure ends the run as "unrecovered" (a baseline and a control)."""

from __future__ import annotations

from resilience.recovery.base import RecoveryPolicy


class Fail(RecoveryPolicy):
    on_silent = "fail"

    def __init__(self, max_restarts: int = 0) -> None:
        if max_restarts != 0:
            raise ValueError(f"recovery.max_restarts={max_restarts}: must be 0 with recovery=fail")
        super().__init__(0)
