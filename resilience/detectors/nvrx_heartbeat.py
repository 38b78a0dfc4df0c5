"""Hang detection by NVIDIA Resiliency Extension's fault tolerance (``nvidia_resiliency_ext.fault_tolerance``), the
peer of our ``heartbeat`` detector.

The library decides, as under its own launcher: a ``RankMonitorServer`` process per rank, started by the supervisor
before the ranks (as ``ft_launcher`` starts one per local rank and keeps it across restarts), receives the heartbeats
that each rank's ``RankMonitorClient`` sends after every step; when one is overdue (``rank_heartbeat_timeout``, or
``initial_rank_heartbeat_timeout`` before the first) it sends the rank SIGCONT then SIGKILL. Our only addition is
observation: the server records its verdict (rank, time, timeout) in the run directory just before it kills, and
this detector reports it when the rank's exit is seen, so the detection is the library's and is timed and blamed
like ours. The library's hooks are unchanged (no patch); ``_shutdown_rank`` is extended, not replaced.

NVRx has no separate deadline for checkpoint I/O (ours: ``timeouts.ckpt_io_s``): a save longer than
``heartbeat_s`` is taken for a hang. Its sections API would cover that; this detector does not use it.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from resilience.caps import DetectorCaps
from resilience.settings.checks import require_int, require_number
from resilience.detectors.base import Detection, Detector
from resilience.runtime.rank import RankRuntime
from resilience.state.train import TrainState

VERDICTS = "nvrx_verdicts"  # in the run directory: one JSON file per kill the rank monitors decided
START_TIMEOUT_S = 120.0
SOCKET_ENV = "FT_RANK_MONITOR_IPC_SOCKET"  # what NVRx's client reads (fault_tolerance/data.py)


def socket_path(run_dir: Path, rank: int) -> str:
    """A short path (a Unix socket's is limited to 107 bytes; run directories can be longer), unique per run."""
    tag = hashlib.sha1(str(run_dir).encode()).hexdigest()[:12]
    return f"{tempfile.gettempdir()}/rb-nvrx-{tag}-{rank}.sock"


class NvrxHeartbeat(Detector):
    # Its rank monitors run in the supervisor (``agent_service``); NVRx's own launcher runs them instead.
    caps = DetectorCaps(runs_in_supervisor=True, served_by="ft_launcher")

    def __init__(self, heartbeat_s: float, initial_s: float, world_size: int, check_every_s: float = 0.5) -> None:
        self.heartbeat_s = require_number("detectors.nvrx_heartbeat.heartbeat_s", heartbeat_s, above=0)
        self.initial_s = require_number("detectors.nvrx_heartbeat.initial_s", initial_s, above=0)
        self.check_every_s = require_number("detectors.nvrx_heartbeat.check_every_s", check_every_s, above=0)
        self.world_size = require_int("world_size", world_size, 1)
        self.run_dir: Path | None = None  # the supervisor's, once its monitors start; a rank's is its runtime's
        self._reported: set[str] = set()
        self._client: Any = None

    # ---- supervisor side ----
    def start(self) -> str | None:
        try:
            import nvidia_resiliency_ext.fault_tolerance  # noqa: F401
        except ImportError as exc:
            return f"nvidia-resiliency-ext is not installed ({exc}): pip install -e '.[nvrx]'"
        return None

    def agent_service(self) -> RankMonitors:
        return RankMonitors(self)

    def on_worker_failures(self, exit_codes: dict[int, int]) -> list[Detection]:
        found = []
        files = [p for p in (self.run_dir / VERDICTS).glob("*.json") if p.name not in self._reported] \
            if self.run_dir else []
        for path, verdict in sorted(((p, json.loads(p.read_text())) for p in files), key=lambda pv: pv[1]["t_mono"]):
            # in the order NVRx decided: its first kill is its blame
            if verdict["rank"] not in exit_codes:
                continue  # decided, the rank not dead yet: reported with its exit
            self._reported.add(path.name)
            found.append(Detection(self.name, verdict["rank"], f"NVRx rank monitor: no heartbeat from rank "
                                   f"{verdict['rank']} within {verdict['timeout_s']} s; it killed the rank",
                                   {"decided_t_mono": verdict["t_mono"], "timeout_s": verdict["timeout_s"]}))
        return found

    # ---- rank side ----
    def attach(self, rt: RankRuntime, state: TrainState) -> None:
        from nvidia_resiliency_ext.fault_tolerance.rank_monitor_client import RankMonitorClient

        os.environ.setdefault(SOCKET_ENV, socket_path(rt.run_dir, rt.rank))  # ft_launcher names its monitor's
        self._client = RankMonitorClient()
        self._client.init_workload_monitoring()

    def on_step_end(self, step: int) -> list[Detection]:
        self._client.send_heartbeat()
        return []


class RankMonitors:
    """One NVRx rank monitor process per rank, for the run's whole life (started before the first ranks)."""

    role = None  # the workers keep the supervisor's role name

    def __init__(self, detector: NvrxHeartbeat) -> None:
        self.detector = detector
        self._procs: list[Any] = []

    def start(self, run_id: str, run_dir: Path) -> None:
        from nvidia_resiliency_ext.fault_tolerance.config import FaultToleranceConfig

        det = self.detector
        det.run_dir = run_dir
        cfg = FaultToleranceConfig(workload_check_interval=det.check_every_s, rank_heartbeat_timeout=det.heartbeat_s,
                                   initial_rank_heartbeat_timeout=det.initial_s, enable_nic_monitor=False)
        (det.run_dir / VERDICTS).mkdir(exist_ok=True)
        ctx = multiprocessing.get_context("spawn")  # a clean interpreter, not a fork of the threaded supervisor
        ready = []
        for rank in range(det.world_size):
            event = ctx.Event()
            proc = ctx.Process(target=_serve, daemon=True, name=f"nvrx-rank-monitor-{rank}",
                               args=(cfg, socket_path(det.run_dir, rank), event, str(det.run_dir), rank))
            proc.start()
            self._procs.append(proc)
            ready.append(event)
        for rank, event in enumerate(ready):
            if not event.wait(START_TIMEOUT_S):
                raise RuntimeError(f"NVRx's rank monitor for rank {rank} did not start in {START_TIMEOUT_S} s")

    def before_restart(self) -> None:
        """The monitors stay, as under ft_launcher; each takes the new rank's connection."""

    def close(self) -> None:
        for proc in self._procs:
            proc.terminate()
        for rank, proc in enumerate(self._procs):
            proc.join(10)
            if proc.is_alive():
                proc.kill()
            Path(socket_path(self.detector.run_dir, rank)).unlink(missing_ok=True)


def _serve(cfg: Any, ipc_socket_path: str, ready: Any, run_dir: str, rank: int) -> None:
    """The rank monitor process: NVRx's ``RankMonitorServer.run``, with the verdict recorded before the kill."""
    import asyncio
    import sys

    from nvidia_resiliency_ext.fault_tolerance.rank_monitor_server import RankMonitorLogger, RankMonitorServer

    log = open(Path(run_dir) / f"nvrx_rank_monitor_{rank}.log", "a", buffering=1)
    os.dup2(log.fileno(), sys.stderr.fileno())  # its log lines go to the run directory, not the console

    class RecordedServer(RankMonitorServer):
        def _shutdown_rank(self) -> None:
            elapsed = self.last_hb_time is None
            verdict = {"rank": rank, "pid": self.rank_info.pid, "t_mono": time.monotonic(),
                       "timeout_s": self.cfg.initial_rank_heartbeat_timeout if elapsed else
                       self.cfg.rank_heartbeat_timeout}
            path = Path(run_dir) / VERDICTS / f"rank{rank}-{time.monotonic_ns()}.json"
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(verdict))
            tmp.rename(path)  # whole before the rank's death can be seen
            super()._shutdown_rank()

    server = RecordedServer(cfg, ipc_socket_path, ready, False, RankMonitorLogger(level=cfg.log_level))
    try:
        asyncio.run(server._rank_monitor_loop())
    except asyncio.CancelledError:
        pass
