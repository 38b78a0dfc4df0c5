"""torchsnapshot (Meta/PyTorch, 0.1.0) as a strategy: ``Snapshot.async_take`` to save, ``Snapshot.restore`` to load.

The library does its own I/O (fsspec / aiofiles, not DCP's file-system layer) and its own completion: each rank's
background thread finishes its writes, the ranks meet at a store barrier, rank 0 writes ``.snapshot_metadata``.
Around that we put what every strategy here has: the step directory, our commit record (COMMIT.json with sizes,
checksums and the run's identity; the library writes no checksums, so rank 0 reads the files back once, in the
background) and the same choice of the newest good checkpoint at load. DDP's state is the same on every rank, so
it is declared ``replicated`` (``"**"``), as the library's documentation says for data parallelism: each rank
writes a share.

``async_take`` returns once the state is staged (the stall); ``wait()`` on the pending snapshot, in the persist
thread, is when the files are written; the ``during_checkpoint`` hook fires then, before the commit.

Sharded state (``parallel=fsdp|hsdp``, FSDP2's ``DTensor``s) is refused before launch: 0.1.0 has preparers for plain
tensors and ``ShardedTensor`` (FSDP1) only, so it takes each ``DTensor`` for a whole tensor of the global shape and
its staging raises on every rank (``tests/sharded_torchsnapshot_probe.py``; ``sharded_refusal`` says it in one line).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import replace

import torch.distributed as dist

from resilience.runtime.rank import RankRuntime
from resilience.state.train import TrainState
from resilience.strategies.background import BackgroundCheckpoint
from resilience.libs.peer import PeerLibrary, PeerStrategy


class TorchSnapshotCheckpoint(PeerStrategy, BackgroundCheckpoint):
    option = "torchsnapshot"  # the module cannot be called torchsnapshot.py: it would read as the library

    library = PeerLibrary("torchsnapshot", "torchsnapshot", extra="torchsnapshot")
    # The library opens its own files and loads its own snapshots. Why it cannot save FSDP2's sharded state was found
    # with tests/sharded_torchsnapshot_probe.py: take and async_take, with and without replicated=["**"].
    caps = replace(BackgroundCheckpoint.caps, writes_through_checkpoint_fs=False, reshards_on_load=False,
                   sharded_refusal="torchsnapshot 0.1.0 has no DTensor support (FSDP2's shards are taken for whole "
                                   "tensors and every rank's save raises: .numpy() is not supported for tensor "
                                   "subclasses)")

    def __init__(self, every: int, keep: int, when_busy: str = "wait", timeout_s: float = 60.0) -> None:
        super().__init__(every, keep, when_busy, timeout_s)
        self.choose_patches("none")

    def attach(self, rt: RankRuntime) -> None:
        super().attach(rt)
        self.ts = self.library.load()
        self.declare([], replicated="**")

    def _start(self, step: int, state: TrainState) -> Future:
        rt = self.rt
        if rt.rank == 0:
            self.dirs.prepare(step)
        dist.barrier()  # nobody writes into the directory before rank 0 has emptied it
        pending = self.ts.Snapshot.async_take(str(self.dirs.path_for(step)), {"train": state}, pg=self.group,
                                              replicated=["**"])
        self.end_stall(step)  # staged: the persist thread is not part of the stall (BackgroundCheckpoint)
        return self._commit_when_written(step, pending.wait)

    def _load(self, state: TrainState) -> tuple[int, str, int] | None:
        entry = self.agreed_entry()
        if entry is None:
            return None
        self.ts.Snapshot(str(entry.path), pg=self.group).restore({"train": state})
        return entry.step, "disk", self.dirs.size(entry)
