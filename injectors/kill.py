"""Process death: a real signal delivered to the rank's own process (or a plain exit with a code), or a software
error that the process could survive: ``signal=exception`` raises inside the training step.

``kill`` stands for the most common interruptions at scale, a GPU, host or software failure that takes a rank
down ("Faulty GPU" alone was 148 of Llama 3 405B's 419 unexpected interruptions). The raised error is what an
in-process restart (NVRx's, ``recovery=nvrx_inprocess``) can recover without a new process; under every other
recovery it fails the rank's process like any uncaught error.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from injectors.base import Injector
from resilience.settings.checks import require_int

SIGNALS = ("SIGKILL", "SIGTERM", "SIGSEGV", "SIGABRT", "exit", "exception")
STEP_PHASES = ("before_forward", "before_optimizer_step")  # where an error raised is the training loop's own


class InjectedError(Exception):
    """The error ``signal=exception`` raises. Not a ``RuntimeError``: the loop takes those for a failed collective
    (a lost peer), which this is not."""


class Kill(Injector):

    takes_step_list = True  # a process can die again after its restart: each listed step kills once

    def __init__(self, signal: str = "SIGKILL", exit_code: int = 3, **trigger: Any) -> None:
        super().__init__(**trigger)
        if signal not in SIGNALS:
            raise ValueError(f"fault.signal={signal}: must be one of {', '.join(SIGNALS)}")
        require_int("fault.exit_code", exit_code, 1, 255)
        wrong = next((p for p in self.phases if p not in STEP_PHASES), None)
        if signal == "exception" and wrong:  # a save may write in a background thread
            raise ValueError(f"fault.phase={wrong}: fault.signal=exception raises in the training step; "
                             f"use fault.phase={' or '.join(STEP_PHASES)}")
        self.signal, self.exit_code = signal, exit_code

    def _plan_detail(self, step: int) -> dict[str, Any]:
        return {"signal": self.signal, "exit_code": self.exit_code if self.signal == "exit" else None,
                "pid": os.getpid()}

    def _act(self, step: int) -> None:
        if self.signal == "exception":
            raise InjectedError(f"fault=kill fault.signal=exception: rank {self.rank} raised at step {step}")
        die(self.signal, self.exit_code)

    def act_on(self, pid: int) -> None:
        """The action from another process (``injectors.striker``): the signal to the rank's process ``pid``."""
        if self.signal in ("exit", "exception"):
            raise ValueError(f"fault.signal={self.signal}: only the rank's own process can do it")
        os.kill(pid, signal.Signals[self.signal])


def die(signal_name: str, exit_code: int = 3) -> None:
    """End this process now, the way ``signal_name`` does; never returns."""
    if signal_name == "exit":
        os._exit(exit_code)  # no cleanup, no atexit: like a crash that reports a code
    sig = signal.Signals[signal_name]
    # The default disposition, so that a library's handler cannot soften the signal; only the main thread may
    # set it (a fault firing in a background persist thread keeps whatever handler there is).
    if sig != signal.SIGKILL and threading.current_thread() is threading.main_thread():
        signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
    while True:  # a signal to oneself may arrive a moment later; never run on past the fault
        signal.pause()
