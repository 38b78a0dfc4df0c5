"""Just-in-time checkpointing after Gupta et al., "Just-In-Time Checkpointing: Low Cost Error Recovery from Deep
Learning Training Failures" (EuroSys'24): no periodic checkpoint; the state is written when a failure is detected.

**At a failure.** A rank's death, a hang made a death by the heartbeat, or a collective timeout surfaces in every
surviving rank as a failed collective (the training loop hands the error to ``recover``). Model and optimizer are
then still the state after the last completed optimizer step: the step in flight failed in its gradient reduction,
before its optimizer step, and its partial gradients are simply not applied. Data-parallel replicas are identical by
construction, so the survivor writes its own replica at once (``jit_files``: one shard file, each tensor streamed
from its memory, summed as written), without a collective (the group is broken), and commits it with this project's
commit record (``commit.CheckpointDir``: files, sizes, checksums, the run's identity) before it re-raises the error
and ends. Under HSDP a survivor holds one shard, which every replica group holds too: each survivor writes its own
shard, and whoever completes the set of shards commits it. Several survivors with the same shard at the same step:
the first to claim it writes it, the others wait for it (and write it themselves if it does not come). Survivors one
step apart (an all-reduce that completed on some ranks and not on others) each write their own step; the restart
loads the newest complete one. Each rank loads its own shard back: the world keeps its size and shape.

**The time to write.** The launcher stops the survivors with SIGTERM, then SIGKILL after its grace period
(``timeouts.shutdown_s``, which ``strategy.grace_s`` follows): the same grace ``checkpoint.on_notice`` saves in. A
rank of this strategy holds SIGTERM (``TermGrace``): while it writes, the signal waits for the write; before it
writes, it waits up to ``strategy.failure_wait_s`` for its own collective to fail (a dead peer's sockets close within
milliseconds; the step's compute before its next collective bounds it), and ends at once if a state at least as new
as its own is already committed (the hung rank of a collective timeout, whose peer wrote before exiting). A signal
is noted by a watching thread, not a Python handler, since the main thread may sit in a collective.

**The whole job's state.** Job-wide parts (LR schedule, scaler, counters) are the same on every replica and go into
the file. A rank's own parts (its RNG streams, its data loader's position: ``train=real``) are on no replica, so
every rank keeps them in its node's shared memory, with a copy on the next node (``jit_parts``), as they
stand at the boundary of the step it trains (before each step, and again after the step's last forward pass: by
then the step has drawn its random numbers and its batches, so that is the state at the next boundary, which a
survivor one step ahead writes). A restarted rank takes its own parts at the loaded step from there; a rank whose
parts are in no memory any more (its node and the next one lost) starts them over, recorded (``jit_parts_lost``).

**No healthy replica.** When every rank died at once (``world_size=1``, a node loss of the whole world, a lost job),
nobody writes: the restart says so (``jit_no_replica``: the step the failed attempt reached, the step it goes on
from, the steps lost) and goes on from the newest state written at an earlier failure, or from the start. It never
waits for a replica that is gone: every wait above is bounded.

Steady state: nothing but a per-step write of a few KB of per-rank parts to shared memory, and only where the loop has
such parts (``train=real``); ``python -m resilience.bench.jit_overhead`` measures it against ``strategy=none``.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

from resilience.caps import StrategyCaps
from resilience.ckpt import node_memory, shm_store
from resilience.ckpt.commit import CheckpointDir
from resilience.ckpt.jit_files import shard_of
from resilience.ckpt.jit_load import JitLoader
from resilience.ckpt.jit_parts import OwnParts, RankParts
from resilience.ckpt.jit_write import JitWriter
from resilience.ckpt.node_memory import NodeMemory
from resilience.proc.term_grace import TermGrace
from resilience.runtime.rank import RankRuntime
from resilience.settings.checks import require_int, require_number
from resilience.state.train import TrainState
from resilience.strategies.base import CheckpointStrategy


class JitCheckpoint(CheckpointStrategy):
    """Writes the last completed step's state from a surviving replica when a collective fails; never before."""

    # under HSDP each survivor writes its own shard (one survivor per shard suffices: the replica groups hold the same
    # shards); each rank loads its shard back, so the world must not change its size or shape in between
    caps = StrategyCaps(family="just-in-time", saves=False, writes_at_failure=True, writes_through_checkpoint_fs=True,
                        shards_state=True, reshards_on_load=False)

    def __init__(self, every: Any, keep: int, grace_s: float = 5.0, failure_wait_s: float = 2.0,
                 ranks_per_node: int = 1) -> None:
        super().__init__(every, keep)  # checkpoint.every does not apply: nothing is saved on an interval
        self.grace_s = require_number("strategy.grace_s", grace_s, above=0)
        self.failure_wait_s = require_number("strategy.failure_wait_s", failure_wait_s, at_least=0)
        if self.failure_wait_s >= self.grace_s:
            raise ValueError(f"strategy.failure_wait_s={failure_wait_s}: must be below strategy.grace_s={grace_s} "
                             f"(timeouts.shutdown_s), or nothing is left of the grace period to write in")
        self.ranks_per_node = require_int("strategy.ranks_per_node", ranks_per_node, 1)
        self._armed = False
        self._grace: TermGrace | None = None
        self._own = OwnParts()  # this rank's own parts: kept each step, taken back at a load
        self._position = 0  # completed optimizer steps, as the loop last said
        self._loaded = 0  # the step this attempt started from
        self._shard = (0, 1)  # (which shard of the state this rank holds, of how many): (0, 1) but under HSDP

    # ---- roles' services ----------------------------------------------------------------------------------------
    def node_memory(self, run_dir: Path) -> NodeMemory:
        """What node_loss wipes: the per-rank parts this run's nodes hold."""
        return NodeMemory(shm_store.run_id(run_dir))

    @classmethod
    def clean_up_run(cls, run_dir: Path) -> None:
        node_memory.cleanup(run_dir)

    def due(self, step: int, total_steps: int) -> bool:
        return False  # no periodic checkpoint: the state is written at a failure (recover)

    def attach(self, rt: RankRuntime) -> None:
        super().attach(rt)
        import resilience.ckpt.dcp_files  # noqa: F401  (its imports now, not in the save at a failure: sync's attach)
        if rt.world_size % self.ranks_per_node:
            raise ValueError(f"strategy.ranks_per_node={self.ranks_per_node}: must divide world_size={rt.world_size}")
        self.dirs = CheckpointDir(rt.ckpt_dir, owner=rt.identity)
        rid = shm_store.run_id(rt.run_dir)
        self.memory = NodeMemory(rid)
        self.node = rt.rank // self.ranks_per_node
        self._own.attach(rt, RankParts(rid, rt.rank, rt.world_size, self.ranks_per_node, self.memory))
        self._writer = JitWriter(rt, self.dirs, self.keep, wait_s=self.grace_s - self.failure_wait_s)
        self._loader = JitLoader(rt, self.dirs, self._reject)

    # ---- steady state -------------------------------------------------------------------------------------------
    def before_step(self, state: TrainState, position: int) -> int:
        """Arm once (in the main thread: the SIGTERM grace, the forward hook), then keep this rank's own parts as they
        stand at this step's boundary, unless the last forward pass kept them already."""
        if not self._armed:
            self._arm(state)
        self._position = position
        self._own.before_step(state, position)
        return position

    def _arm(self, state: TrainState) -> None:
        self._armed = True
        self._shard = shard_of(state)
        if self.rt.world_size > 1:  # alone, no collective of this rank can fail: nothing to hold SIGTERM for
            self._grace = TermGrace(self.failure_wait_s, self._superseded)
            self._grace.install()
        self._own.arm(state)

    def _superseded(self) -> bool:
        """Whether a state at least as new as this rank's is committed (a SIGTERM then ends it at once)."""
        with contextlib.suppress(OSError):
            newest = self.dirs.newest_committed()
            return newest is not None and newest.step >= self._position
        return False

    def close(self) -> None:
        self._own.close()
        if self._grace is not None:
            self._grace.close()
            self._grace = None
        self._armed = False

    def _save(self, step: int, state: TrainState) -> None:
        raise AssertionError("strategy=jit saves only at a failure (recover), never on an interval")

    # ---- at a failure ---------------------------------------------------------------------------------------------
    def recover(self, state: TrainState, position: int, error: BaseException) -> int:
        """A collective failed after ``position`` completed steps: write this replica's state of that step, commit
        it, then fail as every restarting strategy does (re-raise ``error``)."""
        t0 = time.monotonic()
        if self._grace is not None:
            self._grace.writing()  # the launcher's SIGTERM waits for the write from here on
        self._own.failed()
        try:
            self._writer.write(state, position, self._loaded, self._shard, error, t0)
        except Exception as exc:  # never hide the collective's error behind the write's
            self.rt.events.emit("jit_unsaved", step=position, reason=f"{type(exc).__name__}: {exc}"[:500], fsync=True)
        raise error

    # ---- after a restart ----------------------------------------------------------------------------------------
    def _load(self, state: TrainState) -> tuple[int, str, int] | None:
        """The newest committed state written at a failure that every rank reads intact (rank 0 picks, all verify,
        all agree before any tensor is touched); then each rank's own parts from its node's memory."""
        self.memory.revive(self.node)  # a new attempt: this node is back, with whatever its memory still holds
        loaded = self._loader.newest(state)
        step = loaded[0] if loaded else 0
        self._own.take(state, step)
        if self.rt.rank == 0:
            self._loader.settle(step)
        self._loaded = self._position = step
        return loaded
