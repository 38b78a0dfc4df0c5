"""torch-checkpointing (Meta/PyTorch, 0.1.1) as a strategy: ``CheckpointManager.save`` (async) to save, ``load`` to load.

The library stages the state in a thread of the rank (a copy of every tensor into its own host buffers), then hands
the copy to a checkpoint process of its own (one per rank, ``spawn``ed at the manager's construction; the rank's
entry point is guarded) which writes one ``torch.save`` file per item and rank into ``tmp_<step dir>``, meets the
other ranks' writers at a barrier on the default group's store, and rank 0's writer renames the folder onto the
step directory. Around that we put what every strategy here has: the step directory (emptied first, and the
library's temporary folder of the same step with it), our commit record (COMMIT.json with sizes, checksums and the
run's identity; the library writes no checksums and fsyncs nothing, so rank 0 reads the files back once and fsyncs
them, in the background) and the same choice of the newest good checkpoint at load, checked before the library
reads a byte.

Settings on a CPU-only build (``conf/strategy/torch_checkpointing.yaml``), and why:

- ``direct_io: false``: the file-system backend opens each file with ``O_DIRECT`` by default and falls back to
  buffered I/O only when the open fails; ext4 accepts the open and then refuses ``torch.save``'s unaligned writes
  (``OSError: [Errno 22] Invalid argument`` at the first flush), so every save fails with it on.
- pinned memory and non-blocking copies off: the library's own defaults without CUDA (``can_pin_memory()``);
  pinning needs ``cudaHostRegister``. Staging is still asynchronous (a thread) and into shared memory (the
  process receives the buffers, not a pickled copy): the library's defaults.

The stall ends once staging is done (``manager.lock()``, the library's guard of an in-place update, returns then);
``during_checkpoint`` fires at that point, with the save handed to the checkpoint process, which we cannot hook (as
DCP's process executor). The persist thread then waits for the library's write future, meets the other ranks on
the strategy's group, and rank 0 commits.

Payload: ``model`` and ``optim`` (the optimizer's tensors) declare the library's ``DefaultResharder``, so the
library records each tensor's sharding (FSDP2's ``DTensor`` shards; plain tensors as replicated over the world) and
a load at another world size reads the slices it needs from the old ranks' files (``recovery=shrink|grow``). A
resharded load restores tensors only, so what is not a tensor and the same on every rank (the optimizer's
``param_groups``: learning rates that a schedule moves, the job-wide parts) is an item that rank 0 alone writes and
every rank reads, whatever the world size; the per-rank parts are each rank's own file.

Workaround (``strategy.patches``): ``cpu_metadata_gather``. The library's gather of that sharding metadata across
the ranks (``DefaultMetadataManager._all_gather_pickled_data``, at the first save whenever an item has a resharder
and the world has more than one rank) puts its bytes on CUDA unconditionally (``device="cuda"``, ``.cuda()``), so
without CUDA the first save raises (``Torch not compiled with CUDA enabled``); the patch gathers the same pickled
objects with ``dist.all_gather_object`` on the same group.
"""

from __future__ import annotations

import shutil
import threading
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from resilience.libs.peer import Patch, PeerLibrary, PeerStrategy
from resilience.record.torch_workarounds import declare
from resilience.runtime.rank import RankRuntime
from resilience.state.parts import JOB, RANK
from resilience.state.train import TrainState
from resilience.strategies.background import BackgroundCheckpoint, commit_checkpoint

MODEL, OPTIM, OPTIM_GROUPS = "model", "optim", "optim_groups"
TMP_PREFIX = "tmp_"  # the library's temporary folder beside the step directory (CheckpointWriterConfig.temp_dir_prefix)
SHARED = (OPTIM_GROUPS, JOB)  # written by rank 0 alone, read by every rank


def _no_cuda() -> bool:
    return not torch.cuda.is_available()


def _gather_objects(self, data: Any, process_group=None) -> dict[int, Any]:
    """``DefaultMetadataManager._all_gather_pickled_data`` without CUDA: each rank's object, by rank in the group."""
    gathered: list[Any] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(gathered, data, group=process_group)
    return dict(enumerate(gathered))


SHIPPED: dict[str, Any] = {}  # the library's own gather, kept when the patch replaces it (a process may go on)


def _gather_metadata_on_cpu() -> None:
    from torch_checkpointing.metadata_manager import DefaultMetadataManager

    if DefaultMetadataManager._all_gather_pickled_data is not _gather_objects:
        SHIPPED["gather"] = DefaultMetadataManager._all_gather_pickled_data
    DefaultMetadataManager._all_gather_pickled_data = _gather_objects


PATCHES = (Patch(
    "cpu_metadata_gather", "the gather of the sharding metadata across ranks (the first save of a resharding "
    "checkpoint) puts its bytes on CUDA unconditionally and raises without it", _no_cuda, _gather_metadata_on_cpu,
    declare("torch_checkpointing_metadata_gather", "DefaultMetadataManager._all_gather_pickled_data, which gathers "
            "the ranks' sharding metadata through CUDA tensors, is replaced by dist.all_gather_object of the same "
            "objects on the same group", ("0.1.1",), __name__, package="torch-checkpointing")),)


class TorchCheckpointingCheckpoint(PeerStrategy, BackgroundCheckpoint):
    option = "torch_checkpointing"  # the module cannot be called torch_checkpointing.py: it would read as the library

    library = PeerLibrary("torch_checkpointing", "torch-checkpointing", extra="torch_checkpointing")
    known_patches = PATCHES
    # The library opens its own files (no checkpoint file-system layer), saves each rank's DTensor shards with their
    # sharding and reshards them, and plain tensors, on a load at another world size.
    caps = replace(BackgroundCheckpoint.caps, writes_through_checkpoint_fs=False, shards_state=True,
                   reshards_on_load=True)

    def __init__(self, every: int, keep: int, when_busy: str = "wait", timeout_s: float = 60.0,
                 direct_io: bool = False, patches: str | list[str] = "all") -> None:
        super().__init__(every, keep, when_busy, timeout_s)
        self.direct_io = bool(direct_io)
        self.choose_patches(patches)
        self._manager = None

    def attach(self, rt: RankRuntime) -> None:
        super().attach(rt)
        tc = self.library.load()
        self.declare(self.applied_patches(), async_save=True, direct_io=self.direct_io,
                     pinned_memory=not _no_cuda(), shared_memory=True, resharder="DefaultResharder")
        if self._manager is None:
            self._manager = self._build(tc)

    def _build(self, tc):
        from torch_checkpointing.checkpoint_layout import LayoutInfo, TorchSerialization
        from torch_checkpointing.checkpoint_process import CheckpointProcessConfig
        from torch_checkpointing.checkpoint_writer import CheckpointWriterConfig
        from torch_checkpointing.config import AsyncCheckpointSaverConfig
        from torch_checkpointing.default_resharder import DefaultResharder
        from torch_checkpointing.staging import CheckpointStagerConfig
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        cuda, timeout = not _no_cuda(), max(1, int(self.timeout_s))
        resharder = DefaultResharder()
        items = {MODEL: tc.ItemSpec(resharder=resharder), OPTIM: tc.ItemSpec(resharder=resharder)}
        for key in SHARED:  # rank 0's file, whatever rank reads it (a resharded load restores tensors only)
            items[key] = tc.ItemSpec(layout=LayoutInfo(f"{key}_0.pt", TorchSerialization()), required=False)
        save = AsyncCheckpointSaverConfig(
            # a dead peer fails the write at the library's barrier within the collective timeout, not 600 s
            writer_config=CheckpointWriterConfig(checkpoint_write_barrier_timeout_sec=timeout,
                                                 temp_dir_prefix=TMP_PREFIX),
            staging_config=CheckpointStagerConfig(use_pinned_memory=cuda, use_non_blocking_copy=cuda),
            process_config=CheckpointProcessConfig(subprocess_init_timeout_secs=max(30, timeout)),
            wait_timeout_secs=timeout)
        return tc.CheckpointManager(tc.CheckpointManager.Config(
            items=items, save=save, storage_config=LocalFileSystemStorageConfig(use_direct_io=self.direct_io)))

    def _payload(self, sd: dict[str, Any]) -> dict[str, Any]:
        """Our state dict as the library's items (top-level keys are file names: ``[a-zA-Z0-9_-]+``)."""
        optim = sd["optim"]
        payload = {MODEL: sd["model"], OPTIM: {"state": optim["state"]}, OPTIM_GROUPS: optim["param_groups"]}
        payload.update({k: sd[k] for k in (JOB, RANK) if k in sd})
        return payload

    def _start(self, step: int, state: TrainState) -> Future:
        rt = self.rt
        if rt.rank == 0:
            shutil.rmtree(self.dirs.root / f"{TMP_PREFIX}{self.dirs.path_for(step).name}", ignore_errors=True)
            self.dirs.prepare(step)  # empty: the library renames its temporary folder onto it
        dist.barrier()  # nobody writes before rank 0 has emptied both
        payload = self._payload(state.state_dict())
        if rt.rank != 0:
            for key in SHARED:
                payload.pop(key, None)
        written = self._manager.save(str(self.dirs.path_for(step)), payload)
        with self._manager.lock():  # returns once the copy is staged: training may change the live tensors
            pass
        self.end_stall(step)
        rt.fault_hook("during_checkpoint", step)  # the checkpoint process is writing (or has written) the copy
        done: Future = Future()

        def work() -> None:
            written.result()  # this rank's files written, every rank's writer met, rank 0's renamed the folder
            dist.barrier(group=self.group)
            commit_checkpoint(rt, self.dirs, step, self.keep)

        threading.Thread(target=self._run_persist, args=(step, done, work), name=f"persist-{step}",
                         daemon=True).start()  # daemon: a dying rank must not wait for its writer
        return done

    def _load(self, state: TrainState) -> tuple[int, str, int] | None:
        entry = self.agreed_entry()  # checked (checksums included) before the library reads it
        if entry is None:
            return None
        sd = state.state_dict()
        into = self._payload(sd)
        loaded = self._manager.load(str(entry.path), into=into, strict=True)
        optim = {"state": loaded[OPTIM]["state"], "param_groups": loaded[OPTIM_GROUPS]}
        state.load_state_dict({**sd, **{k: loaded[k] for k in (JOB, RANK) if k in into}, "model": loaded[MODEL],
                               "optim": optim})
        return entry.step, "disk", self.dirs.size(entry)

    def close(self) -> None:
        super().close()
        if self._manager is not None:
            manager, self._manager = self._manager, None
            try:
                manager.close()  # waits for the last write (bounded by wait_timeout_secs), ends the process
            except Exception:  # noqa: BLE001 - that write failed: the persist recorded it (ckpt_failed)
                pass
