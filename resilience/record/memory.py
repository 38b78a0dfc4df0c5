"""Host memory a run uses: the peak proportional set size (PSS) of its process tree, sampled.

PSS, not RSS: a page mapped by several processes (a shared-memory snapshot read by every local rank, a library's
segment held by its saver and written by a rank) counts once in the sum, split between them, so the total is what
the run takes from the host. The tree is the supervisor, its ranks and whatever they start (savers, workers,
resource trackers), walked from ``/proc/<pid>/task/<tid>/children`` at every sample. Files in ``/dev/shm`` that no
process maps are not counted (none of the strategies leaves one unmapped while it runs).

Linux only: where ``/proc/self/smaps_rollup`` is missing the sampler reports nothing (``None``), never a guess.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

PROC = Path("/proc")


def available() -> bool:
    return (PROC / "self" / "smaps_rollup").exists()


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        for task in (PROC / str(pid) / "task").iterdir():
            kids += [int(c) for c in (task / "children").read_text().split()]
    except OSError:  # the process ended while we looked
        pass
    return kids


def _pss_bytes(pid: int) -> int:
    try:
        for line in (PROC / str(pid) / "smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def tree_shm_bytes(root: int, shm: str = "/dev/shm/") -> int:
    """Bytes of the distinct ``/dev/shm`` files that ``root`` or a descendant maps now (tmpfs: host RAM, which a
    strategy's snapshots hold; their mapped pages are also in the PSS, split between the processes mapping them)."""
    files, todo, seen = set(), [root], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            files |= {line.split(None, 5)[5].removesuffix(" (deleted)") for line in
                      (PROC / str(pid) / "maps").read_text().splitlines() if shm in line}
        except (OSError, IndexError):
            pass
        todo += _children(pid)
    total = 0
    for name in files:
        try:
            total += os.stat(name).st_blocks * 512  # allocated, not apparent: a sparse area holds no RAM yet
        except OSError:  # removed since (a node wipe, the end of the run)
            pass
    return total


def tree_pss_bytes(root: int) -> int:
    """The PSS of ``root`` and every descendant, now."""
    total, todo, seen = 0, [root], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += _pss_bytes(pid)
        todo += _children(pid)
    return total


class MemorySampler:
    """Samples the tree's PSS every ``interval_s`` in a daemon thread; ``stop()`` returns the peak and the count."""

    def __init__(self, interval_s: float = 0.5, root: int | None = None, shm: bool = False) -> None:
        self.interval_s, self.root, self.shm = interval_s, root or os.getpid(), shm
        self.peak, self.samples = 0, 0
        self.shm_peak = 0  # of tree_shm_bytes, when ``shm`` (reading every process's maps costs ~ms a sample)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="memory-sampler", daemon=True)

    def start(self) -> MemorySampler:
        if available():
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_pss_bytes(self.root))
            if self.shm:
                self.shm_peak = max(self.shm_peak, tree_shm_bytes(self.root))
            self.samples += 1
            self._stop.wait(self.interval_s)

    def stop(self) -> tuple[int | None, int]:
        """(peak PSS in bytes or None when nothing was sampled, number of samples)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        return (self.peak if self.samples else None), self.samples
