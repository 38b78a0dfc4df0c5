"""A failure that strikes at a set time whatever the rank's threads are doing (``fault=trace``'s
``fault.strike=anywhere``): a forked child of the rank sleeps, records the firing and acts on the rank from outside.

Why a child and not a timer thread: a thread in the rank needs the rank's interpreter lock to run, so while the
rank's other threads hold it (a background persist in Python, a copy thread) the strike waits for them and lands
after they finish, which no crash does. Measured with a timer thread: of 42 failures one to four steps after an
async checkpoint, 1 lost it where its measured lags predicted 5, several striking within 3 ms after the persist
ended. The child has its own lock; it touches no torch state: it sleeps, writes the one event line, signals the
rank, and for a node loss wipes the node's memory once the rank is gone (so that no thread of the rank writes into
it after the wipe).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Protocol


class Strikes(Protocol):
    """What a striker needs of a fault: its record, and its action on a process other than the caller."""

    def _plan_detail(self, step: int) -> dict: ...

    def record(self, step: int, index: int, detail: dict, fsync: bool = True) -> None: ...

    def act_on(self, pid: int) -> None: ...

    def sync_records(self) -> None: ...


class Striker:
    """The rank's pending strikes, one child process each."""

    def __init__(self) -> None:
        self.children: list[int] = []

    def start(self, delay_s: float, fault: Strikes, step: int, index: int) -> None:
        """Strike planned point ``index`` of ``fault`` (at ``step``) on this process ``delay_s`` from now."""
        detail, rank = fault._plan_detail(step), os.getpid()  # the rank's own facts, taken before the fork
        child = os.fork()
        if child:
            self.children.append(child)
            return
        code = 0
        try:  # the child: never returns into the rank's code
            time.sleep(delay_s)
            if os.getppid() == rank:  # the rank is still there (it did not end or die meanwhile)
                # written first (the kernel holds it), synced only after the action: an fsync first waits for a
                # disk that a checkpoint's writes keep busy and so moves the strike past the checkpoint's stall
                # (as the wall clock's striker did: injectors.wall_striker)
                fault.record(step, index, detail, fsync=False)
                fault.act_on(rank)
                fault.sync_records()
        except BaseException:  # noqa: BLE001 - a child has no caller to report to; its exit code says it
            code = 1
        finally:
            os._exit(code)

    def stop(self) -> None:
        """The rank leaves: strikes still pending never come (their planned points fire in no later attempt)."""
        for child in self.children:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                os.waitpid(child, 0)
            except ChildProcessError:
                pass
        self.children = []


def wait_gone(pid: int, timeout_s: float = 5.0) -> None:
    """Until process ``pid`` has stopped running (gone, or a zombie its parent has not reaped yet)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and running(pid):
        time.sleep(0.001)


def running(pid: int) -> bool:
    """Process ``pid`` exists and has not ended (a zombie has: only its parent's reaping is left)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
