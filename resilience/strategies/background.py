"""The shared policy of every strategy whose write outlives ``save`` (``async``, ``dcp_async``, the libraries').

One persist in flight at a time; a checkpoint due while one runs waits for it or is skipped (``when_busy``); a
failed persist is raised in the training thread by the next ``save`` or by ``wait`` (``PersistError``), never passed
over. The writer's collectives run on a gloo group of the strategy's own, so that they never interleave with the
training loop's. The write-and-commit that ``sync`` does in the training thread is here as functions the
background writers call (``write_checkpoint``, ``commit_checkpoint``).
"""


from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from resilience.settings.checks import require_number
from resilience.runtime.rank import RankRuntime
from resilience.state.train import TrainState
from resilience.ckpt.commit import CheckpointDir
from resilience.strategies.sync import SyncCheckpoint

if TYPE_CHECKING:
    from resilience.ckpt.dcp_files import HookedWriter

WHEN_BUSY = ("wait", "skip")


class PersistError(RuntimeError):
    """A background persist failed; raised in the training thread by the next ``save`` or by ``wait``."""


def hooked_writer(rt: RankRuntime, path, step: int) -> HookedWriter:
    """DCP writer that fires ``during_checkpoint`` once this rank's shard is on disk (and honours a disk fault).
    It records ``ckpt_written`` then: what is left of this rank's part is handing its write results to rank 0, which
    commits alone, so a failure of this rank from then on no longer loses the checkpoint (bench.trace's lag)."""
    from resilience.ckpt import dcp_files  # on a rank only (dcp_files: why)

    return dcp_files.HookedWriter(path, rt.fault_hook, step, rt.ckpt_fs,
                                  on_written=lambda: rt.events.emit("ckpt_written", step=step))


def commit_checkpoint(rt: RankRuntime, dirs: CheckpointDir, step: int, keep: int) -> None:
    """Rank 0, once every rank's shard is written: commit, emit ``ckpt_durable``, prune to ``keep``."""
    if rt.rank != 0:
        return
    nbytes = dirs.commit(step)
    rt.events.emit("ckpt_durable", step=step, bytes=nbytes, path=str(dirs.path_for(step)), fsync=True)
    for pruned in dirs.prune(keep):
        rt.events.emit("ckpt_pruned", step=pruned)


def write_checkpoint(rt: RankRuntime, dirs: CheckpointDir, step: int, state_dict: dict[str, Any], keep: int,
                     group: dist.ProcessGroup | None) -> None:
    """``sync``'s write-and-commit, with every collective on ``group``; every rank of the group calls it."""
    if rt.rank == 0:
        dirs.prepare(step)
    dist.barrier(group=group)  # nobody writes into the directory before rank 0 has emptied it
    from resilience.ckpt import dcp_files

    dcp_files.save(state_dict, hooked_writer(rt, dirs.path_for(step), step), group)
    commit_checkpoint(rt, dirs, step, keep)


class BackgroundCheckpoint(SyncCheckpoint):
    """Shared policy of strategies whose write outlives ``save``: one persist in flight, ``when_busy``, ``wait``.

    Loading is ``sync``'s (the newest committed checkpoint). Subclasses implement ``_start``, which returns a
    future that completes once the checkpoint is committed (or fails with the persist's exception). ``_start`` ends
    the stall itself (``end_stall``) once the state is staged, before it hands the persist on (a thread, a
    callback), so that the stall measures the staging alone, at the point it always has.
    """

    # a save path of its own: whether it holds sharded state (or a pipeline's stages) is each subclass's to say
    caps = replace(SyncCheckpoint.caps, family="async snapshot + persist", shards_state=False, saves_stages=False)

    def __init__(self, every: int, keep: int, when_busy: str = "wait", timeout_s: float = 60.0) -> None:
        super().__init__(every, keep)
        if when_busy not in WHEN_BUSY:
            raise ValueError(f"strategy.when_busy={when_busy}: must be one of {', '.join(WHEN_BUSY)}")
        self.when_busy, self.timeout_s = when_busy, require_number("strategy.timeout_s", timeout_s, above=0)
        self._pending: Future | None = None
        self.group: dist.ProcessGroup | None = None

    def attach(self, rt: RankRuntime) -> None:
        super().attach(rt)
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))

    def _save(self, step: int, state: TrainState) -> None:
        self._reap()  # a persist that failed since the last checkpoint stops training here
        if self._busy_anywhere():
            if self.when_busy == "skip":
                self.rt.events.emit("ckpt_skipped", step=step, reason="persist in flight")
                self.skip_stall()  # a skipped save is no stall: result.json's median counts checkpoints taken
                return
            t0 = time.monotonic()
            self.wait()  # inside the stall: ckpt_begin is already out
            self.rt.events.emit("ckpt_persist_waited", step=step, duration_s=time.monotonic() - t0)
        self._pending = self._start(step, state)

    def _busy_anywhere(self) -> bool:
        busy = self._pending is not None and not self._pending.done()
        if self.when_busy == "wait":
            return busy  # each rank waits for its own persist: every rank still starts every checkpoint
        # Skipping must be unanimous: a rank that started a persist alone would wait forever in its collectives.
        flag = torch.tensor([int(busy)], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _reap(self) -> None:
        if self._pending is not None and self._pending.done():
            self.wait()

    def wait(self) -> None:
        """Block until the persist in flight is committed; re-raise its exception if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Give a persist in flight a bounded time to finish (it may be waiting on a rank that died)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending.exception(timeout=self.timeout_s)
            except TimeoutError:
                pass

    def _start(self, step: int, state: TrainState) -> Future:
        raise NotImplementedError

    def _commit_when_written(self, step: int, written: Callable[[], None]) -> Future:
        """The persist of a library that writes by itself: a thread waits until ``written()`` returns (this rank's
        files are on disk), fires ``during_checkpoint``, waits for every rank, then rank 0 commits."""
        rt, done = self.rt, Future()

        def work() -> None:
            written()
            rt.fault_hook("during_checkpoint", step)
            dist.barrier(group=self.group)
            commit_checkpoint(rt, self.dirs, step, self.keep)

        threading.Thread(target=self._run_persist, args=(step, done, work), name=f"persist-{step}",
                         daemon=True).start()  # daemon: a dying rank must not wait for its writer
        return done

    def _run_persist(self, step: int, done: Future, work) -> None:
        """Run ``work()`` and settle ``done`` with its outcome; failures are recorded when they happen."""
        try:
            work()
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread through the future
            error = f"{type(exc).__name__}: {exc}"
            self.rt.events.emit("ckpt_failed", step=step, error=error[:500], fsync=True)
            # DCP's CheckpointException is a BaseException, which the rank's error handling would not catch.
            failure = PersistError(f"checkpoint of step {step} failed in the background: {error}")
            failure.__cause__ = exc
            done.set_exception(failure)
        else:
            done.set_result(step)
