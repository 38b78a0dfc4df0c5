"""Two-phase asynchronous checkpointing after CheckFreq (Mohan, Phanishayee, Chidambaram; USENIX FAST'21).

Phase 1, *snapshot*: between two optimizer steps, each rank copies its share of the state into reused host
buffers (``snapshot.HostSnapshot``). This is the only time training waits; ``ckpt_stall_end`` follows it.
Phase 2, *persist*: a background thread writes the snapshot in DCP's format and commits it exactly as ``sync``
does (``commit.CheckpointDir``: COMMIT.json renamed into place), then rank 0 emits ``ckpt_durable``.

Consistency: a snapshot is taken while no optimizer step runs, and its buffers are rewritten only by the next
snapshot, which never starts while a persist is in flight (one at a time). When a checkpoint comes due during a
persist, ``when_busy`` decides: ``wait`` for it (the wait is part of the stall) or ``skip`` this checkpoint
(``ckpt_skipped``; all ranks agree, since a persist is a collective operation).

The background writer's collectives (DCP's planning and result gathering) run on a gloo process group of its own,
created at ``attach`` on every rank in the same order, so that they never interleave with the training loop's
collectives on the default group.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import replace

from resilience.ckpt.reused import ReusedStateDict
from resilience.ckpt.snapshot import HostSnapshot, is_sharded, layout_state_dict
from resilience.runtime.rank import RankRuntime
from resilience.state.train import TrainState
from resilience.strategies.background import BackgroundCheckpoint, write_checkpoint


class AsyncCheckpoint(BackgroundCheckpoint):
    """CheckFreq's snapshot-then-persist, with a persist thread and reused host buffers."""

    option = "async"  # the module cannot be called async.py: a Python keyword
    # the snapshot holds each rank's own shards, which DCP writes as such (snapshot.py)
    caps = replace(BackgroundCheckpoint.caps, shards_state=True)

    def attach(self, rt: RankRuntime) -> None:
        super().attach(rt)
        self.snapshot = HostSnapshot(rt.rank, rt.world_size)
        self._reused = ReusedStateDict()  # the state dict's names built once, not at every stall

    def load(self, state: TrainState) -> int:
        """Load as ``sync`` does, then allocate the snapshot buffers, so that no checkpoint pays for that. An
        optimizer without state yet (Adam before its first step) is not stepped: its layout comes from a copy on
        the meta device (``layout_state_dict``). A sharded model cannot be copied so (its parameters are
        ``DTensor``s on a device mesh): there a fresh run's first snapshot allocates (``allocated_bytes``)."""
        step = super().load(state)
        t0 = time.monotonic()
        if state.optimizer.state:  # state_dict() would step a fresh optimizer (TrainState)
            layout = state.state_dict()
        elif not any(is_sharded(p) for p in state.model.parameters()):
            layout = layout_state_dict(state.model, state.optimizer)
        else:
            return step
        nbytes = self.snapshot.reserve(layout)
        self.rt.events.emit("snapshot_reserved", bytes=nbytes, duration_s=time.monotonic() - t0)
        return step

    def before_step(self, state: TrainState, position: int) -> int:
        if not self.snapshot.captured and self._pending is None and state.optimizer.state:
            # Once, after the first optimizer step and before any capture of this process (so that no persist reads
            # the buffers): the state dict built and a first copy made, outside any stall, as the buffers are
            # reserved at load. Measured on gpt_small: the first capture paid 14 ms, the later ones 5-6 ms.
            self.snapshot.capture(self._reused.of(state))
        return super().before_step(state, position)

    def _start(self, step: int, state: TrainState) -> Future:
        sd = self._reused.of(state)
        snap = self.snapshot.capture(sd, same_tensors=not self._reused.rebuilt)
        self.end_stall(step, snapshot_bytes=self.snapshot.nbytes, allocated_bytes=self.snapshot.allocated)
        done: Future = Future()
        work = lambda: write_checkpoint(self.rt, self.dirs, step, snap, self.keep, self.group)  # noqa: E731
        threading.Thread(target=self._run_persist, args=(step, done, work), name=f"persist-{step}",
                         daemon=True).start()  # daemon: a dying rank must not wait for its writer
        return done
