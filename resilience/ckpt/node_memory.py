"""What the simulated nodes of a run hold in shared memory, and its removal (in-memory checkpointing).

``NodeMemory.destroy(node)`` is the ``RankRuntime.node_memory`` service the in-memory strategy provides to the
``node_loss`` injector: the node's RAM is gone with it. ``cleanup(run_dir)`` is the supervisor's (through the
strategy's ``clean_up_run``) when a run ends: rank processes cannot remove their areas (they die). A supervisor
killed before its cleanup is covered by its ranks (``resilience.rank.orphan``): they remove the run's areas when
their parent dies. Nothing here touches another run's areas.
"""

from __future__ import annotations

import os
from pathlib import Path

from resilience.ckpt import shm_store
from resilience.ckpt.shm_store import PAGE, PREFIX, run_id


def node_areas(rid: str, node: int) -> list[Path]:
    """Every area held on ``node`` (own areas and peer copies)."""
    return sorted(shm_store.SHM_DIR.glob(f"{PREFIX}{rid}-n{node}-r*"))


def node_tombstone(rid: str, node: int) -> Path:
    return shm_store.SHM_DIR / f"{PREFIX}{rid}-n{node}.lost"


class NodeMemory:
    """What the simulated nodes of one run hold in memory: ``destroy(node)`` wipes one node's areas.

    Provided as ``RankRuntime.node_memory``; the ``node_loss`` injector calls ``destroy`` before killing the node's
    ranks. A tombstone marks the node lost until it rejoins (``revive``, at the next load), so that a peer
    writing its copy into that node's memory at the same moment cannot bring an area back to life.
    """

    def __init__(self, rid: str) -> None:
        self.rid = rid

    def _tombstone(self, node: int) -> Path:
        return node_tombstone(self.rid, node)

    def destroy(self, node: int) -> list[str]:
        """Zero and unlink every area held on ``node`` (own areas and peer copies); return their names."""
        self._tombstone(node).touch()  # first: a peer that creates an area after this sees it and backs off
        wiped = []
        for path in node_areas(self.rid, node):
            try:
                fd = os.open(path, os.O_WRONLY)
            except FileNotFoundError:
                continue
            try:  # zero the headers too: a process that still maps the file must not find a snapshot either
                os.pwrite(fd, bytes(PAGE), 0)
            finally:
                os.close(fd)
            path.unlink(missing_ok=True)
            wiped.append(path.name)
        return wiped

    def lost(self, node: int) -> bool:
        return self._tombstone(node).exists()

    def revive(self, node: int) -> None:
        """The node is back (a new attempt), with empty memory."""
        self._tombstone(node).unlink(missing_ok=True)


def cleanup(run_dir: str | Path) -> list[str]:
    """Remove every shared-memory file of the run in ``run_dir``; return their names. Safe to call twice."""
    return _remove(run_id(run_dir))


def _remove(rid: str) -> list[str]:
    removed = []
    for path in sorted(shm_store.SHM_DIR.glob(f"{PREFIX}{rid}[-.]*")):
        try:
            path.unlink()
            removed.append(path.name)
        except FileNotFoundError:
            pass
    return removed
