"""Processes that a library starts inside a rank (a checkpoint worker, a daemon, a resource tracker) end with the run.

When a rank dies, its own children are reparented. The supervisor declares itself their *subreaper*
(``PR_SET_CHILD_SUBREAPER``), so that they become its children rather than init's; when the run ends it kills every
child it still has (its ranks are stopped by then) and records what they were. A rank whose supervisor died kills
its children before it goes (``resilience.rank.orphan``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import time
from pathlib import Path
from typing import Callable

PR_SET_PDEATHSIG = 1  # linux/prctl.h
PR_SET_CHILD_SUBREAPER = 36


def adopt_orphans() -> bool:
    """Make this process the subreaper of its descendants; False where the kernel refuses (not Linux)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def killed_with_parent() -> None:
    """SIGKILL this process when the thread that started it ends (Linux; elsewhere nothing): for a helper that
    must never outlive its starter, however the starter ends."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _live(keep: Callable[[int, int], bool]) -> dict[int, str]:
    """Live (non-zombie) processes but this one whose (parent pid, session id) ``keep`` accepts, with their command
    lines."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()  # state, ppid, pgrp, session, ...
            if fields[0] != "Z" and keep(int(fields[1]), int(fields[3])):
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(
                    errors="replace").strip()[:200]
        except (OSError, IndexError, ValueError):
            continue
    return found


def children(pid: int | None = None) -> dict[int, str]:
    """Live (non-zombie) children of ``pid`` (default: this process) and their command lines."""
    pid = os.getpid() if pid is None else pid
    return _live(lambda ppid, _session: ppid == pid)


def kill_children(tracker_grace_s: float = 3.0) -> dict[int, str]:
    """SIGKILL every live child of this process and reap it; what they were (pid -> command line).

    A multiprocessing resource tracker goes last: once the processes that used it are gone it unlinks what they
    left (named semaphores in ``/dev/shm``) and exits by itself; killed with them, it would leak those."""
    found = children()
    trackers = {pid for pid, cmd in found.items() if "resource_tracker" in cmd}
    _kill_and_reap(set(found) - trackers)
    deadline = time.monotonic() + tracker_grace_s
    while trackers & set(children()) and time.monotonic() < deadline:
        for pid in trackers:  # reap those that exited
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        time.sleep(0.05)
    _kill_and_reap(trackers & set(children()))
    return found


def in_sessions(sessions: set[int]) -> dict[int, str]:
    """Every live process whose session is one of ``sessions``: pid -> command line."""
    return _live(lambda _ppid, session: session in sessions)


def kill_sessions(sessions: set[int]) -> dict[int, str]:
    """SIGKILL every live process whose session is one of ``sessions`` (the run's rank processes each lead one):
    what a killed rank started and the subreaper did not get (seen: DLRover's forkserver, started by its saver in
    rank 0, reparented to init); pid -> command line."""
    found = in_sessions(sessions)
    for pid in found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return found


def _kill_and_reap(pids: set[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


# torch's tensor segments, multiprocessing's named semaphores, and the CUDA driver's per-process IPC files
# (cuda.shm.<uid>.<pid, hex>.<n>: a rank whose library worker took CUDA tensors by IPC left two on an H100, 2026-11-27)
LEAKABLE = re.compile(r"^(torch_\d+_|sem\.mp-|cuda\.shm\.)")


def in_use(shm_dir: Path = Path("/dev/shm")) -> set[int]:
    """Inodes in ``shm_dir``'s file system that a live process maps or holds open. By inode, not by name: glibc's
    sem_open maps a temporary file and links it under the semaphore's name, so a process's maps name the (deleted)
    temporary file, never ``sem.mp-*``."""
    dev = os.stat(shm_dir).st_dev
    device = f"{os.major(dev):02x}:{os.minor(dev):02x}"
    used: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for line in (entry / "maps").read_text().splitlines():
                fields = line.split(maxsplit=5)
                if len(fields) >= 5 and fields[3] == device:
                    used.add(int(fields[4]))
            for fd in (entry / "fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.stat(fd)
                    if target.st_dev == dev:
                        used.add(target.st_ino)
    return used


def remove_unreachable(since: float, shm_dir: Path = Path("/dev/shm")) -> list[tuple[str, int]]:
    """Remove torch's tensor segments and multiprocessing's named semaphores made since ``since`` (wall clock: the
    run's first job's start) that no live process maps or holds open: nothing can reach them any more. Every process
    of the run has ended when it is called. A library's checkpoint worker (DCP's process executor, NVRx's async
    worker) gets tensors through such segments, and a process SIGKILLed never unlinks them (70 MB each in the peers
    matrix); a job SIGKILLed whole leaves them (its library workers and their resource tracker die with it: NVRx's
    66 semaphores, DLRover's fork server's); the job that resumes it removes them when it ends. Return (name,
    bytes)."""
    removed, used = [], None
    for path in shm_dir.iterdir():
        if not LEAKABLE.match(path.name):
            continue
        with contextlib.suppress(OSError):
            stat = path.stat()
            if stat.st_ctime < since:
                continue
            used = in_use(shm_dir) if used is None else used  # read once, and only where a candidate is
            if stat.st_ino not in used:
                path.unlink()
                removed.append((path.name, stat.st_size))
    return removed
