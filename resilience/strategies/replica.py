"""Recovery from a live replica instead of a checkpoint, after Swift (Zhong et al., IEEE TPDS 2024) and torchft.

No checkpoint is ever written. In data-parallel training every rank holds a full replica of the model and the
optimizer, so when one rank dies the state is still in its peers' memory. The survivors keep running: their
collective fails, they wait for the supervisor to start a replacement (``resilience.supervise.replacing``), re-form the
process group with it (``resilience.rank.group``), make the replicas consistent, and the replacement receives model and
optimizer state from a healthy replica (``resilience.ckpt.transfer``). Nothing is reloaded from disk and no
step is lost; the cost is the replacement's start-up plus one state transfer. It cannot survive the loss of every
replica at once (then the run fails, and says so).
"""

from __future__ import annotations

import time

from resilience.state import TrainState
from resilience.strategies.base import CheckpointStrategy
from resilience.ckpt.transfer import reconcile


class ReplicaRecovery(CheckpointStrategy):
    saves = False
    recovers_in_place = True

    def _save(self, step: int, state: TrainState) -> None:
        raise AssertionError("replica never saves")

    def _load(self, state: TrainState) -> tuple[int, str, int] | None:
        if self.rt.attempt == 0:
            return None  # the first generation: every rank builds the same initial state from the seed
        # A replacement, in the group its survivors re-formed with it: take the state of a healthy replica.
        done = reconcile(state, None, self.rt.device)
        return done.position, f"replica:{done.source}", done.nbytes

    def recover(self, state: TrainState, position: int, error: BaseException) -> int:
        """A survivor: re-form the group with the replacement, reconcile, go on (see the module docstring)."""
        rt = self.rt
        t0 = time.monotonic()
        rt.events.emit("peer_lost", step=position, error=f"{type(error).__name__}: {error}"[:300], fsync=True)
        generation = rt.group.rejoin(error)  # re-raises if no replacement comes: then this rank fails too
        t_joined = time.monotonic()
        rt.events.attempt = generation  # this process lives on into the new generation (rt.attempt follows)
        state.model = rt.wrap_model(state.model.module)  # the old DDP is bound to the broken group
        state.optimizer.zero_grad(set_to_none=True)  # a backward cut short may have left partial gradients
        done = reconcile(state, position, rt.device)
        rt.events.emit("rejoined", step=done.position, generation=generation, from_step=position,
                       source=f"replica:{done.source}", received=done.received, bytes=done.nbytes,
                       rejoin_s=t_joined - t0, duration_s=time.monotonic() - t0)
        if rt.rank == 0:
            print(f"[rank 0 attempt {generation}] rejoined the group at step {done.position} "
                  f"(state from rank {done.source})", flush=True)
        return done.position
