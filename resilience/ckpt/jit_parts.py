"""A rank's own parts of the job's state under just-in-time checkpointing (``strategy=jit``): its RNG streams and data
loader position, which are on no replica, kept step by step in its node's shared memory with a copy on the next node,
and taken back after a restart.

**Where** (``RankParts``): every rank keeps its own, as they stand at a step's boundary, in a small file of its node's
shared memory (``/dev/shm``: it outlives the rank's process, as the in-memory strategy's areas do) and a copy in the
next node's (which ``node_loss`` does not take with it). Two slots by the step's parity: the state at the step being
trained and at the one before, each written whole and renamed into place (never torn), with a checksum. Names follow
``shm_store.area_path``, so the run's clean-up and a node's loss (``node_memory``) find them as they find areas.

**When** (``OwnParts``): before each step, and again after the step's last forward pass: by then the step has drawn
its random numbers and its batches, so that is the state at the next boundary, which a survivor one step ahead
writes. A restarted rank takes its own parts at the loaded step from there; a rank whose parts are in no memory any
more (its node and the next one lost) starts them over, recorded (``jit_parts_lost``).
"""

from __future__ import annotations

import pickle
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from resilience.ckpt import sealed
from resilience.ckpt.node_memory import NodeMemory
from resilience.ckpt.shm_store import area_path
from resilience.runtime.rank import RankRuntime
from resilience.state.train import TrainState

PARTS_MAGIC = b"RBPRT01\0"


class RankParts:
    """One rank's own parts of the job's state at a step (``{name: part.state_dict()}``, pickled as they are: a
    fifth of ``torch.save``'s cost, which a per-step copy would pay), in its node's shared memory and in a copy on
    the next node (``ranks_per_node`` apart; none when every rank is on one node). ``put`` keeps the two latest
    steps (slot = step % 2); ``get`` finds a step in the own copy, else the peer's."""

    def __init__(self, rid: str, rank: int, world_size: int, ranks_per_node: int, memory: NodeMemory) -> None:
        self.rid, self.rank, self.rpn, self.memory = rid, rank, ranks_per_node, memory
        self.node = rank // ranks_per_node
        holder = (rank + ranks_per_node) % world_size
        self.peer = holder if holder // ranks_per_node != self.node else None

    def _path(self, holder: int, slot: int) -> Path:
        path = area_path(self.rid, holder // self.rpn, holder, self.rank)
        return path.with_name(f"{path.name}-parts{slot}")

    def put(self, step: int, attempt: int, parts: dict[str, Any]) -> int:
        """Keep ``parts`` as the state at ``step``; return the bytes of one copy."""
        payload = pickle.dumps(parts, protocol=pickle.HIGHEST_PROTOCOL)
        seal = sealed.head(PARTS_MAGIC, step, attempt, payload)
        nbytes = sealed.write_whole(self._path(self.rank, step % 2), seal, payload)
        if self.peer is not None and not self.memory.lost(self.peer // self.rpn):  # a lost node holds nothing
            sealed.write_whole(self._path(self.peer, step % 2), seal, payload)
        return nbytes

    def get(self, step: int) -> tuple[dict[str, Any], str] | None:
        """The parts at ``step`` and where they were (``memory``: own node, ``peer_memory``), or None."""
        for holder, where in ((self.rank, "memory"), (self.peer, "peer_memory")):
            if holder is None:
                continue
            found = _read_parts(self._path(holder, step % 2), step)
            if found is not None:
                return found, where
        return None


def _read_parts(path: Path, step: int) -> dict[str, Any] | None:
    found = sealed.read(path, PARTS_MAGIC)
    if found is None or found[0] != step:
        return None  # none, another step's, or wiped (a node loss zeroes the file before it goes)
    return pickle.loads(found[2])


class OwnParts:
    """When this rank keeps its own parts (each step's boundary) and takes them back (after a load); what keeping them
    cost this attempt (``jit_parts_kept``). Nothing where the loop has no such parts (the replayable loop)."""

    def __init__(self) -> None:
        self._rank_parts: RankParts | None = None
        self._parts: RankParts | None = None  # where they are kept, once armed with a loop that has some
        self._hook: Any = None
        self._captured: int | None = None  # the step whose boundary the own parts were last kept at
        self._training: int | None = None  # the step in flight (its position), between before_step and the next
        self._kept, self._kept_s, self._kept_bytes = 0, 0.0, 0  # own parts kept this attempt: times, seconds, size
        self._kept_failed = False  # a keep failed (said once)
        self._forwards = 0  # forward passes in the step in flight
        self._per_step: int | None = None  # forward passes a step makes (None: not learnt yet; 0: it varies)

    def attach(self, rt: RankRuntime, rank_parts: RankParts) -> None:
        self.rt, self._rank_parts = rt, rank_parts

    def arm(self, state: TrainState) -> None:
        """From the main thread, before the first step: hook the model's forward pass."""
        if state.parts.per_rank:  # the replayable loop has none: nothing to keep, nothing to hook
            self._parts = self._rank_parts
            self._hook = state.model.register_forward_hook(lambda *_: self._after_forward(state))

    def before_step(self, state: TrainState, position: int) -> None:
        """Keep the parts as they stand at this step's boundary, unless the last forward pass kept them already."""
        if self._forwards:  # the step before ran this many forward passes: the last one is where to keep the parts
            self._per_step = self._forwards if self._per_step in (None, self._forwards) else 0  # 0: it varies
        self._training, self._forwards = position, 0
        if self._parts is not None and self._captured != position:
            self._keep(state, position)

    def failed(self) -> None:
        """The step in flight failed: no forward pass of it keeps parts any more."""
        self._training = None

    def _after_forward(self, state: TrainState) -> None:
        """After the step's last forward pass its batches are drawn and its random numbers used: the parts are those
        of the next boundary. Which pass is the last is learnt from the step before (micro-batches: one per pass);
        until then, or where the count varies, the parts are kept after every pass (the last one stays)."""
        if self._training is None:
            return
        self._forwards += 1
        if not self._per_step or self._forwards == self._per_step:
            self._keep(state, self._training + 1)

    def _keep(self, state: TrainState, step: int) -> None:
        t0 = time.perf_counter()
        mine = {name: part.state_dict() for name, part in state.parts.per_rank.items()}
        try:
            self._kept_bytes = self._rank_parts.put(step, self.rt.attempt, mine)
            self._captured = step
            self._kept += 1
            self._kept_s += time.perf_counter() - t0
        except OSError as exc:  # /dev/shm full: training goes on, a recovery will say what it lacks (said once)
            if not self._kept_failed:
                self._kept_failed = True
                why = f"per-rank parts: {type(exc).__name__}: {exc}"[:300]
                self.rt.events.emit("jit_unsaved", step=step, reason=why)

    def take(self, state: TrainState, step: int) -> None:
        """This rank's RNG streams and data position at ``step``, from its node's memory (or the next node's copy);
        the ranks that found none are named once (``jit_parts_lost``) and start theirs over."""
        if not state.parts.per_rank or step == 0:
            return  # nothing per rank, or the start: the fresh parts are the start's
        found = self._rank_parts.get(step)
        if found is not None:
            for name, part_state in found[0].items():
                state.parts.per_rank[name].load_state_dict(part_state)
        lost: list[Any] = [None] * self.rt.world_size
        dist.all_gather_object(lost, None if found is not None else sorted(state.parts.per_rank))
        if self.rt.rank == 0 and any(lost):
            missing = {r: parts for r, parts in enumerate(lost) if parts}
            self.rt.events.emit("jit_parts_lost", step=step, ranks=sorted(missing),
                                parts=sorted({p for ps in missing.values() for p in ps}), fsync=True)
            print(f"[rank 0 attempt {self.rt.attempt}] the own parts of rank(s) {sorted(missing)} at step {step} "
                  f"are in no node's memory: they start over (this recovery is not exact)", flush=True)

    def close(self) -> None:
        if self._kept:  # the steady state's one cost: what keeping the own parts took this attempt
            self.rt.events.emit("jit_parts_kept", count=self._kept, duration_s=self._kept_s, bytes=self._kept_bytes)
            self._kept, self._kept_s = 0, 0.0
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
