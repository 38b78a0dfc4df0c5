"""Job loss: the supervisor and every rank SIGKILLed at once, what a lost launcher node or a hard preemption does.

Nothing of the job survives to recover it: no supervisor restarts the ranks, and a SIGKILLed supervisor writes no
end record (``python -m resilience.result DIR`` then says ``interrupted``). The run goes on only in a new job,
``python -m resilience ... resume=DIR`` (resilience/supervise/resume.py, docs/resume.md), from the newest complete
checkpoint; this fault's record in the event log keeps it from firing again there.
"""

from __future__ import annotations

import os
import signal
from dataclasses import replace
from typing import Any

from injectors.base import Injector
from injectors.kill import die
from resilience.proc.zygote import launcher_pid
from resilience.record.events import read_events


class JobKill(Injector):
    """At ``at_step`` (before the forward pass, or inside a save), rank ``rank`` kills the job: its parent (the
    supervisor) first, so that nothing sees a rank die and restarts it, then every other rank, then itself."""

    caps = replace(Injector.caps, ends_the_job=True)

    def _plan_detail(self, step: int) -> dict[str, Any]:
        # Every rank of this attempt recorded its pid before it joined the model's first collective, so by any
        # step all of them are in the log.
        ranks = {e["rank"]: e["pid"] for e in read_events(self.rt.run_dir)
                 if e["kind"] == "run_start" and e["attempt"] == self.rt.attempt}
        self._victims = [launcher_pid(), *(pid for rank, pid in sorted(ranks.items()) if pid != os.getpid())]
        return {"signal": "SIGKILL", "supervisor_pid": self._victims[0], "rank_pids": ranks}

    def _act(self, step: int) -> None:
        for pid in self._victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # already gone: the job is dying anyway
                pass
        die("SIGKILL")
