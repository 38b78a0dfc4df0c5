"""Hangs: a rank stops making progress without dying, the failure that nothing notices by itself.

At scale these cost more than crashes: NCCL's watchdog waits 10 minutes by default, and Llama 3 405B lost 7 of its
419 unexpected interruptions to "NCCL watchdog timeouts" whose cause was never found. Modes:

* ``stall``   the rank stops in Python before its next collective; its peers block inside the all-reduce.
* ``sigstop`` the whole process is frozen (SIGSTOP), threads included; the supervisor resumes or kills it.
* ``gil``     a C call holds the GIL, so Python threads (a heartbeat thread, say) stop too.
* ``gpu_sleep`` (CUDA only) a kernel that spins on the GPU before the collective.

``duration_s`` null: until a detector acts (the process is killed by the recovery).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from typing import Any

import torch

from injectors.base import Injector
from resilience.proc.orphans import killed_with_parent
from resilience.record.torch_workarounds import declare

MODES = ("stall", "sigstop", "gil", "gpu_sleep")
FOREVER_S = 10**6
GPU_SLEEP = declare("cuda_sleep_kernel", "torch.cuda._sleep is the only spinning kernel torch ships: it keeps the "
                    "GPU busy without a custom extension", ("2.13.0",), __name__)


class Hang(Injector):

    def __init__(self, mode: str = "stall", duration_s: float | None = None, **trigger: Any) -> None:
        super().__init__(**trigger)
        if mode not in MODES:
            raise ValueError(f"fault.mode={mode}: must be one of {', '.join(MODES)}")
        if duration_s is not None and not (isinstance(duration_s, (int, float)) and duration_s > 0):
            raise ValueError(f"fault.duration_s={duration_s}: must be a number > 0, or null (until detected)")
        self.mode, self.duration_s = mode, duration_s
        self._waker: int | None = None  # the pid of the helper that resumes a SIGSTOPped rank

    def validate(self, world_size: int, steps: int, ckpt_every: int | None) -> None:
        super().validate(world_size, steps, ckpt_every)
        if self.mode == "gpu_sleep" and not torch.cuda.is_available():
            raise ValueError("fault.mode=gpu_sleep: needs a CUDA device; use stall, sigstop or gil on CPU")
        if self.mode == "gpu_sleep":
            GPU_SLEEP.check()

    def _plan_detail(self, step: int) -> dict[str, Any]:
        return {"mode": self.mode, "duration_s": self.duration_s, "pid": os.getpid()}

    def _act(self, step: int) -> None:
        seconds = self.duration_s or FOREVER_S
        if self.mode == "stall":
            time.sleep(seconds)
        elif self.mode == "sigstop":
            if self.duration_s:
                self._waker = _resume_later(seconds)
            os.kill(os.getpid(), signal.SIGSTOP)
        elif self.mode == "gil":
            # ctypes.PyDLL keeps the GIL across the foreign call (CDLL would release it): no Python thread runs.
            ctypes.PyDLL(None).sleep(ctypes.c_uint(max(1, round(seconds))))
        else:
            GPU_SLEEP.acted(self.rt.events)  # declared before the spin: the rank is killed while it waits
            _gpu_spin(self.rt.device, seconds)

    def cleanup(self) -> None:
        """Reap the waker: it never outlives its rank (and so never signals a reused pid)."""
        if self._waker is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._waker, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self._waker, 0)
            self._waker = None




def _resume_later(seconds: float) -> int:
    """Fork a child that sends SIGCONT to this process after ``seconds`` (a stopped process cannot wake itself);
    return its pid. The child dies with this process, and only ever signals its own parent."""
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            killed_with_parent()
            deadline = time.monotonic() + seconds
            while os.getppid() == parent and time.monotonic() < deadline:
                time.sleep(min(0.1, seconds))
            if os.getppid() == parent:  # still ours: the pid cannot have been reused while we are its child
                os.kill(parent, signal.SIGCONT)
        finally:
            os._exit(0)
    return pid


def _gpu_spin(device: torch.device, seconds: float) -> None:
    """Queue a spinning kernel of about ``seconds`` on the device: the host runs on, the collective waits behind it."""
    with torch.cuda.device(device):
        torch.cuda._sleep(int(seconds * 1.5e9))  # in clock cycles; ~1.5 GHz
