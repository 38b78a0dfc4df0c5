"""Synchronous checkpointing through ``torch.distributed.checkpoint`` (DCP): training waits until it is durable.

This is what most training stacks do by default and the baseline of every comparison. Each rank writes its
share of the (deduplicated) state, rank 0 writes DCP's metadata, then rank 0 commits (``commit.CheckpointDir``).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from resilience.caps import StrategyCaps
from resilience.runtime.rank import PhaseHook, RankRuntime
from resilience.state.parts import require_parts
from resilience.state.train import TrainState
from resilience.strategies.base import CheckpointStrategy
from resilience.ckpt.commit import CheckpointDir, CheckpointEntry
from resilience.ckpt.digest import for_record
from resilience.ckpt.snapshot import flat_tensors, is_sharded
from resilience.ckpt.verified import CorruptFile, read_verified


DATA_SUFFIX = ".distcp"  # DCP's data files; the others (its .metadata) are small and every rank reads them


def is_sharded_state(sd: dict) -> bool:
    """Whether a state dict holds ``DTensor`` shards (``parallel=fsdp|hsdp``)."""
    return any(is_sharded(t) for t, _ in flat_tensors(sd).values())


class SyncCheckpoint(CheckpointStrategy):
    # DCP writes each rank's DTensor shards through the checkpoint file system and reshards them on load; a negative
    # control is no technique of any family (the report's choices never include it)
    caps = StrategyCaps(family="blocking", writes_through_checkpoint_fs=True, shards_state=True,
                        reshards_on_load=True, saves_stages=True, when={"negative_control=True": {"family": None}})

    def __init__(self, every: int, keep: int, parts: Any = "all", negative_control: bool = False) -> None:
        super().__init__(every, keep)
        # the job's parts it saves besides model and optimizer: all, or the listed ones (the negative controls
        # sync_model_only and sync_no_rng save fewer, as many hand-rolled loops do: the check must catch it)
        self.parts = None if parts == "all" else require_parts("strategy.parts", parts)
        self.caps = self.caps.under(negative_control=negative_control)

    def attach(self, rt: RankRuntime) -> None:
        super().attach(rt)
        # DCP's I/O (0.4-0.8 s of imports) now, before the first step: imported at the top of this module it would
        # cost the supervisor, which builds this class to validate a run, and in the first save it would be stall
        import resilience.ckpt.dcp_files  # noqa: F401
        self.dirs = CheckpointDir(rt.ckpt_dir, owner=rt.identity)
        self._reported: set[int] = set()

    def _save(self, step: int, state: TrainState) -> None:
        rt = self.rt
        if rt.rank == 0:
            path = self.dirs.prepare(step)
        dist.barrier()  # nobody writes into the directory before rank 0 has emptied it
        path = self.dirs.path_for(step)
        from resilience.ckpt import dcp_files  # on a rank only: the supervisor builds this class without DCP

        try:
            dcp_files.save(state.state_dict(self.parts), dcp_files.HookedWriter(path, rt.fault_hook, step, rt.ckpt_fs))
        except dcp_files.SAVE_ERRORS as exc:
            # DCP gathers every rank's write result, so all ranks see a disk failure and none commits: the
            # checkpoint is lost, not corrupt, and training goes on. (A peer's death is not caught here: the
            # collective error propagates and the rank fails, as it must.)
            rt.events.emit("ckpt_failed", step=step, error=f"{type(exc).__name__}: {exc}"[:500], fsync=True)
            return
        if rt.rank == 0:
            nbytes = self.dirs.commit(step)
            rt.events.emit("ckpt_durable", step=step, bytes=nbytes, path=str(path), fsync=True)
            for pruned in self.dirs.prune(self.keep):
                rt.events.emit("ckpt_pruned", step=pruned)

    def agreed_entry(self, checksums: bool = True) -> CheckpointEntry | None:
        """The checkpoint every rank loads: rank 0 chooses and everyone follows (all must restore the same step).
        ``checksums=False``: the checksums are left to the load, which verifies as it reads."""
        choice = [None]
        if self.rt.rank == 0:
            entry = self.choose(checksums)
            choice = [entry.step if entry else None]
        dist.broadcast_object_list(choice, src=0)
        if choice[0] is None:
            return None
        return next(e for e in self.dirs.entries() if e.step == choice[0] and e.committed)

    def _load(self, state: TrainState) -> tuple[int, str, int] | None:
        """The newest checkpoint whose every file that a rank reads passes its checksum on that rank, read once
        (``verified``)."""
        from resilience.ckpt import dcp_files

        while (entry := self.agreed_entry(checksums=False)) is not None:
            sd = state.state_dict(self.parts)
            buffers = self._read_verified(entry, sd)
            if buffers is not None:
                dcp_files.load(sd, entry.path, buffers)
                state.load_state_dict(sd)
                return entry.step, "disk", self.dirs.size(entry)
        return None

    def _read_verified(self, entry: CheckpointEntry, sd: dict) -> dict[str, memoryview] | None:
        """The files of ``entry`` that loading ``sd`` reads, in memory, each checked against its checksum, or None
        when any rank found one bad (rank 0 then records the rejection and the next ``agreed_entry`` passes over
        it). No rank fails alone: all decide together, before any tensor is touched.

        Replicas (DDP) read every file. A sharded rank (FSDP), or a pipeline's stage, reads only the files holding
        pieces of its shards or its stage: DCP's metadata first, then the files its load plan names
        (``dcp_files.planned_files``); DCP cannot open any other file of ``MemoryFiles``, so a wrong plan fails loudly
        instead of reading unverified bytes."""
        record = self.dirs.manifest(entry) if self.rt.rank == 0 else None
        shared = [record]
        dist.broadcast_object_list(shared, src=0)  # what rank 0 checked is what every rank verifies
        record = shared[0]
        buffers, reason = {}, None
        try:
            buffers = self.read_own(entry, sd, record)
        except (OSError, KeyError, ValueError) as exc:  # ValueError: a checksum algorithm this code does not know
            reason = str(exc) if isinstance(exc, CorruptFile) else f"{type(exc).__name__}: {exc}"[:300]
        reasons: list = [None] * self.rt.world_size
        dist.all_gather_object(reasons, reason)
        bad = [f"rank {r}: {why}" for r, why in enumerate(reasons) if why]
        if not bad:
            self.rt.events.emit("ckpt_read_verified", step=entry.step, files=len(buffers), of_files=len(record["files"]),
                                bytes=sum(len(b) for b in buffers.values()))
            return buffers
        if self.rt.rank == 0:
            self._reject(entry, "; ".join(bad))
        return None

    def read_own(self, entry: CheckpointEntry, sd: dict, record: dict) -> dict[str, memoryview]:
        """The files of ``entry`` (its manifest ``record``) that loading ``sd`` reads on this rank, in memory, each
        checked against its checksum; raises ``OSError``, ``KeyError`` or ``ValueError`` at the first bad one."""
        buffers: dict[str, memoryview] = {}
        fs = self.rt.ckpt_fs  # None: plain files, mapped
        data = [n for n in record["files"] if n.endswith(DATA_SUFFIX)]

        def verify(names) -> None:
            digest, sums = for_record(record)  # xxh3_64, or CRC32 in a record written before the switch
            for name in names:
                buffers[name] = read_verified(fs, entry.path / name, record["files"][name], sums[name], digest)

        verify(n for n in record["files"] if n not in data)
        partial = is_sharded_state(sd) or self.rt.layout is not None  # a shard, or a pipeline's stage
        if data and partial:
            from resilience.ckpt.dcp_files import planned_files
            data = planned_files(entry.path, buffers, sd)
        verify(data)
        return buffers

    def choose(self, checksums: bool = True) -> CheckpointEntry | None:
        """The newest committed checkpoint within the rollback bound that passes ``CheckpointDir.check`` (this
        run's, complete, intact; with ``checksums``, each file's checksum read back); every one passed over is
        recorded with the reason, once."""
        rt = self.rt
        newest = self.dirs.newest_committed()
        for bad in self.dirs.incomplete_after(newest.step if newest else -1):
            if bad.step not in self._reported:
                rt.events.emit("ckpt_incomplete", step=bad.step, path=str(bad.path))
                self._reported.add(bad.step)
        candidates = [e for e in self.dirs.entries() if e.committed and e.step not in self._rejected
                      and (rt.load_max_step is None or e.step <= rt.load_max_step)]
        for entry in reversed(candidates):
            reason = self.dirs.check(entry, checksums)
            if reason is None:
                return entry
            self._reject(entry, reason)
        return None
