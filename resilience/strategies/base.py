"""The checkpoint strategy interface.

``save`` and ``load`` hold the shared policy (is a checkpoint due? is there anything to load?) and the events that
every metric is computed from; subclasses fill in ``_save`` and ``_load`` and cannot bypass either by accident.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod

from pathlib import Path

from resilience.checks import require_int
from resilience.named import Named
from resilience.runtime import AgentService, NodeMemory, RankRuntime
from resilience.state import TrainState
from resilience.workloads.base import Workload


class CheckpointStrategy(Named, ABC):
    """Saves training state every ``every`` steps and restores the newest good one after a restart."""

    saves: bool = True  # False for strategies that never write a checkpoint
    # True: survivors of a failure keep running and ``recover`` in place; the supervisor replaces only the failed
    # ranks (``resilience.supervise.replacing``). False: every rank is restarted and calls ``load``.
    recovers_in_place: bool = False

    def __init__(self, every: int, keep: int) -> None:
        self.every = require_int("checkpoint.every", every, 1)
        self.keep = require_int("checkpoint.keep", keep, 1)
        self.rt: RankRuntime | None = None

    def node_memory(self, run_dir: Path) -> NodeMemory | None:
        """The service this strategy provides to the rank's runtime: what its nodes hold in memory (None: nothing)."""
        return None

    def keeps_world_group(self) -> bool:
        """Whether every rank's process group is the whole world for the run's life (a detector that compares the
        ranks needs it); False where ranks train in groups of their own or a group shrinks while a rank is replaced."""
        return True

    def writes_through_checkpoint_fs(self) -> bool:
        """Whether every checkpoint file goes through the runtime's ``ckpt_fs`` (DCP's file-system layer), the
        seam that disk faults act on; False for a writer that opens its files itself."""
        return False

    def handles_sharded_state(self) -> bool:
        """Whether this strategy saves and loads a sharded model's state (each rank its shards: ``parallel=fsdp``)."""
        return False

    def sharded_refusal(self) -> str:
        """Why this strategy cannot save a sharded model's state: one clause for the parallel setting's refusal."""
        return "it keeps whole-model copies"

    def agent_service(self) -> AgentService | None:
        """What this strategy runs in the supervisor process across rank restarts (None: nothing)."""
        return None

    @classmethod
    def clean_up_run(cls, run_dir: Path) -> None:
        """Called by the supervisor when the run ends, whatever the outcome: remove what the ranks left on the host
        for recovery (they cannot, since they may die)."""

    def check_host(self, workload: Workload, world_size: int, shards: int = 1) -> None:
        """Before launch, on the host that starts the ranks: raise ``ValueError`` naming the shortfall if this
        strategy cannot run here (e.g. not enough shared memory); ``shards``: into how many shards the parallelism
        splits each replica of the state (``Parallelism.shards``)."""

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

    def before_step(self, state: TrainState, position: int) -> int:
        """Before each step: return the position to train from (a strategy recovering in place may take a
        replacement in here and move it); the default changes nothing."""
        return position

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
