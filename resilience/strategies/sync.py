"""Synchronous checkpointing through ``torch.distributed.checkpoint`` (DCP): training waits until it is durable.

This is what most training stacks do by default and the baseline of every comparison. Each rank writes its
share of the (deduplicated) state, rank 0 writes DCP's metadata, then rank 0 commits (``commit.CheckpointDir``).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader, FileSystemWriter

from resilience.runtime import PhaseHook
from resilience.state import TrainState
from resilience.strategies.base import CheckpointStrategy
from resilience.ckpt.checksum import ChecksumFileSystem
from resilience.ckpt.commit import CheckpointDir, CheckpointEntry


class HookedWriter(FileSystemWriter):
    """DCP's file writer, calling the ``during_checkpoint`` phase hook once this rank's shard is written.

    At that point the shard is on disk but the checkpoint is not committed and peers may still be writing:
    the moment a crash in the middle of a save is most likely to leave a half-written checkpoint behind.
    """

    def __init__(self, path, hook: PhaseHook, step: int, fs: Any = None) -> None:
        super().__init__(path, sync_files=True)
        self._hook, self._step = hook, step
        self.fs = ChecksumFileSystem(fs)  # over a disk fault's I/O layer, if any

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        future.wait()
        self.fs.write_sidecar(self.path, dist.get_rank() if dist.is_initialized() else 0)
        self._hook("during_checkpoint", self._step)
        return future


class SyncCheckpoint(CheckpointStrategy):

    def writes_through_checkpoint_fs(self) -> bool:
        return True

    def attach(self, rt) -> None:
        super().attach(rt)
        self.dirs = CheckpointDir(rt.ckpt_dir, owner=rt.identity)

    def _save(self, step: int, state: TrainState) -> None:
        rt = self.rt
        if rt.rank == 0:
            path = self.dirs.prepare(step)
        dist.barrier()  # nobody writes into the directory before rank 0 has emptied it
        path = self.dirs.path_for(step)
        try:
            dcp.save(state.state_dict(), storage_writer=HookedWriter(path, rt.fault_hook, step, rt.ckpt_fs))
        except (OSError, CheckpointException) as exc:
            # DCP gathers every rank's write result, so all ranks see a disk failure and none commits: the
            # checkpoint is lost, not corrupt, and training goes on. (A peer's death is not caught here: the
            # collective error propagates and the rank fails, as it must.)
            rt.events.emit("ckpt_failed", step=step, error=f"{type(exc).__name__}: {exc}"[:500], fsync=True)
            rt.events.emit("ckpt_stall_end", step=step)
            return
        if rt.rank == 0:
            nbytes = self.dirs.commit(step)
            rt.events.emit("ckpt_durable", step=step, bytes=nbytes, path=str(path), fsync=True)
            for pruned in self.dirs.prune(self.keep):
                rt.events.emit("ckpt_pruned", step=pruned)
        rt.events.emit("ckpt_stall_end", step=step)

    def agreed_entry(self) -> CheckpointEntry | None:
        """The checkpoint every rank loads: rank 0 chooses and everyone follows (all must restore the same step)."""
        choice = [None]
        if self.rt.rank == 0:
            entry = self.choose()
            choice = [entry.step if entry else None]
        dist.broadcast_object_list(choice, src=0)
        if choice[0] is None:
            return None
        return next(e for e in self.dirs.entries() if e.step == choice[0] and e.committed)

    def _load(self, state: TrainState) -> tuple[int, str, int] | None:
        entry = self.agreed_entry()
        if entry is None:
            return None
        sd = state.state_dict()
        reader = FileSystemReader(entry.path)
        if self.rt.ckpt_fs is not None:
            reader.fs = self.rt.ckpt_fs
        dcp.load(sd, storage_reader=reader)
        state.load_state_dict(sd)
        return entry.step, "disk", self.dirs.size(entry)

    def choose(self) -> CheckpointEntry | None:
        """The newest committed checkpoint within the rollback bound that passes ``CheckpointDir.check`` (this
        run's, complete, intact); every one passed over is recorded with the reason."""
        rt = self.rt
        newest = self.dirs.newest_committed()
        for bad in self.dirs.incomplete_after(newest.step if newest else -1):
            rt.events.emit("ckpt_incomplete", step=bad.step, path=str(bad.path))
        candidates = [e for e in self.dirs.entries()
                      if e.committed and (rt.load_max_step is None or e.step <= rt.load_max_step)]
        for entry in reversed(candidates):
            reason = self.dirs.check(entry)
            if reason is None:
                return entry
            rt.events.emit("ckpt_rejected", step=entry.step, path=str(entry.path), reason=reason, fsync=True)
            if rt.ckpt_rejected is not None:
                rt.ckpt_rejected(entry.step, entry.path, reason)
        return None
