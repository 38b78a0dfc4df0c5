"""NVIDIA Resiliency Extension's asynchronous ``torch.save`` (``checkpointing.async_ckpt.TorchAsyncCheckpoint``).

Each rank hands its whole state dict to ``async_save(state_dict, path)``: the tensors are "preloaded" to host
memory, then a persistent worker process (one per rank, started at the first save, fed through a multiprocessing
queue) writes them with ``torch.save``. ``finalize_async_save(blocking=True, no_dist=True)`` in the persist thread
waits for this rank's worker; a barrier on the strategy's gloo group then lets rank 0 commit (COMMIT.json, the
files read back once for their checksums: the library writes none). Loading reads this rank's file back.

Four workarounds (``strategy.patches``; each declared in ``result.json`` where it applies), the first two needed
on a CPU-only build:

- ``cuda_synchronize``: the library calls ``torch.cuda.synchronize()`` unconditionally, which raises without
  CUDA; with no device there is nothing to synchronise, so it becomes a no-op for the library's modules.
- ``cpu_staging_copy``: the preload is ``tensor.to("cpu", non_blocking=True)``, which *returns the live tensor
  itself* when it is already on the CPU, so the worker would serialise parameters that training goes on
  changing. The patch stages a copy, which is what the preload does for a GPU tensor.
- ``worker_outlives_notice``: a preemption's SIGTERM reaches the worker too, which dies of it before the rank's
  save on the notice is written (``resilience.libs.worker_notice``); the worker ignores it and ends with its rank.
- ``save_by_name``: the library hands ``torch.save`` to its worker through a queue, as the rank sees it at the
  saver's construction; where a tool has wrapped it (ckpt-chaos arms the rank's ``torch.save`` with a local
  function) it cannot be pickled. The request names ``torch_save`` instead, which calls the worker's own.
"""

from __future__ import annotations

import pickle
from concurrent.futures import Future
from dataclasses import replace

import torch
import torch.distributed as dist

from resilience.runtime.rank import RankRuntime
from resilience.state.train import TrainState, map_tensors
from resilience.strategies.background import BackgroundCheckpoint
from resilience.libs.peer import Patch, PeerLibrary, PeerStrategy
from resilience.libs.worker_notice import spawning_outliving_notice, start_outliving_notice
from resilience.record.torch_workarounds import declare

_ASYNC = "nvidia_resiliency_ext.checkpointing.async_ckpt"


def _no_cuda() -> bool:
    return not torch.cuda.is_available()


def _module(name: str):
    import importlib

    return importlib.import_module(f"{_ASYNC}.{name}")


def _view(module) -> _TorchView:
    """The library module's ``torch``, as a view in which the patches replace what they need."""
    if not isinstance(module.torch, _TorchView):
        module.torch = _TorchView(module.torch)
    return module.torch


class _TorchView:
    """``torch`` for the library's modules, with some of its attributes replaced."""

    def __init__(self, torch_module) -> None:
        self._torch = torch_module
        self.replaced: dict[str, object] = {}

    def __getattr__(self, name: str):
        replaced = self.__dict__["replaced"]
        return replaced[name] if name in replaced else getattr(self._torch, name)


def _skip_cuda_synchronize() -> None:
    """``torch.cuda.synchronize`` does nothing in the library's modules (there is no device)."""
    for name in ("torch_ckpt", "core"):
        view = _view(_module(name))
        view.replaced["cuda"] = _CudaWithoutSync(view._torch.cuda)


class _CudaWithoutSync:
    def __init__(self, cuda) -> None:
        self._cuda = cuda

    def synchronize(self, device=None) -> None:
        return None

    def __getattr__(self, name: str):
        return getattr(self._cuda, name)


def torch_save(obj, f, *args, **kwargs) -> None:
    """``torch.save`` looked up where it runs (the library's worker), so that the request can name it."""
    torch.save(obj, f, *args, **kwargs)


def _pickles(fn) -> bool:
    try:
        pickle.dumps(fn)
    except (pickle.PicklingError, AttributeError, TypeError):
        return False
    return True


def _save_by_name() -> None:
    _view(_module("torch_ckpt")).replaced["save"] = torch_save


def _stage_cpu_copies() -> None:
    """The library's preload, with a copy for a tensor already on the CPU (as a GPU tensor gets one)."""
    torch_ckpt = _module("torch_ckpt")
    if getattr(torch_ckpt.preload_tensors, "stages_copies", False):
        return
    shipped = torch_ckpt.preload_tensors

    def preload_tensors(state_dict, non_blocking=True):
        staged = shipped(state_dict, non_blocking=non_blocking)
        return map_tensors(lambda t: t.detach().clone() if t.device.type == "cpu" else t, staged)

    preload_tensors.stages_copies = True
    torch_ckpt.preload_tensors = preload_tensors


def _worker_outlives_notice() -> None:
    start_outliving_notice(_module("core").PersistentAsyncCaller, "async_loop")
    # nvrx_async_dcp's writes report through a queue of a manager process, which the rank spawns at its first save
    writer = _module("filesystem_async")
    shipped = writer._get_write_results_queue
    if getattr(shipped, "outlives_notice", False):
        return

    def results_queue():
        with spawning_outliving_notice():
            return shipped()

    results_queue.outlives_notice = True
    writer._get_write_results_queue = results_queue


# nvrx_async_dcp's worker is the same persistent caller: it shares this patch
WORKER_OUTLIVES_NOTICE = Patch(
    "worker_outlives_notice", "the persistent worker dies of the job's SIGTERM (a preemption's notice), so a save "
    "on the notice waits for it until the grace period ends; with its rank SIGKILLed it waits on its queue forever",
    lambda: True, _worker_outlives_notice,
    declare("nvrx_worker_target", "PersistentAsyncCaller.async_loop, the worker's process target, and "
            "filesystem_async._get_write_results_queue, which spawns the writes' result-queue manager, start their "
            "processes ignoring SIGTERM and ending with their rank (libs/worker_notice.py)", ("0.4.1",), __name__,
            package="nvidia-resiliency-ext"))
PATCHES = (
    Patch("cuda_synchronize", "torch.cuda.synchronize() is called unconditionally and raises without CUDA",
          _no_cuda, _skip_cuda_synchronize),
    Patch("cpu_staging_copy", "the preload returns live CPU tensors, not a staged copy: the worker would save "
          "parameters that training keeps changing", _no_cuda, _stage_cpu_copies),
    WORKER_OUTLIVES_NOTICE,
    # only where torch.save was replaced by a wrapper that cannot be pickled (ckpt-chaos's, docs/resume.md)
    Patch("save_by_name", "the request hands the worker torch.save as the rank sees it, through a queue: a wrapped "
          "torch.save (a crash tester's) cannot be pickled and the first save fails", lambda: not _pickles(torch.save),
          _save_by_name),
)


class NvrxAsyncCheckpoint(PeerStrategy, BackgroundCheckpoint):

    library = PeerLibrary(_ASYNC, "nvidia-resiliency-ext", extra="nvrx")
    known_patches = PATCHES
    # Each rank's torch.save holds its own DTensor shards (with their mesh), which load back into the same mesh
    # after a restart at the same world size: bit-exact under fsdp and hsdp (docs/sharded.md). They cannot be
    # resharded (its load is its own), so recovery=shrink|grow refuse it. The library opens its own files.
    caps = replace(BackgroundCheckpoint.caps, writes_through_checkpoint_fs=False, shards_state=True,
                   reshards_on_load=False)

    def __init__(self, every: int, keep: int, when_busy: str = "wait", timeout_s: float = 60.0,
                 patches: str | list[str] = "all") -> None:
        super().__init__(every, keep, when_busy, timeout_s)
        self.choose_patches(patches)
        self._saver = None

    def attach(self, rt: RankRuntime) -> None:
        super().attach(rt)
        self.library.load()
        self.declare(self.applied_patches(), persistent_queue=True)
        if self._saver is None:
            self._saver = _module("torch_ckpt").TorchAsyncCheckpoint(persistent_queue=True)

    def _file(self, step: int):
        return self.dirs.path_for(step) / f"rank{self.rt.rank}.pt"

    def _start(self, step: int, state: TrainState) -> Future:
        rt = self.rt
        if rt.rank == 0:
            self.dirs.prepare(step)
        dist.barrier()  # nobody writes into the directory before rank 0 has emptied it
        self._saver.async_save(state.state_dict(), str(self._file(step)))
        self.end_stall(step)  # staged: the persist thread is not part of the stall (BackgroundCheckpoint)
        return self._commit_when_written(step, lambda: self._saver.finalize_async_save(blocking=True, no_dist=True))

    def _load(self, state: TrainState) -> tuple[int, str, int] | None:
        entry = self.agreed_entry()
        if entry is None:
            return None
        sd = torch.load(entry.path / f"rank{self.rt.rank}.pt", map_location="cpu", weights_only=False)
        state.load_state_dict(sd)
        return entry.step, "disk", self.dirs.size(entry)

    def close(self) -> None:
        super().close()
        if self._saver is not None:
            self._saver.finalize_async_save(blocking=True, no_dist=True, terminate=True)
            self._saver = None
