"""A helper process of a rank (a loader worker, a library's checkpoint worker) that lives exactly as long as it.

A scheduler's SIGTERM (a preemption's notice) reaches every process of the job. The rank decides what it means
(``checkpoint.on_notice``: save first, which may need its helpers), so a helper ignores it and ends when its rank
does: a thread waits on the rank's pidfd (readable once the process has ended, a zombie too) and exits the process.
Without the watch a helper whose parent was SIGKILLed can wait on a queue forever (NVRx's persistent worker did).
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time

POLL_S = 0.2  # where the kernel has no pidfd


def outlive_notice(rank_pid: int, name: str) -> None:
    """In the helper: ignore SIGTERM, and exit as soon as ``rank_pid`` has ended."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_exit_after, args=(rank_pid,), name=name, daemon=True).start()


def _exit_after(rank_pid: int) -> None:
    wait_gone(rank_pid)
    os._exit(0)  # the rank is gone: nothing is waiting for this helper's work, and nothing to flush


def wait_gone(pid: int) -> None:
    """Return once ``pid`` has ended (its pidfd is readable then, a zombie's too; polled where there is none)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):
        while alive(pid):
            time.sleep(POLL_S)
        return
    select.select([fd], [], [])
    os.close(fd)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_handed_over = threading.Event()


def die_with(pid: int) -> None:
    """In a process that must not outlive ``pid`` (a preloaded rank and its stub): SIGKILL itself once it has
    ended, until ``hand_over`` (the rank's own watch, which cleans up first, then takes the job)."""
    threading.Thread(target=_kill_self_after, args=(pid,), name="die-with-stub", daemon=True).start()


def hand_over() -> None:
    _handed_over.set()


def _kill_self_after(pid: int) -> None:
    wait_gone(pid)
    if not _handed_over.is_set():
        os.kill(os.getpid(), signal.SIGKILL)
