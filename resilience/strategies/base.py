"""The checkpoint strategy interface.

``save`` and ``load`` hold the shared policy (is a checkpoint due? is there anything to load?) and the events that
every metric is computed from; subclasses fill in ``_save`` and ``_load`` and cannot bypass either by accident.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from pathlib import Path

from resilience.caps import Named, StrategyCaps
from resilience.settings.checks import require_int
from resilience.strategies.interval import Interval, interval_of
from resilience.runtime.pipeline import StepRunner
from resilience.runtime.rank import AgentService, NodeMemory, RankRuntime
from resilience.state.train import RestorePoint, TrainState
from resilience.workloads.base import Workload

if TYPE_CHECKING:
    from resilience.ckpt.commit import CheckpointEntry


class CheckpointStrategy(Named, ABC):
    """Saves training state every ``every`` steps and restores the newest good one after a restart."""

    caps = StrategyCaps()  # what it does, for the table of rules (resilience.compat): readable without building it
    _stalled: int | None = None  # the step whose save has begun and not yet ended its stall (``end_stall``)
    _stall_s: float | None = None  # how long the last save's stall was (None: that save was skipped)
    # a save on a preemption's notice: the job is ending, so a strategy that writes only some saves to disk (the
    # others to memory, which dies with the job) writes this one
    on_notice: bool = False

    def __init__(self, every: int | str | Interval, keep: int) -> None:
        # checkpoint.every: an integer, or auto (resilience.strategies.interval: chosen from the measured costs)
        self.interval = every if isinstance(every, Interval) else interval_of(every, None)
        self.keep = require_int("checkpoint.keep", keep, 1)
        self.rt: RankRuntime | None = None
        self._stall_began = 0.0

    @property
    def every(self) -> int:
        """The interval in force (``checkpoint.every=auto``: the one chosen last)."""
        return self.interval.every

    def node_memory(self, run_dir: Path) -> NodeMemory | None:
        """The service this strategy provides to the rank's runtime: what its nodes hold in memory (None: nothing)."""
        return None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = {"_save", "_load", "load"} & set(vars(cls))
        if own and "caps" not in vars(cls):  # a way of its own to save or load: its parent's record may not hold
            raise TypeError(f"{cls.__name__}: saves or loads in a way of its own ({', '.join(sorted(own))}); "
                            f"declare what it can do: caps = StrategyCaps(...)")

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
        self.interval.attach(rt)
        self._rejected: set[int] = set()  # checkpoints passed over in this attempt (a load may try again)

    def attach_runner(self, runner: StepRunner | None) -> None:
        """The step runner of a pipeline's stage (None: not pipelined), once per attempt after ``attach``: a
        strategy that logs what the stage sends, or replays a stage, keeps it (swift_log); the others ignore it."""

    def _reject(self, entry: CheckpointEntry, reason: str) -> None:
        """Pass over ``entry`` for the rest of this attempt, recorded with why (and told to the rank's report)."""
        self._rejected.add(entry.step)
        self.rt.events.emit("ckpt_rejected", step=entry.step, path=str(entry.path), reason=reason, fsync=True)
        if self.rt.ckpt_rejected is not None:
            self.rt.ckpt_rejected(entry.step, entry.path, reason)

    def due(self, step: int, total_steps: int) -> bool:
        """A checkpoint is due after every ``every``-th step (or as ``checkpoint.every=auto`` chose); the final state
        is not checkpointed (the run ends). Called at the end of every step."""
        return self.caps.saves and self.interval.due(step, total_steps)

    def save(self, step: int, total_steps: int, state: TrainState) -> None:
        """Checkpoint ``state`` (the state after ``step`` optimizer steps) if one is due."""
        if self.due(step, total_steps):
            self._checkpoint(step, state)

    def save_now(self, step: int, state: TrainState) -> None:
        """Checkpoint ``state`` now, off the interval (a preemption's notice: ``resilience.rank.notice``), as a due
        save does, and to disk (``on_notice``); a strategy that never saves does nothing."""
        if self.caps.saves:
            self.on_notice = True
            try:
                self._checkpoint(step, state)
            finally:
                self.on_notice = False

    def _checkpoint(self, step: int, state: TrainState) -> None:
        self.rt.events.emit("ckpt_begin", step=step)
        self._stalled, self._stall_began, self._stall_s = step, time.monotonic(), None
        self._save(step, state)
        self.end_stall(step)  # training goes on now, unless the strategy said so earlier (or skipped the save)
        if not self.on_notice:  # a notice's save is off the interval (and the job ends)
            self.interval.saved(step, self._stall_s)  # None: skipped (when_busy=skip), no stall to sample

    def end_stall(self, step: int, **fields: Any) -> None:
        """Record that training may go on after the save of ``step`` (``ckpt_stall_end``), once per save: ``save``
        calls it when ``_save`` returns; a strategy whose stall ends earlier (it then starts its background
        persist) calls it at that point, with any fields of its own."""
        if self._stalled == step:
            self._stalled, self._stall_s = None, time.monotonic() - self._stall_began
            self.rt.events.emit("ckpt_stall_end", step=step, **fields)

    def skip_stall(self) -> None:
        """The save that began took no checkpoint (``when_busy=skip``): it records no end of a stall."""
        self._stalled = None

    def load(self, state: TrainState) -> int:
        """Restore the newest good checkpoint into ``state``; return its step (0: nothing to load, start fresh).

        When nothing is loaded (every checkpoint rejected, or none), or the load fails, ``state`` is put back as
        it was: a rejected checkpoint leaves no trace in the training that follows."""
        point = RestorePoint(state)
        t0 = time.monotonic()
        try:
            loaded = self._load(state)
        except BaseException:
            point.restore()
            raise
        if loaded is None:
            point.restore()
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

    def hand_over(self, state: TrainState, position: int, leaving: list[int]) -> int:
        """Ranks ``leaving`` end on their node's maintenance notice after ``position`` steps: take their
        replacements into a new group, give them the state, return the position to go on from. Only a strategy
        that recovers in place does (the table of rules refuses fault=drain with any other)."""
        raise NotImplementedError(f"strategy={self.name} cannot hand ranks over to spares")

    def wait(self) -> None:
        """Block until every save started so far is durable; re-raise a failure of a background save."""

    def close(self) -> None:
        """Release what the strategy holds (threads, memory)."""

    @abstractmethod
    def _save(self, step: int, state: TrainState) -> None:
        """Write the checkpoint for ``step``; on rank 0 emit ``ckpt_durable`` once it is committed (``save`` ends
        the stall when this returns: see ``end_stall``)."""

    @abstractmethod
    def _load(self, state: TrainState) -> tuple[int, str, int] | None:
        """Load the newest good checkpoint; return (step, source, bytes read) or None when there is none."""
