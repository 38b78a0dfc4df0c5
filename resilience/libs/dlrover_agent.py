"""DLRover's checkpoint saver hosted in the supervisor process, as ``dlrover-run``'s agent hosts it.

The saver holds the shared-memory segments (and with them the memory copy) across a restart of the ranks. Its class
is not chosen here: the ranks' engines send it (``DdpCheckpointSaver`` or ``FsdpDcpSaver``) through the factory
queue that ``start_async_saving_ckpt`` serves.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

POLL_S = 0.05
AGENT_ROLE = "dlrover-trainer"  # what dlrover-run's agent sets in its workers' environment


class AgentSaver:
    """DLRover's checkpoint saver in the supervisor process: the three calls ``dlrover-run``'s agent makes."""

    role = AGENT_ROLE  # the ranks' engines see it (ROLE_NAME) and leave the saver to the agent

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._env: dict[str, str | None] = {}

    def start(self, run_id: str, run_dir: Path) -> None:
        # The saver's queues, locks and segments are named after the run id, which the agent gives the ranks too.
        self._env = {"TORCHELASTIC_RUN_ID": os.environ.get("TORCHELASTIC_RUN_ID")}
        os.environ["TORCHELASTIC_RUN_ID"] = run_id
        from dlrover.python.elastic_agent.torch.ckpt_saver import AsyncCheckpointSaver

        self._saver = AsyncCheckpointSaver
        AsyncCheckpointSaver.start_async_saving_ckpt()

    def before_restart(self) -> None:
        self._saver.reset()  # the dead rank may have held the segment's lock

    def close(self) -> None:
        saver = self._saver.get_ckpt_saver() if self._env else None
        deadline = time.monotonic() + self.timeout_s
        while saver is not None and saver.wait_saving_checkpoint() and time.monotonic() < deadline:
            time.sleep(POLL_S)  # a persist in flight finishes, as the agent waits before it exits
        if saver is not None:
            saver.close()
        for key, value in self._env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
