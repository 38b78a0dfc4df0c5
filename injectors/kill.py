"""Process death: a real signal delivered to the rank's own process (or a plain exit with a code).

``kill`` stands for the most common interruptions at scale, a GPU, host or software failure that takes a rank
down ("Faulty GPU" alone was 148 of Llama 3 405B's 419 unexpected interruptions). ``node_loss`` takes down every
rank of one simulated node at once, with what that node held in memory for recovery (a host, PSU or network
failure).
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from injectors.base import Injector, require_int

SIGNALS = ("SIGKILL", "SIGTERM", "SIGSEGV", "SIGABRT", "exit")


class Kill(Injector):
    name = "kill"

    def __init__(self, signal: str = "SIGKILL", exit_code: int = 3, **trigger: Any) -> None:
        super().__init__(**trigger)
        if signal not in SIGNALS:
            raise ValueError(f"fault.signal={signal}: must be one of {', '.join(SIGNALS)}")
        if require_int("fault.exit_code", exit_code, 1) > 255:
            raise ValueError(f"fault.exit_code={exit_code}: must be an integer in [1, 255]")
        self.signal, self.exit_code = signal, exit_code

    def _plan_detail(self, step: int) -> dict[str, Any]:
        return {"signal": self.signal, "exit_code": self.exit_code if self.signal == "exit" else None,
                "pid": os.getpid()}

    def _act(self, step: int) -> None:
        die(self.signal, self.exit_code)


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


class NodeLoss(Kill):
    """Kills every rank of the simulated node that holds ``fault.rank`` (ranks grouped by ``ranks_per_node``)."""

    name = "node_loss"

    def __init__(self, ranks_per_node: int = 1, **kw: Any) -> None:
        super().__init__(**kw)
        self.ranks_per_node = require_int("fault.ranks_per_node", ranks_per_node, 1)

    def validate(self, world_size: int, steps: int, ckpt_every: int | None) -> None:
        super().validate(world_size, steps, ckpt_every)
        if world_size % self.ranks_per_node:
            raise ValueError(f"fault.ranks_per_node={self.ranks_per_node}: must divide world_size={world_size}")
        self.world_size = world_size

    def node(self) -> int:
        return self.rank // self.ranks_per_node

    def targets(self) -> set[int]:
        first = self.node() * self.ranks_per_node
        return set(range(first, first + self.ranks_per_node))

    def _plan_detail(self, step: int) -> dict[str, Any]:
        return {**super()._plan_detail(step), "node": self.node(), "node_ranks": sorted(self.targets())}

    def _act(self, step: int) -> None:
        if self.rt.node_memory is not None:
            self.rt.node_memory.destroy(self.node())  # the node's RAM is gone with it
        super()._act(step)
