"""PyTorch's own asynchronous checkpointing, ``torch.distributed.checkpoint.async_save``: the off-the-shelf baseline.

``async_save`` stages the state dict to host memory in the calling thread (with a ``FileSystemWriter``, which is
a ``BlockingAsyncStager``: a fresh CPU copy of the *whole* state per checkpoint; caching the copy needs pinned
memory, which a CPU-only build cannot allocate) and then runs ``dcp.save`` in a one-thread executor, returning a
future. The stall is the time until ``async_save`` returns; the checkpoint is committed (COMMIT.json, as
``sync``) by rank 0 once that future completes, which is when ``ckpt_durable`` is emitted.

Same directory layout, commit and load as ``sync``, and the same one-in-flight/``when_busy`` policy as ``async``
(``async_ckpt.BackgroundCheckpoint``); the background save's collectives run on the strategy's own gloo group,
as ``async_save`` requires a CPU-capable group and the default group is busy with training.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from resilience.state import TrainState
from resilience.strategies.async_ckpt import BackgroundCheckpoint, commit_checkpoint, hooked_writer


class DcpAsyncCheckpoint(BackgroundCheckpoint):

    def _start(self, step: int, state: TrainState) -> Future:
        rt = self.rt
        if rt.rank == 0:
            self.dirs.prepare(step)
        dist.barrier()  # as in sync: nobody writes into the directory before rank 0 has emptied it
        upload = dcp.async_save(state.state_dict(), storage_writer=hooked_writer(rt, self.dirs.path_for(step), step),
                                process_group=self.group)
        rt.events.emit("ckpt_stall_end", step=step)
        done: Future = Future()

        def finish(f: Future) -> None:  # runs in DCP's executor thread when the save completes
            self._run_persist(step, done, lambda: (f.result(), commit_checkpoint(rt, self.dirs, step, self.keep)))

        upload.add_done_callback(finish)
        return done
