"""The hooks ``recovery=nvrx_inprocess`` gives NVRx's ``Wrapper`` (one per lifecycle role, as NVRx composes them);
imported only where NVRx is installed."""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from nvidia_resiliency_ext.inprocess.abort import Abort
from nvidia_resiliency_ext.inprocess.attribution import format_interruption_records
from nvidia_resiliency_ext.inprocess.exception import RestartAbort
from nvidia_resiliency_ext.inprocess.finalize import Finalize
from nvidia_resiliency_ext.inprocess.initialize import Initialize
from nvidia_resiliency_ext.inprocess.rank_assignment import RankAssignment, RankAssignmentCtx
from nvidia_resiliency_ext.inprocess.state import FrozenState
from nvidia_resiliency_ext.inprocess.store import PrefixStore

from resilience.record.events import EventLog

ATTEMPT_ENV = "TORCHELASTIC_RESTART_COUNT"
ESTABLISHED = "01"  # a TCP connection's state in /proc/net/tcp


class Iteration(Initialize):
    """Remembers NVRx's restart iteration for the wrapped function (0: the process's first attempt)."""

    value = 0

    def __call__(self, state: FrozenState) -> FrozenState:
        self.value = state.iteration
        return state


class EndOnLostRank(RankAssignment):
    """A terminated rank (its process died, or NVRx's hard timeout killed it) ends the in-process restart on every
    rank, so that the supervisor restarts the processes. NVRx's default would shift the ranks and shrink the world:
    a different data split, never the fault-free run's state."""

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        if ctx.terminated_ranks:
            raise RestartAbort(f"rank(s) {sorted(ctx.terminated_ranks)} terminated: a dead process is restarted by "
                               f"the supervisor, not in process")
        return ctx


class Verdict(Finalize):
    """Runs on each rank once NVRx has stopped the attempt (group aborted, main thread interrupted): records NVRx's
    interruption records (rank and kind) as this rank's ``fault_detected`` event. Reading them changes nothing."""

    def __init__(self, run_dir: Path, host: str, port: int) -> None:
        self.run_dir, self.host, self.port = run_dir, host, port
        self._store: dist.TCPStore | None = None

    def __call__(self, state: FrozenState) -> FrozenState:
        if self._store is None:
            self._store = dist.TCPStore(self.host, self.port, is_master=False, timeout=timedelta(seconds=30))
        records = PrefixStore(state.iteration, self._store).get_interruption_records()
        blamed = next((r.rank for r in records), None)
        log = EventLog(self.run_dir, state.rank, int(os.environ.get(ATTEMPT_ENV, 0)))
        log.emit("fault_detected", detector="nvrx_inprocess", blamed_rank=blamed,
                 verdict=f"NVRx in-process restart: {format_interruption_records(records)}",
                 interruptions=[f"{r.interruption.name}@{r.rank}" for r in records],
                 fn_exception=repr(state.fn_exception)[:500], silent=False, fsync=True)
        log.close()
        return state


class ShutGlooSockets(Abort):
    """The workaround ``gloo_abort_by_socket_shutdown``: NVRx's ``AbortTorchDistributed`` aborts NCCL communicators
    only. On gloo, neither ``ProcessGroupGloo.abort()`` nor ``shutdown()`` nor ``destroy_process_group`` fails a
    collective in flight (torch 2.13, tried on both sides): a rank blocked in an all-reduce with the rank that
    raised stays in C code, where NVRx's asynchronous exception cannot reach it, until the collective timeout.
    Shutting down this process's established TCP connections other than the stores' (``keep_ports``: these are
    gloo's pairs) fails its pending collectives at once, here and at the peer, as NCCL's abort does."""

    def __init__(self, keep_ports: set[int]) -> None:
        self.keep_ports = keep_ports

    def __call__(self, state: FrozenState) -> FrozenState:
        connections = _tcp_connections()
        for fd in os.listdir("/proc/self/fd"):
            try:
                link = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue  # closed meanwhile
            ports = connections.get(link[len("socket:["):-1]) if link.startswith("socket:[") else None
            if ports is None or self.keep_ports & set(ports):
                continue
            sock = socket.socket(fileno=int(fd))
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            finally:
                sock.detach()  # the fd stays gloo's to close
        return state


def _tcp_connections() -> dict[str, tuple[int, int]]:
    """Socket inode -> (local port, remote port) of this process's network namespace's established TCP
    connections."""
    found = {}
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == ESTABLISHED:
                found[fields[9]] = (int(fields[1].rsplit(":", 1)[1], 16), int(fields[2].rsplit(":", 1)[1], 16))
    return found
