"""NVIDIA Resiliency Extension's asynchronous DCP save: the path Megatron-Core's ``torch_dist`` checkpoints take.

Each rank plans its part of the save through DCP (``state_dict_saver.save_state_dict_async_plan`` with NVRx's
``FileSystemWriterAsync``, the planning collectives on the strategy's own gloo group): a DDP replica its share of the
deduplicated state, an FSDP/HSDP rank its ``DTensor`` shards. The plan goes to NVRx's persistent worker (one spawned
process per rank, fed through ``AsyncCallsQueue``) as an ``AsyncRequest``: the worker stages the tensors
(``preload_fn``) while the rank waits (the stall), then writes them in forked writer processes. In the persist
thread, ``maybe_finalize_async_calls(blocking=True, no_dist=True)`` waits for this rank's worker and runs the
request's finalize functions: the ``during_checkpoint`` hook, ``save_state_dict_async_finalize`` (the ranks' write
results gathered, DCP's ``.metadata`` written by rank 0) and our commit (COMMIT.json, rank 0; the library writes no
checksums, so the files are read back once). ``no_dist=True``: the library's own cross-rank check is an all-reduce of
a CUDA tensor, and the finalize's gather meets every rank anyway. Loading is ``sync``'s: DCP's files, verified.

Two workarounds on a CPU-only build (``strategy.patches``; declared in ``result.json``). The preload runs in the
spawned worker, which a patch of this process's modules would not reach, so each is a change of the request's
``preload_fn`` (``staged_preload``, which calls the library's own preload):

- ``cuda_synchronize``: the shipped preload, ``preload_tensors(buckets, non_blocking=True)``, calls
  ``torch.cuda.synchronize()``, which raises without CUDA: the worker dies and the rank waits for its staging
  forever. The patch asks for the library's blocking copy (``non_blocking=False``), which synchronises nothing.
- ``cpu_staging_copy``: the request reaches the worker through a ``torch.multiprocessing`` queue, which moves each
  CPU tensor's storage into shared memory in place; the preload's ``tensor.to("cpu")`` returns that same live
  storage, so the worker would write parameters that training goes on changing. The patch stages a copy in the
  worker before the rank goes on, as the preload does for a GPU tensor.
"""

from __future__ import annotations

import importlib
import threading
from concurrent.futures import Future
from dataclasses import replace
from functools import partial

import torch
import torch.distributed as dist

from resilience.runtime.rank import RankRuntime
from resilience.state.train import TrainState
from resilience.strategies.background import BackgroundCheckpoint, commit_checkpoint
from resilience.strategies.nvrx_async import WORKER_OUTLIVES_NOTICE, NvrxAsyncCheckpoint
from resilience.libs.peer import Patch, PeerStrategy


def _module(name: str):
    return importlib.import_module(f"{NvrxAsyncCheckpoint.library.module}.{name}")


def staged_preload(write_buckets: list, blocking: bool, copy: bool) -> list:
    """NVRx's preload of ``write_buckets`` as the chosen patches change it; runs in the library's worker process."""
    shipped = _module("filesystem_async").FileSystemWriterAsync.preload_tensors
    staged = shipped(write_buckets, non_blocking=not blocking)
    if not copy:
        return staged
    return [(path, key, (blobs, [(item, tensor.clone()) for item, tensor in tensors]))
            for path, key, (blobs, tensors) in staged]


def _no_cuda() -> bool:
    return not torch.cuda.is_available()


def _in_each_request() -> None:
    """Nothing to install in this process: the strategy builds each request's preload from the patches in force."""


PATCHES = (
    Patch("cuda_synchronize", "the worker's preload calls torch.cuda.synchronize(), which raises without CUDA: "
          "the worker dies and the rank waits for it forever", _no_cuda, _in_each_request),
    Patch("cpu_staging_copy", "the preload returns the live CPU tensors (moved into shared memory by the queue), "
          "not a staged copy: the worker would save parameters that training keeps changing", _no_cuda,
          _in_each_request),
    WORKER_OUTLIVES_NOTICE,
)


class NvrxAsyncDcpCheckpoint(PeerStrategy, BackgroundCheckpoint):

    library = NvrxAsyncCheckpoint.library  # the same package and extra as nvrx_async
    known_patches = PATCHES
    # DCP plans each rank's DTensor shards and reshards on load; NVRx writes the plan, opening its files itself
    caps = replace(BackgroundCheckpoint.caps, writes_through_checkpoint_fs=False, shards_state=True)

    def __init__(self, every: int, keep: int, when_busy: str = "wait", timeout_s: float = 60.0,
                 patches: str | list[str] = "all") -> None:
        super().__init__(every, keep, when_busy, timeout_s)
        self.choose_patches(patches)
        self._calls = None

    def attach(self, rt: RankRuntime) -> None:
        super().attach(rt)
        self.library.load()
        # imported where used: the supervisor, which builds this class to validate a run, does not pay DCP's ~0.4 s
        from resilience.ckpt.dcp_files import WRITE_THREADS

        applied = self.applied_patches()
        self._in_force = {p.name for p in applied}
        self.declare(applied, writer="FileSystemWriterAsync", persistent_worker=True, thread_count=WRITE_THREADS)
        if self._calls is None:
            self._calls = _module("core").AsyncCallsQueue(persistent=True)

    def _preload(self, writer, shipped):
        blocking, copy = "cuda_synchronize" in self._in_force, "cpu_staging_copy" in self._in_force
        if not (blocking or copy):
            return shipped  # the library as shipped
        return partial(staged_preload, writer.write_buckets, blocking, copy)

    def _start(self, step: int, state: TrainState) -> Future:
        from resilience.ckpt.dcp_files import WRITE_THREADS  # on a rank only, as in attach

        rt, saver = self.rt, _module("state_dict_saver")
        if rt.rank == 0:
            self.dirs.prepare(step)
        dist.barrier()  # nobody writes into the directory before rank 0 has emptied it
        writer = _module("filesystem_async").FileSystemWriterAsync(self.dirs.path_for(step),
                                                                   thread_count=WRITE_THREADS)
        planned = saver.save_state_dict_async_plan(state.state_dict(), writer, process_group=self.group)
        save_fn, shipped_preload, args = writer.get_save_function_and_args()
        finalize = [lambda: rt.fault_hook("during_checkpoint", step),  # this rank's files are on disk
                    lambda: saver.save_state_dict_async_finalize(*planned),
                    lambda: commit_checkpoint(rt, self.dirs, step, self.keep)]
        if save_fn is not None:  # returns once the worker has staged the tensors
            request = _module("core").AsyncRequest(save_fn, args, finalize,
                                                   preload_fn=self._preload(writer, shipped_preload))
            self._calls.schedule_async_request(request)
        self.end_stall(step)  # staged: the persist thread is not part of the stall (BackgroundCheckpoint)

        def work() -> None:
            if save_fn is None:  # nothing of this rank's to write: the queue would wait for a worker reply
                for fn in finalize:
                    fn()
            else:
                self._calls.maybe_finalize_async_calls(blocking=True, no_dist=True)

        done: Future = Future()
        threading.Thread(target=self._run_persist, args=(step, done, work), name=f"persist-{step}",
                         daemon=True).start()  # daemon: a dying rank must not wait for its writer
        return done

    def close(self) -> None:
        super().close()
        # Stop the worker (the rank's exit joins it), unless it never reported: then this rank is failing and
        # its supervisor's reaper ends the worker.
        if self._calls is not None and self._calls.get_num_unfinalized_calls() == 0:
            self._calls.close()
        self._calls = None
