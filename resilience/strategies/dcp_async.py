"""PyTorch's own asynchronous checkpointing, ``torch.distributed.checkpoint.async_save``: the off-the-shelf baseline.

Two choices of DCP are settings here, and each combination is its own option (a row of the report):

- ``stager``: ``blocking`` (DCP's default for a ``FileSystemWriter``: a fresh CPU copy of the whole state in the
  calling thread, every checkpoint; caching the copy needs pinned memory, which a CPU-only build cannot
  allocate) or ``default`` (``DefaultStager`` with ``use_async_staging``: the copy is made by a background thread;
  pinned and shared memory are used only where CUDA is available). With a background stager, the stall lasts
  until staging completes: the next optimizer step would change the tensors being copied.
- ``executor``: ``thread`` (``dcp.save`` in a thread of the rank) or ``process`` (a checkpoint daemon process per
  rank with its own process group; it re-imports ``__main__``, which the rank entry point guards). A preemption's
  SIGTERM reaches the daemon too, which dies of it before a save on the notice is written: the declared workaround
  ``daemon_outlives_notice`` (``strategy.patches``, ``resilience.libs.worker_notice``) makes it ignore the signal and
  end with its rank.

The checkpoint is committed (COMMIT.json, as ``sync``) by rank 0 once the upload completes, which is when
``ckpt_durable`` is emitted. Same directory layout, commit and load as ``sync``, and the same one-in-flight /
``when_busy`` policy as ``async`` (``async_ckpt.BackgroundCheckpoint``); the background save's collectives run on
the strategy's own gloo group, as ``async_save`` requires a CPU-capable group and the default group is busy.

With the ``process`` executor the writer runs in the daemon, so the ``during_checkpoint`` phase hook fires in the
rank once the save is handed over (the daemon is writing), not after this rank's shard is on disk.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from resilience.settings.checks import require_choice
from resilience.ckpt.dcp_files import ChecksumFileSystem
from resilience.runtime.rank import RankRuntime
from resilience.state.train import TrainState
from resilience.strategies.background import BackgroundCheckpoint, commit_checkpoint, hooked_writer
from resilience.libs.peer import Patch, PeerLibrary, PeerStrategy
from resilience.libs.worker_notice import start_outliving_notice
from resilience.record.torch_workarounds import declare

STAGERS = ("blocking", "default")
EXECUTORS = ("thread", "process")


def _daemon_outlives_notice() -> None:
    from torch.distributed.checkpoint._async_process_executor import _AsyncCheckpointProcess

    start_outliving_notice(_AsyncCheckpointProcess, "_checkpointing_subprocess")


# the process executor's only: the thread executor has no process to keep alive
PATCHES = (Patch(
    "daemon_outlives_notice", "the checkpoint daemon dies of the job's SIGTERM (a preemption's notice), so a save on "
    "the notice waits for it until the grace period ends", lambda: True, _daemon_outlives_notice,
    declare("dcp_daemon_target", "_AsyncCheckpointProcess._checkpointing_subprocess, the daemon's process target, is "
            "started through one that ignores SIGTERM and ends with its rank (libs/worker_notice.py)", ("2.13.0",),
            __name__)),)


class ChecksumWriter(FileSystemWriter):
    """A writer that a checkpoint daemon process can receive (no phase hook): checksums as it writes."""

    def __init__(self, path) -> None:
        super().__init__(path, sync_files=True)
        self.fs = ChecksumFileSystem(self.fs)

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        future.wait()
        self.fs.write_sidecar(self.path, dist.get_rank() if dist.is_initialized() else 0)
        return future


class DcpAsyncCheckpoint(PeerStrategy, BackgroundCheckpoint):

    library = PeerLibrary("torch.distributed.checkpoint", "torch", extra="")
    known_patches = PATCHES
    # the other executor's daemon process writes without our file-system layer, and has no device mesh
    caps = replace(BackgroundCheckpoint.caps, shards_state=True, when={"executor=process": {
        "writes_through_checkpoint_fs": False, "shards_state": False,
        "sharded_refusal": "strategy.executor=process: DCP's checkpoint process has no device mesh to hold DTensor "
                           "shards"}})

    def __init__(self, every: int, keep: int, when_busy: str = "wait", timeout_s: float = 60.0,
                 stager: str = "blocking", executor: str = "thread", patches: str | list[str] = "all") -> None:
        super().__init__(every, keep, when_busy, timeout_s)
        self.stager_kind = require_choice("strategy.stager", stager, STAGERS)
        self.executor = require_choice("strategy.executor", executor, EXECUTORS)
        self.caps = self.caps.under(executor=self.executor)
        self.choose_patches(patches)
        if self.executor != "process":
            self.patches = []
        self._stager = None

    def attach(self, rt: RankRuntime) -> None:
        super().attach(rt)
        self.declare(self.applied_patches(), stager=self.stager_kind, executor=self.executor)
        if self.stager_kind == "default" and self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            cuda = torch.cuda.is_available()
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=cuda,
                                                        use_async_staging=True, use_non_blocking_copy=cuda))

    def _start(self, step: int, state: TrainState) -> Future:
        rt = self.rt
        if rt.rank == 0:
            self.dirs.prepare(step)
        dist.barrier()  # as in sync: nobody writes into the directory before rank 0 has emptied it
        path = self.dirs.path_for(step)
        process = self.executor == "process"
        writer = ChecksumWriter(path) if process else hooked_writer(rt, path, step)
        kind = AsyncCheckpointerType.PROCESS if process else AsyncCheckpointerType.THREAD
        response = dcp.async_save(state.state_dict(), storage_writer=writer, process_group=self.group,
                                  async_checkpointer_type=kind, async_stager=self._stager)
        upload = response
        if not isinstance(response, Future):  # a background stager: wait until the copy is made
            response.staging_completion.result()
            upload = response.upload_completion
        # The stall ends at staging, before the fault hook (a kill during_checkpoint finds it recorded) and before
        # the done-callback, which commits in this thread when the upload has already finished.
        self.end_stall(step)
        if process:
            rt.fault_hook("during_checkpoint", step)
        done: Future = Future()

        def finish(f: Future) -> None:  # runs in DCP's executor thread when the save completes
            self._run_persist(step, done, lambda: (f.result(), commit_checkpoint(rt, self.dirs, step, self.keep)))

        upload.add_done_callback(finish)
        return done

    def close(self) -> None:
        super().close()
        if self._stager is not None:
            self._stager.close()
            self._stager = None
