"""Node maintenance with notice: the node holding ``fault.rank`` is announced to go ``notice_s`` seconds ahead, and
goes then (its ranks SIGKILLed), as a cloud's scheduled host maintenance or an operator's ``scontrol reboot ASAP``
does. The Llama 3 405B report counts 32 host-maintenance stops in its 54 days (Dubey et al., 2024, Table 5).

The notice reaches the node's rank processes as ``SIGUSR2`` (what a node agent relays from the provider's
maintenance event). A job that listens (``resilience.rank.handover``) moves the node's ranks to warm spares at the
end of the step, with no rollback: the ranks agree on who leaves, the leaving ranks end, the supervisor hands their
ranks to spares, and the spares take the state from a live replica (``strategy=replica``). When the move has not
happened by the deadline the node goes anyway, and the run recovers as from a node loss without notice.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from typing import Any

from injectors.executioner import started
from injectors.node_loss import NodeLoss
from resilience.settings.checks import require_number
from resilience.record.events import read_events

NOTICE_SIGNAL = signal.SIGUSR2


class Drain(NodeLoss):
    """At ``at_step``, rank ``rank`` announces its node's maintenance: the executioner (own session) SIGKILLs the
    node's rank processes still alive ``notice_s`` seconds later; every one of them gets ``SIGUSR2`` now."""

    caps = replace(NodeLoss.caps, hands_over=True)
    takes_step_list = False  # one maintenance per run: the spare pool is sized for one move

    def __init__(self, notice_s: float = 30.0, **kw: Any) -> None:
        super().__init__(**kw)
        self.notice_s = require_number("fault.notice_s", notice_s, above=0)
        if self.return_after_s is not None:
            raise ValueError(f"fault.return_after_s={self.return_after_s}: a drained node's ranks moved to spares "
                             f"for good; give fault.return_after_s=null")

    def _plan_detail(self, step: int) -> dict[str, Any]:
        # The node's ranks of this generation: each rank's newest process (a replaced rank has several)
        newest: dict[int, int] = {}
        for e in read_events(self.rt.run_dir):
            if e["kind"] == "run_start":
                newest[e["rank"]] = e["pid"]
        self._node_pids = [newest[r] for r in sorted(self.targets()) if r in newest]
        return {**super()._plan_detail(step), "signal": "SIGUSR2", "notice_s": self.notice_s,
                "node_pids": self._node_pids}

    def _act(self, step: int) -> None:
        marks = [f"{pid}:{start}" for pid in self._node_pids if (start := started(pid)) is not None]
        deadline = time.monotonic() + self.notice_s
        subprocess.Popen([sys.executable, "-m", "injectors.executioner", repr(deadline), str(self.rt.run_dir),
                          *marks], start_new_session=True, stdin=subprocess.DEVNULL)
        for pid in self._node_pids:
            try:
                os.kill(pid, NOTICE_SIGNAL)
            except ProcessLookupError:  # already gone: the node is going anyway
                pass
