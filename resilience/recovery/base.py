"""The recovery policy interface."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable

from resilience.caps import Named, PolicyCaps
from resilience.settings.checks import require_int

if TYPE_CHECKING:  # annotations only: they import torch, a policy does not
    from injectors.base import Injector
    from resilience.detectors.base import Detection


class RecoveryPolicy(Named):
    """How the run reacts to a detected failure, within a restart budget of ``max_restarts``.

    Crashes and hangs always end the attempt (the supervisor restarts the ranks while budget is left). What a
    rank-side detection of silent corruption means is the policy's ``react``: "record" it and train on,
    "restart" from the newest good checkpoint, "rollback" to one taken before the corruption, or "fail".
    """

    on_silent: str = "record"
    caps = PolicyCaps()

    def react(self, detection: Detection) -> str:
        return self.on_silent if detection.silent else "record"

    def __init__(self, max_restarts: int) -> None:
        self.max_restarts = require_int("recovery.max_restarts", max_restarts, 0)

    def caveats(self, injector: Injector) -> list[str]:
        """What the fault's settings ask of recovery that this policy does not do (said at launch, never silently
        ignored): a node that returns (``fault.return_after_s``) is taken back only by ``recovery=grow``."""
        back = injector.caps.returns_after_s
        return [] if back is None else [f"fault.return_after_s={back:g}: recovery={self.name} does not take a "
                                        f"returning node back (recovery=grow does); the setting has no effect here"]

    def run_attempts(self, attempt: Callable[[bool], None], run_dir: Path) -> None:
        """Run this rank's training attempts in this process: ``attempt(again)`` trains once (``again``: not the
        process's first); a failure raises out of it. Here: one attempt, a failure ends the process (the supervisor
        restarts it). NVRx's in-process restart runs it again in the same process."""
        attempt(False)
