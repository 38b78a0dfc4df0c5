"""One run owns its checkpoint directory: a lock held for the run's life, naming its owner.

Two runs sharing a ``checkpoint.dir`` would load each other's checkpoints. The supervising command takes an
exclusive ``flock`` on ``<dir>/.owner.lock`` and holds it until it exits; the kernel releases it if the command dies,
even by SIGKILL, so a stale lock file never blocks a later run. The file names the owner (run id, run directory,
pid) so that a refused run can say whose the directory is.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

LOCK_FILE = ".owner.lock"


class DirectoryInUse(Exception):
    """Another live run holds the directory; the message names it."""


class DirectoryLock:
    """An exclusive lock on one checkpoint directory, held by this process until ``release`` or exit."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_FILE
        self._fd: int | None = None

    def acquire(self, owner: dict) -> None:
        """Take the lock and record ``owner`` in it; raise ``DirectoryInUse`` if a live run holds it."""
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self.path.read_text().strip() or "unknown"
            os.close(fd)
            raise DirectoryInUse(f"in use by another run ({holder})") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(owner).encode(), 0)
        os.fsync(fd)
        self._fd = fd

    def holder(self) -> str | None:
        """Who holds the lock now (None: nobody), without taking it or creating anything."""
        try:
            fd = os.open(self.path, os.O_RDWR)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return self.path.read_text().strip() or "unknown"
        finally:
            os.close(fd)  # also drops the lock if we just took it
        return None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def holds_checkpoints(directory: Path) -> bool:
    """Whether ``directory`` holds anything but a (released) lock file: a run starts from an empty directory."""
    return directory.exists() and any(p.name != LOCK_FILE for p in directory.iterdir())
