"""The wall clock of a failure trace (``fault=trace fault.clock=wall``): each of the trace's arrivals in seconds is
struck from our supervisor on whatever process the fault's rank has at that moment.

Why from the supervisor: on the wall clock a failure may fall while the rank is being detected, torn down,
started, rendezvoused or loading, where no hook of the rank runs, or while no process of the rank exists at all;
the agent knows each attempt's rank processes. Why a thread and not a forked child as the step clock's striker:
the supervisor's main thread mostly sleeps in the agent's poll, so the interpreter lock is free when a strike is due.

The clock starts at rank 0's first training step's start (its first ``step_end`` less its duration), where the
window that ETTR and the wall time to N steps are measured over starts: the one-time start-up is outside it, as it
is outside the projection's closed form. What arrival ``i`` finds on the fault's rank (its ``struck``):

* ``training``: the rank beat the heartbeat board in this attempt: it is SIGKILLed; the record's ``step`` is the
  steps it had completed (the board's), what the failure loses back to its newest recoverable checkpoint;
* ``restarting``: this attempt's process runs but has not trained yet (starting, rendezvous, loading): SIGKILLed,
  and the recovery starts over (the agent restarts every rank again);
* ``none``: no process of the rank runs (between a death and the next attempt's start): the failure is recorded at
  its time and its kill waits for the rank's next process, which it ends as soon as it has started, so that this
  recovery starts over too (doing nothing would let a recovery outlive a failure that the closed form says
  restarts it; the kill lands at most that gap, a fraction of a recovery, after the failure's time).

A restarting or ``none`` strike records as its ``step`` the step training had reached (where the recovery ends,
the trainer's ``resumed``): it loses no step beyond those of the failure it interrupted (``RecoveryWindow``). A node
loss takes every rank of the node and wipes the node's memory once they have stopped (at once where none runs).
Once the fault's rank has finished training (the board's FINISHED), later arrivals fall after the measured window
and are not struck. Strikes are taken in order: one that comes due while an earlier one waits for a process
strikes right after it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Protocol

from injectors.striker import running, wait_gone
from injectors.trace import Trace, arrivals
from resilience.ckpt.node_memory import NodeMemory
from resilience.record.board import CKPT_IO, FINISHED, STEP_DONE, read_board
from resilience.record.events import EVENTS_FILE, EventLog, EventTail
from resilience.record.query import step_start

log = logging.getLogger(__name__)
POLL_S = 0.01  # how often it looks for the clock's start, and for a rank's next process
LOOK_S = 0.05  # how often, while a strike is further off, it looks at the log and the board (it wakes on time)


class RankProcesses(Protocol):
    """What the striker needs of the agent: the process it started for ``rank`` in its current attempt (None:
    none yet); that process may have ended."""

    def rank_process(self, rank: int) -> int | None: ...


class WallStriker:
    """Strikes the trace's wall-clock arrivals from a thread of the supervisor, from ``start()`` to ``stop()``."""

    def __init__(self, fault: Trace, run_dir: Path, events: EventLog, world_size: int,
                 node_memory: NodeMemory | None, processes: RankProcesses) -> None:
        assert fault.clock == "wall" and fault.mtbf_s is not None
        self.fault, self.run_dir, self.events, self.world_size = fault, Path(run_dir), events, world_size
        self.node_memory, self.processes = node_memory, processes
        # only this job's records: a resumed job's clock starts at its own first step, its indices after the
        # failures its run already holds
        self.tail = EventTail(self.run_dir / EVENTS_FILE)
        self.first_index = sum(1 for e in self.tail.read() if e["kind"] == "fault_injected")
        self.own_pids: dict[tuple[int, int], int] = {}  # (rank, attempt) -> its run_start's pid (a preloaded
        # rank is a child of the zygote, not the process the agent started: its stub)
        self.t0: float | None = None  # rank 0's first training step's start
        self.reached = 0  # the steps training had completed when its latest training strike came
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="wall-striker", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """The run is over: strikes still to come never do; an error of the striker is raised here (a trace that
        stopped striking must not pass for a measured one)."""
        self.stopping.set()
        self.thread.join()
        if self.error is not None:
            raise RuntimeError(f"fault.clock=wall: the striker failed: {self.error!r}") from self.error

    def _run(self) -> None:
        try:
            f = self.fault  # its arrivals drawn as the bench predicts them (fault.arrivals: poisson or stratified)
            for index, (offset, fault) in enumerate(arrivals(f.mix, f.mtbf_s, f.seed, f.arrivals)):
                if not self._wait_for(offset):
                    return
                self._strike(self.first_index + index, offset, fault)
        except BaseException as exc:  # noqa: BLE001 - handed to the supervisor's thread by stop()
            log.exception("the wall-clock striker failed")
            self.error = exc

    def _wait_for(self, offset: float) -> bool:
        """Until ``offset`` seconds after the clock's start; False once the run is over or training is done."""
        while not self.stopping.is_set():
            self._follow()
            if self._finished():
                return False
            if self.t0 is None:
                self.stopping.wait(POLL_S)
                continue
            left = self.t0 + offset - time.monotonic()
            if left <= 0:
                return True
            self.stopping.wait(min(left, LOOK_S))
        return False

    def _follow(self) -> None:
        """Read the ranks' new records: their own pids, and the clock's start."""
        for e in self.tail.read():
            if e["kind"] == "run_start":
                self.own_pids[e["rank"], e["attempt"]] = e["pid"]
            elif e["kind"] == "step_end" and e["rank"] == 0 and self.t0 is None:
                self.t0 = step_start(e)

    def _finished(self) -> bool:
        return read_board(self.run_dir, self.world_size)[self.fault.rank][1] == FINISHED

    def _strike(self, index: int, offset: float, fault: str) -> None:
        ranks = self.fault.node_ranks() if fault == "node_loss" else [self.fault.rank]
        pids = [pid for pid in map(self._live, ranks) if pid is not None]
        step, phase, beat, _ = read_board(self.run_dir, self.world_size)[self.fault.rank]
        if self._live(self.fault.rank) is None:
            struck = "none"
        elif beat > 0:
            struck, self.reached = "training", step + 1 if phase in (STEP_DONE, CKPT_IO) else step
        else:
            struck = "restarting"
        detail = {"node": ranks[0] // self.fault.ranks_per_node, "node_ranks": ranks} if fault == "node_loss" else {}
        self.events.emit("fault_injected", step=self.reached, fault=fault, phase="wall_clock", plan_index=index,
                         target_rank=self.fault.rank, seed=self.fault.seed, struck=struck, planned_s=offset,
                         late_s=time.monotonic() - self.t0 - offset, signal="SIGKILL", pids=pids, **detail)
        # The record is written (the kernel holds it) but synced only after the kill: an fsync first waited for a
        # disk that a checkpoint's writes keep busy, and so put the strike after the checkpoint's stall (10 of 54
        # strikes in training landed in a stall, where 33% of the training time was: sync, 2026-11-28)
        if struck == "none":
            self.events.sync()
            self._wipe(fault, ranks, [])  # nothing of the node runs: its memory goes now
            kill(self._next_processes(ranks))
            return
        kill(pids)
        self.events.sync()
        self._wipe(fault, ranks, pids)

    def _wipe(self, fault: str, ranks: list[int], pids: list[int]) -> None:
        """A node loss: the node's memory, once its ranks have stopped (no thread of theirs writes into it after)."""
        if fault != "node_loss" or self.node_memory is None:
            return
        for pid in pids:
            wait_gone(pid)
        self.node_memory.destroy(ranks[0] // self.fault.ranks_per_node)

    def _live(self, rank: int) -> int | None:
        """The running process of ``rank`` in the agent's current attempt (its own where it is preloaded), else
        None."""
        started = self.processes.rank_process(rank)
        if started is None or not running(started):
            return None
        own = self.own_pids.get((rank, self.events.attempt), started)
        return own if running(own) else None

    def _next_processes(self, ranks: list[int]) -> list[int]:
        """The ranks' processes of the next attempt as soon as each has started ([] if the run ends first)."""
        found: dict[int, int] = {}
        while len(found) < len(ranks) and not self.stopping.is_set():
            self._follow()
            for rank in ranks:
                if rank not in found and (pid := self._live(rank)) is not None:
                    found[rank] = pid
            if len(found) < len(ranks):
                self.stopping.wait(POLL_S)
        return list(found.values()) if len(found) == len(ranks) else []


def kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # it ended meanwhile: the failure found it gone
            pass
