"""The supervisor: PyTorch's elastic agent (what torchrun runs) with the benchmark's eyes on it.

``LocalElasticAgent`` spawns the rank processes after a c10d rendezvous, polls them every
``supervisor.monitor_interval_s`` and, when one fails, stops all and restarts the group within its restart budget.
This subclass adds only observation: failures go through the configured detectors into ``fault_detected`` events,
and every restart is logged, so that detection and recovery times come from the same event log as the rest.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import uuid
from pathlib import Path

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry

from resilience.detectors.base import Detector
from resilience.events import EventLog

log = logging.getLogger(__name__)


def say(message: str) -> None:
    """A supervisor line on the console and in ``supervisor.log``."""
    print(f"[supervisor] {message}", flush=True)
    log.info(message)


class ObservedAgent(LocalElasticAgent):
    """The elastic agent, reporting what it sees to the event log and the console."""

    def __init__(self, *args, events: EventLog, detectors: list[Detector], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._events, self._detectors = events, detectors
        self._reported = False  # one detection per attempt: later failures are the same fault spreading

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        # Look before the agent does: on the first failure its poll also SIGTERMs the surviving ranks and waits
        # for them, which would both delay the detection and blur which rank died first.
        if not self._reported:
            exited = self._failed_exit_codes(worker_group)
            if exited:
                self._reported = True
                self._report(exited)
                self._resume_all()  # the agent's poll is about to stop the others
        return super()._monitor_workers(worker_group)

    def _failed_exit_codes(self, worker_group: WorkerGroup) -> dict[int, int]:
        """Global rank -> exit code of every rank process that has exited with a failure (non-blocking)."""
        handlers = getattr(self._pcontext, "subprocess_handlers", {})  # SubprocessContext: one Popen per rank
        codes = {}
        for local_rank, handler in handlers.items():
            code = handler.proc.poll()
            if code:
                codes[worker_group.workers[local_rank].global_rank] = code
        return codes

    def _report(self, exit_codes: dict[int, int]) -> None:
        for det in self._detectors:
            for d in det.on_worker_failures(exit_codes):
                self._events.emit("fault_detected", step=d.step, detector=d.detector, blamed_rank=d.rank,
                                  verdict=d.verdict, value=d.value, fsync=True)
                say(f"fault detected by {d.detector}: {d.verdict}")

    def _resume_all(self) -> None:
        """SIGCONT every rank: one frozen with SIGSTOP would sit on SIGTERM until the grace period ends."""
        for pid in self._pcontext.pids().values() if self._pcontext else ():
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        self._resume_all()
        super()._stop_workers(worker_group)

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        self._events.attempt += 1
        used = worker_group.spec.max_restarts - self._remaining_restarts
        self._events.emit("restart", policy="restart", restart=used, max_restarts=worker_group.spec.max_restarts)
        say(f"restarting all ranks (restart {used} of {worker_group.spec.max_restarts})")
        self._reported = False
        super()._restart_workers(worker_group)


class Supervisor:
    """Runs ``world_size`` rank processes of one experiment on this host, until done or out of restarts."""

    def __init__(self, cfg, config_path: Path, detectors: list[Detector], max_restarts: int) -> None:
        self.cfg, self.config_path = cfg, config_path
        self.detectors, self.max_restarts = detectors, max_restarts
        self.run_dir = Path(cfg.run_dir)

    def run(self) -> str:
        """Return the agent's outcome: "succeeded" or "failed" (restart budget exhausted)."""
        cfg = self.cfg
        # torchelastic logs verbosely at INFO: keep it in supervisor.log, off the console.
        tel = logging.getLogger("torch.distributed.elastic")
        tel.propagate = False
        tel.handlers = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
        # A fresh TCPStore per attempt, hosted by rank 0: with the store shared across restarts (the default since
        # torch 2.4) a restarted rank can read its peer's address from the previous attempt and fail to connect
        # (pytorch/pytorch#135712). Rank processes inherit this setting.
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        events = EventLog(self.run_dir, rank=None, attempt=0)
        params = RendezvousParameters(backend="c10d", endpoint="localhost:0", run_id=f"rb-{uuid.uuid4().hex[:12]}",
                                      min_nodes=1, max_nodes=1)
        spec = WorkerSpec(
            role="rank",
            local_world_size=int(cfg.world_size),
            entrypoint=sys.executable,
            args=("-u", "-m", "resilience.rank", str(self.config_path)),
            rdzv_handler=rdzv_registry.get_rendezvous_handler(params),
            max_restarts=self.max_restarts,
            monitor_interval=float(cfg.supervisor.monitor_interval_s),
        )
        agent = ObservedAgent(
            spec=spec,
            logs_specs=DefaultLogsSpecs(log_dir=str(self.run_dir / "elastic")),
            exit_barrier_timeout=5,
            shutdown_timeout=int(cfg.timeouts.shutdown_s),
            events=events,
            detectors=self.detectors,
        )
        events.emit("launch", world_size=int(cfg.world_size), max_restarts=self.max_restarts)
        say(f"launching {cfg.world_size} ranks ({cfg.device}, {cfg.backend}); logs in {self.run_dir / 'logs'}")
        try:
            result = agent.run()
            outcome = "failed" if result.is_failed() else "succeeded"
        finally:
            spec.rdzv_handler.shutdown()
        events.emit("supervisor_end", outcome=outcome, fsync=True)
        events.close()
        return outcome
