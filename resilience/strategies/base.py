"""The checkpoint strategy interface.

``save`` and ``load`` hold the shared policy (is a checkpoint due? is there anything to load?) and the events that
every metric is computed from; subclasses fill in ``_save`` and ``_load`` and cannot bypass either by accident.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod

from resilience.runtime import RankRuntime
from resilience.state import TrainState


class CheckpointStrategy(ABC):
    """Saves training state every ``every`` steps and restores the newest good one after a restart."""

    name: str = "base"
    saves: bool = True  # False for strategies that never write a checkpoint
    # True: survivors of a failure keep running and ``recover`` in place; the supervisor replaces only the failed
    # ranks (``resilience.replacing``). False: every rank is restarted and calls ``load``.
    recovers_in_place: bool = False

    def __init__(self, every: int, keep: int) -> None:
        for key, value in (("every", every), ("keep", keep)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"checkpoint.{key}={value}: must be an integer >= 1")
        self.every, self.keep = every, keep
        self.rt: RankRuntime | None = None

    def attach(self, rt: RankRuntime) -> None:
        """Bind to the rank that hosts this strategy (called once per attempt, before ``load``)."""
        self.rt = rt

    def due(self, step: int, total_steps: int) -> bool:
        """A checkpoint is due after every ``every``-th step; the final state is not checkpointed (the run ends)."""
        return self.saves and step % self.every == 0 and 0 < step < total_steps

    def save(self, step: int, total_steps: int, state: TrainState) -> None:
        """Checkpoint ``state`` (the state after ``step`` optimizer steps) if one is due."""
        if not self.due(step, total_steps):
            return
        self.rt.events.emit("ckpt_begin", step=step)
        self._save(step, state)

    def load(self, state: TrainState) -> int:
        """Restore the newest good checkpoint into ``state``; return its step (0: nothing to load, start fresh)."""
        t0 = time.monotonic()
        loaded = self._load(state)
        if loaded is None:
            return 0
        step, source, nbytes = loaded
        self.rt.events.emit("ckpt_loaded", step=step, source=source, bytes=nbytes,
                            duration_s=time.monotonic() - t0)
        return step

    def recover(self, state: TrainState, position: int, error: BaseException) -> int:
        """A collective failed with ``error`` after ``position`` optimizer steps: recover in place and return the
        position to go on from, or re-raise ``error`` (the default: this process fails and is restarted)."""
        raise error

    def wait(self) -> None:
        """Block until every save started so far is durable; re-raise a failure of a background save."""

    def close(self) -> None:
        """Release what the strategy holds (threads, memory)."""

    @abstractmethod
    def _save(self, step: int, state: TrainState) -> None:
        """Write the checkpoint for ``step``; emit ``ckpt_stall_end`` and (on rank 0) ``ckpt_durable``."""

    @abstractmethod
    def _load(self, state: TrainState) -> tuple[int, str, int] | None:
        """Load the newest good checkpoint; return (step, source, bytes read) or None when there is none."""
