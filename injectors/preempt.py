"""Preemption with notice: SIGTERM to the supervisor and every rank at once, SIGKILL to what is left after
``grace_s`` seconds, as SLURM does at a preemption or a time limit (SIGTERM, then SIGKILL after ``KillWait``) and a
cloud at a spot instance's reclaim (AWS gives two minutes' notice, GCP 30 s).

The Llama 3 405B report counts 47 planned interruptions and 32 host-maintenance stops in its 54 days (Dubey et al.,
2024, Table 5): interruptions that come with notice. What a job makes of the notice is the strategy's:
``checkpoint.on_notice=true`` finishes the step and saves before the grace period ends (resilience.rank.notice);
without it the ranks die at the SIGTERM and the run loses the steps since its last durable checkpoint. Either way
the run goes on only in a new job: ``resume=<run dir>`` (docs/resume.md).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

from injectors.executioner import started
from injectors.job_kill import JobKill
from resilience.settings.checks import require_number


class Preempt(JobKill):
    """At ``at_step``, rank ``rank`` plays the scheduler: it starts the executioner (the SIGKILL after the grace
    period, in a session of its own), then sends SIGTERM to the supervisor, every other rank and itself."""

    def __init__(self, grace_s: float = 10.0, **trigger: Any) -> None:
        super().__init__(**trigger)
        self.grace_s = require_number("fault.grace_s", grace_s, above=0)

    def _plan_detail(self, step: int) -> dict[str, Any]:
        return {**super()._plan_detail(step), "signal": "SIGTERM", "grace_s": self.grace_s}

    def _act(self, step: int) -> None:
        job = [*self._victims, os.getpid()]
        marks = [f"{pid}:{start}" for pid in job if (start := started(pid)) is not None]
        deadline = time.monotonic() + self.grace_s
        subprocess.Popen([sys.executable, "-m", "injectors.executioner", repr(deadline), str(self.rt.run_dir),
                          *marks], start_new_session=True, stdin=subprocess.DEVNULL)
        for pid in job:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:  # already gone: the job is ending anyway
                pass
