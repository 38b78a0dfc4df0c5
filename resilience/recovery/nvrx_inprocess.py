"""In-process restart by NVIDIA Resiliency Extension (``nvidia_resiliency_ext.inprocess.Wrapper``), the peer of our
process restart (``recovery=restart``) and of warm spares.

Each rank's attempt (``resilience.rank.main.run_attempt``: build the roles, form the group, load the newest
checkpoint, train) runs inside NVRx's ``Wrapper``. When a rank raises, or stops making progress past NVRx's soft
timeout, NVRx's monitor thread on every rank aborts the process group, interrupts the main thread, and after a
barrier every rank runs the attempt again in the same process: no interpreter, no ``import torch``, no new
rendezvous of processes, only a new group and the checkpoint load. The attempt reloads the newest checkpoint of
the run's strategy, so the final state is held to the same bit-exact check as every other recovery.

A process that died (``fault=kill`` with a signal) cannot be restarted in itself. NVRx's answer is to drop the
dead rank and shrink the world (its default rank assignment) or to activate a reserve rank; both change the
data each rank trains on, and NVRx's examples say that under ``torch.distributed.run`` only faults that leave every
process alive are recovered in process. Here a terminated rank ends the in-process restart on every rank
(``EndOnLostRank``) and the supervisor restarts the processes, as with ``recovery=restart``; in practice the
supervisor sees the exit first (0.1 s) and stops the ranks before NVRx decides. ``result.json``'s ``inprocess``
says which of the two recovered the run (``resilience.record.inprocess``).

What this module adds around the library, and why:

* the group of each attempt forms on a store the process keeps (the launcher's ``MASTER_PORT``, hosted by rank 0),
  under the attempt's own prefix (``RankGroup``'s store path), as NVRx's examples do with ``PrefixStore``: a
  fresh env:// rendezvous per attempt would rebind the same port in the same process;
* NVRx's own store listens on a free port that rank 0 picks and publishes on that store (NVRx's examples use
  ``MASTER_PORT + 2``, which a shared machine may already use);
* the attempt number: rank 0 numbers each attempt past every attempt in the event log and publishes it, so that
  attempts stay unique across in-process and process restarts;
* observation only: ``Finalize`` records NVRx's verdict (its interruption records: which rank, what happened) as a
  ``fault_detected`` event when NVRx has stopped the attempt; rank 0 records each attempt (``inprocess_attempt``).

One workaround, added to NVRx's ``abort`` (a composable hook; no NVRx code is changed), declared in ``result.json``
and chosen with ``recovery.patches`` (``all``, ``none``: NVRx as shipped):
``gloo_abort_by_socket_shutdown`` (``resilience.recovery.nvrx_hooks.ShutGlooSockets``): on gloo, NVRx's abort
cannot fail a collective in flight, so without it a rank blocked in an all-reduce with the rank that raised waits
for the collective timeout (``timeouts.collective_s``) before NVRx can restart it.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import socket
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from resilience.caps import PolicyCaps
from resilience.settings.checks import require_int, require_number
from resilience.record.events import EventLog, read_events
from resilience.recovery.base import RecoveryPolicy

LIBRARY = "nvidia-resiliency-ext"
PATCHES = {"gloo_abort_by_socket_shutdown": "NVRx's abort fails NCCL collectives only; on gloo a peer blocked in "
           "a collective with the failed rank waited for the collective timeout: the rank's gloo connections are "
           "shut down at abort"}
GROUP_STORE_ENV = "RB_STORE"  # resilience.rank.group.STORE_ENV (a floor above this one; pinned by the tests)
ATTEMPT_ENV = "TORCHELASTIC_RESTART_COUNT"  # the attempt number a rank's attempt reads (resilience.rank.main)
MONITOR_LOG = "nvrx_inprocess_monitor_{rank}.log"  # in the run directory: NVRx's monitor process per rank


class InProcessEnded(Exception):
    """NVRx ended the in-process restart on this rank (a lost rank, the budget spent): the process fails, and the
    supervisor's restart takes over."""


class NvrxInprocess(RecoveryPolicy):
    """Restart every rank's training function in its process after an error or a hang (NVRx), at most
    ``max_in_process`` times; a dead process, or a failure past that, falls back to the supervisor's restart of
    every process (``max_restarts``)."""

    caps = PolicyCaps(restarts_in_process=True)

    def __init__(self, max_restarts: int = 3, max_in_process: int = 3, soft_timeout_s: float = 60.0,
                 hard_timeout_s: float = 90.0, heartbeat_timeout_s: float = 30.0, barrier_timeout_s: float = 120.0,
                 interval_s: float = 1.0, last_call_wait_s: float = 1.0, patches: str | list[str] = "all",
                 backend: str = "gloo") -> None:
        super().__init__(max_restarts)
        key = "recovery."
        self.max_in_process = require_int(key + "max_in_process", max_in_process, 0)
        self.soft = require_number(key + "soft_timeout_s", soft_timeout_s, above=0)
        self.hard = require_number(key + "hard_timeout_s", hard_timeout_s, above=self.soft)
        self.barrier = require_number(key + "barrier_timeout_s", barrier_timeout_s, above=self.hard)
        self.heartbeat = require_number(key + "heartbeat_timeout_s", heartbeat_timeout_s, above=0)
        if self.heartbeat >= self.barrier:
            raise ValueError(f"recovery.heartbeat_timeout_s={heartbeat_timeout_s}: must be below "
                             f"recovery.barrier_timeout_s={barrier_timeout_s} (NVRx requires it)")
        self.interval = require_number(key + "interval_s", interval_s, above=0)
        if self.interval >= min(self.soft, self.heartbeat):
            raise ValueError(f"recovery.interval_s={interval_s}: must be below recovery.soft_timeout_s and "
                             f"recovery.heartbeat_timeout_s (NVRx requires it)")
        self.last_call_wait = require_number(key + "last_call_wait_s", last_call_wait_s, at_least=0)
        self.patches = _chosen(patches)
        self.gloo = backend in ("gloo", "auto")  # the workaround is gloo's (auto: before the backend is resolved)
        try:
            import nvidia_resiliency_ext.inprocess  # noqa: F401
        except ImportError as exc:
            raise ValueError(f"recovery=nvrx_inprocess: {LIBRARY} is not installed ({exc}); install the extra: "
                             f"pip install -e '.[nvrx]'") from None

    def settings(self) -> dict[str, Any]:
        return {"max_in_process": self.max_in_process, "soft_timeout_s": self.soft, "hard_timeout_s": self.hard,
                "heartbeat_timeout_s": self.heartbeat, "barrier_timeout_s": self.barrier,
                "interval_s": self.interval, "last_call_wait_s": self.last_call_wait}

    def applied(self) -> list[str]:
        """The chosen workarounds this run needs (gloo's abort only where the backend is gloo)."""
        return [p for p in self.patches if self.gloo]

    def run_attempts(self, attempt: Callable[[bool], None], run_dir: Path) -> None:
        from nvidia_resiliency_ext import inprocess
        from nvidia_resiliency_ext.inprocess.exception import RestartAbort

        from resilience.recovery.nvrx_hooks import EndOnLostRank, Iteration, ShutGlooSockets, Verdict

        # NVRx logs (logger "inprocess") through a stream handler of the root logger, warning otherwise that its
        # "logs are disabled": one to the rank's stderr, its log file, at the root's level (warnings and up).
        root = logging.getLogger()
        if not any(type(h) is logging.StreamHandler for h in root.handlers):
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(asctime)s | %(levelname)s | %(name)s | %(message)s"))
            root.addHandler(handler)
        rank = int(os.environ["RANK"])
        shared = ProcessStore(rank, int(os.environ["WORLD_SIZE"]), timedelta(seconds=self.barrier))
        iteration = Iteration()
        restarts = int(os.environ.get(ATTEMPT_ENV, 0))  # the supervisor's count of process restarts

        def train() -> None:
            number = int(shared.agree(f"attempt/{iteration.value}",
                                      lambda: next_attempt(run_dir, restarts, iteration.value)))
            os.environ[ATTEMPT_ENV] = str(number)
            os.environ[GROUP_STORE_ENV] = shared.address
            if rank == 0:
                log = EventLog(run_dir, rank, number)
                log.emit("inprocess_attempt", library=LIBRARY, version=_version(), iteration=iteration.value,
                         pid=os.getpid(), settings=self.settings(), fsync=True,
                         patches=[{"name": p, "why": PATCHES[p]} for p in self.applied()])
                log.close()
            attempt(iteration.value > 0)

        port = int(shared.agree("nvrx/port", free_port))
        abort = inprocess.abort.AbortTorchDistributed()
        if self.applied():  # Compose runs right to left: the connections first, then NVRx's own abort
            abort = inprocess.Compose(abort, ShutGlooSockets({shared.port, port}))
        wrapped = inprocess.Wrapper(
            abort=abort,
            store_kwargs={"port": port, "timeout": timedelta(seconds=self.barrier)},
            initialize=inprocess.Compose(iteration, inprocess.initialize.RetryController(
                max_iterations=self.max_in_process + 1)),
            finalize=Verdict(run_dir, shared.host, port),
            rank_assignment=inprocess.Compose(inprocess.rank_assignment.ActivateAllRanks(), EndOnLostRank()),
            monitor_thread_interval=timedelta(seconds=self.interval),
            monitor_process_interval=timedelta(seconds=self.interval),
            heartbeat_interval=timedelta(seconds=self.interval),
            progress_watchdog_interval=timedelta(seconds=self.interval),
            soft_timeout=timedelta(seconds=self.soft), hard_timeout=timedelta(seconds=self.hard),
            heartbeat_timeout=timedelta(seconds=self.heartbeat), barrier_timeout=timedelta(seconds=self.barrier),
            completion_timeout=timedelta(seconds=self.barrier),
            last_call_wait=timedelta(seconds=self.last_call_wait),
            monitor_process_logfile=str((run_dir / MONITOR_LOG).resolve()),
        )(train)
        try:
            wrapped()
        except RestartAbort as exc:  # a BaseException: NVRx's terminal verdict on this rank
            raise InProcessEnded(f"NVRx ended the in-process restart: {exc}") from exc


class ProcessStore:
    """The store this process keeps across its attempts: the launcher's ``MASTER_ADDR:MASTER_PORT``, hosted by
    rank 0 (or by the launcher's agent when it shares its own), under this process generation's prefix."""

    def __init__(self, rank: int, world_size: int, timeout: timedelta) -> None:
        self.rank = rank
        self.host, self.port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        self.store = dist.TCPStore(self.host, self.port, world_size, is_master=rank == 0 and not agent_hosts,
                                   timeout=timeout, multi_tenant=True)
        # An agent's store outlives this process generation: keep each generation's keys apart.
        self.prefix = f"rb_inprocess/{os.environ.get(ATTEMPT_ENV, 0)}/"

    def agree(self, key: str, decide: Callable[[], object]) -> str:
        """Rank 0's ``decide()``, the same on every rank."""
        key = self.prefix + key
        if self.rank == 0:
            self.store.set(key, str(decide()))
        return self.store.get(key).decode()

    @property
    def address(self) -> str:
        """Where each attempt's group forms (``RankGroup`` puts the attempt's number in its keys)."""
        return f"{self.host}:{self.port}"


def _chosen(patches: object) -> list[str]:
    names = list(PATCHES)
    if patches in ("all", "none"):
        return names if patches == "all" else []
    if isinstance(patches, (list, tuple)) or type(patches).__name__ == "ListConfig":
        if all(p in names for p in patches):
            return list(patches)
    raise ValueError(f"recovery.patches={patches}: allowed: all, none, or a list of {', '.join(names)}")


def next_attempt(run_dir: Path, process_restarts: int, iteration: int) -> int:
    """The number of the next attempt: past every attempt any rank has logged, and never below the supervisor's
    count of process restarts (a process restart after in-process ones goes on from the log)."""
    if process_restarts == 0 and iteration == 0:
        return 0
    logged = [e["attempt"] + 1 for e in read_events(run_dir) if e["rank"] is not None]
    return max([process_restarts, *logged])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _version() -> str:
    try:
        return importlib.metadata.version(LIBRARY)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
