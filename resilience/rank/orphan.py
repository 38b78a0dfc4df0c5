"""A rank process dies with its supervisor, and takes what the run left in host memory with it.

If the supervisor is killed (SIGKILL, OOM killer), nothing stops its rank processes: they would train on as orphans
until they finish, holding their shared memory (several times the model state per rank for in-memory
checkpointing). A daemon thread watches the parent: when the rank has been reparented, the parent is gone, so the
rank removes the run's host memory through the strategy's own clean-up and kills itself. A thread, not a signal
handler, because the main thread may sit in a C call (a collective) where Python handlers do not run.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Callable

from resilience.proc.lifeline import alive, hand_over
from resilience.proc.orphans import kill_children
from resilience.proc.zygote import stub_pid

POLL_S = 0.2


def die_with_parent(clean_up: Callable[[], None]) -> None:
    """Start watching this process's parent; ``clean_up`` runs once if it dies, then this process is SIGKILLed.
    A preloaded rank (resilience.proc.zygote) watches its stub too: the process the supervisor started for it."""
    parent, stub = os.getppid(), stub_pid()
    hand_over()  # the zygote's early watch of the stub would kill without cleaning up

    def watch() -> None:
        while os.getppid() == parent and (stub is None or alive(stub)):
            time.sleep(POLL_S)
        try:
            kill_children()  # a library's worker processes would outlive this rank
            clean_up()
        finally:
            os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="die-with-parent", daemon=True).start()
