"""What a restart under just-in-time checkpointing (``strategy=jit``) loads: the newest committed state written at a
failure that every rank reads intact, each rank its own shard (the world keeps its size and shape); and, on rank 0,
what the failure cost: states of an abandoned timeline dropped, and the steps lost when no healthy replica was left
to write them (``jit_no_replica``).
"""

from __future__ import annotations

import shutil
from typing import Any, Callable

import torch.distributed as dist

from resilience.ckpt.codec import restore, snapshot_state, tensor_leaves
from resilience.ckpt.commit import CheckpointDir, CheckpointEntry
from resilience.ckpt.digest import for_record
from resilience.ckpt.jit_files import read_shard, shard_name, shard_of
from resilience.ckpt.snapshot import is_sharded
from resilience.ckpt.verified import CorruptFile, read_verified
from resilience.record.events import read_events
from resilience.runtime.rank import RankRuntime
from resilience.state.train import TrainState


class JitLoader:
    """The newest state written at a failure, agreed and verified by every rank; what a restart lost, said once."""

    def __init__(self, rt: RankRuntime, dirs: CheckpointDir, reject: Callable[[CheckpointEntry, str], None]) -> None:
        # reject: how the strategy passes over a checkpoint for the rest of the attempt (recorded with why)
        self.rt, self.dirs, self._reject = rt, dirs, reject

    def newest(self, state: TrainState) -> tuple[int, str, int] | None:
        """Restore the newest committed state that every rank reads intact (rank 0 picks, all verify, all agree
        before any tensor is touched): (step, source, bytes), or None when there is none."""
        rt = self.rt
        rejected: set[int] = set()
        loaded = None
        while (entry := self._agreed_entry(rejected)) is not None:
            buf, reason = None, None
            try:
                buf = self._read_verified(entry, state)
            except (OSError, KeyError, ValueError) as exc:
                reason = str(exc) if isinstance(exc, CorruptFile) else f"{type(exc).__name__}: {exc}"[:300]
            reasons: list[Any] = [None] * rt.world_size
            dist.all_gather_object(reasons, reason)
            bad = [f"rank {r}: {why}" for r, why in enumerate(reasons) if why]
            if bad:
                rejected.add(entry.step)
                if rt.rank == 0:
                    self._reject(entry, "; ".join(bad))
                continue
            if not state.optimizer.state and any(is_sharded(p) for p in state.model.parameters()):
                state.state_dict()  # creates the optimizer's sharded state (as sync's load does), to read shards into
            live = tensor_leaves(snapshot_state(state))  # read in place where the model already holds the tensor
            restore(state, read_shard(buf, live))
            loaded = (entry.step, "jit", len(buf))
            del buf
            break
        return loaded

    def settle(self, step: int) -> None:
        """Rank 0, once the ranks go on from ``step``: drop any newer state, and say what the failure lost."""
        self._drop_newer(step)
        self._say_what_was_lost(step)

    def _agreed_entry(self, rejected: set[int]) -> CheckpointEntry | None:
        choice: list[Any] = [None]
        if self.rt.rank == 0:
            bound = self.rt.load_max_step
            for entry in reversed(self.dirs.entries()):
                if not entry.committed or entry.step in rejected or (bound is not None and entry.step > bound):
                    continue
                reason = self.dirs.check(entry, checksums=False)  # the sums are checked as the ranks read
                if reason is None:
                    choice = [entry.step]
                    break
                rejected.add(entry.step)
                self._reject(entry, reason)
        dist.broadcast_object_list(choice, src=0)
        if choice[0] is None:
            return None
        return CheckpointEntry(choice[0], self.dirs.path_for(choice[0]), True)

    def _read_verified(self, entry: CheckpointEntry, state: TrainState) -> memoryview:
        """This rank's shard file, checked against the commit record on the way in."""
        record = self.dirs.manifest(entry)
        digest, sums = for_record(record)
        name = shard_name(*shard_of(state))
        return read_verified(self.rt.ckpt_fs, entry.path / name, record["files"][name], sums[name], digest)

    def _drop_newer(self, step: int) -> None:
        """States newer than the one training goes on from belong to an abandoned timeline (a rollback's bound)."""
        for entry in self.dirs.entries():
            if entry.step > step:
                shutil.rmtree(entry.path, ignore_errors=True)
                self.rt.events.emit("ckpt_pruned", step=entry.step)

    def _say_what_was_lost(self, step: int) -> None:
        """Rank 0, after a restart: when the failed attempt got further than the state loaded and no survivor
        committed its last step (or the one before: the step in flight), no healthy replica was left: say so (the
        steps are lost, the run goes on from ``step``)."""
        rt = self.rt
        if rt.load_max_step is not None:
            return  # a rollback's bound: going back is what was asked
        ranks = [e for e in read_events(rt.run_dir) if e.get("rank") is not None and e["attempt"] < rt.attempt]
        if not ranks:
            return
        last = max(e["attempt"] for e in ranks)
        mine = [e for e in ranks if e["attempt"] == last]
        reached = max((e["step"] for e in mine if e["kind"] in ("step_end", "ckpt_loaded")), default=0)
        committed = [e["step"] for e in mine if e["kind"] == "jit_saved" and e.get("committed")]
        if reached <= step or any(w >= reached - 1 for w in committed):
            return  # nothing lost, or a survivor committed it (a load that passed over it says why: ckpt_rejected)
        why = ("one rank alone has no replica to write it (world_size=1)" if rt.world_size == 1 else
               "no survivor committed it: every replica was lost at once, or a write was cut short by the launcher's "
               "grace (timeouts.shutdown_s)")
        rt.events.emit("jit_no_replica", step=step, reached=reached, lost_steps=reached - step, reason=why, fsync=True)
        print(f"[rank 0 attempt {rt.attempt}] no healthy replica wrote the state of step {reached}: {why}; going on "
              f"from step {step} ({reached - step} steps lost)", flush=True)
