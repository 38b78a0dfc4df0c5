"""The supervisor: PyTorch's elastic agent (what torchrun runs) with the benchmark's eyes on it.

``LocalElasticAgent`` spawns the rank processes after a c10d rendezvous, polls them every
``supervisor.monitor_interval_s`` and, when one fails, stops all and restarts the group within its restart budget.
This subclass adds only observation: failures go through the configured detectors into ``fault_detected`` events,
and every restart is logged, so that detection and recovery times come from the same event log as the rest.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
import uuid
from pathlib import Path

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry

from resilience.detectors.base import Detection, Detector
from resilience.detectors.suite import emit_detection
from resilience.events import EventLog
from resilience.heartbeat import create_board, read_board, reset_board
from resilience.recovery.base import RecoveryPolicy
from resilience.strategies import node_memory

log = logging.getLogger(__name__)


def say(message: str) -> None:
    """A supervisor line on the console and in ``supervisor.log``."""
    print(f"[supervisor] {message}", flush=True)
    log.info(message)


class ObservedAgent(LocalElasticAgent):
    """The elastic agent, reporting what it sees to the event log and the console."""

    def __init__(self, *args, events: EventLog, detectors: list[Detector], run_dir: Path, policy: str,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._events, self._detectors, self._run_dir, self._policy = events, detectors, run_dir, policy
        self._reported = False  # one failure per attempt: later failures are the same fault spreading

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        # Look before the agent does: on the first failure its poll also SIGTERMs the surviving ranks and waits
        # for them, which would both delay the detection and blur which rank died first.
        if not self._reported:
            exited = self._failed_exit_codes(worker_group)
            if exited:
                self._reported = True
                self._emit([d for det in self._detectors for d in det.on_worker_failures(exited)])
                self._resume_all()  # the agent's poll is about to stop the others
            else:
                self._poll_board(worker_group)
        return super()._monitor_workers(worker_group)

    def _poll_board(self, worker_group: WorkerGroup) -> None:
        """Heartbeat-based detectors; a verdict with ``abort`` kills the blamed ranks so recovery can start."""
        board = read_board(self._run_dir, worker_group.spec.local_world_size)
        found = [d for det in self._detectors for d in det.on_poll(board, time.monotonic())]
        self._emit(found)
        doomed = {d.rank for d in found if d.abort and d.rank is not None}
        if doomed:
            self._reported = True
            pids = self._pcontext.pids()
            for w in worker_group.workers:
                if w.global_rank in doomed:
                    for sig in (signal.SIGCONT, signal.SIGKILL):
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pids[w.local_rank], sig)

    def _failed_exit_codes(self, worker_group: WorkerGroup) -> dict[int, int]:
        """Global rank -> exit code of every rank process that has exited with a failure (non-blocking)."""
        handlers = getattr(self._pcontext, "subprocess_handlers", {})  # SubprocessContext: one Popen per rank
        codes = {}
        for local_rank, handler in handlers.items():
            code = handler.proc.poll()
            if code:
                codes[worker_group.workers[local_rank].global_rank] = code
        return codes

    def _emit(self, found: list[Detection]) -> None:
        for d in found:
            emit_detection(self._events, d)
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
        self._events.emit("restart", policy=self._policy, restart=used, max_restarts=worker_group.spec.max_restarts)
        say(f"restarting all ranks (restart {used} of {worker_group.spec.max_restarts})")
        reset_board(self._run_dir, worker_group.spec.local_world_size)
        self._reported = False
        super()._restart_workers(worker_group)


class Supervisor:
    """Runs ``world_size`` rank processes of one experiment on this host, until done or out of restarts."""

    def __init__(self, cfg, config_path: Path, detectors: list[Detector], policy: RecoveryPolicy) -> None:
        self.cfg, self.config_path = cfg, config_path
        self.detectors, self.policy, self.max_restarts = detectors, policy, policy.max_restarts
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
            run_dir=self.run_dir,
            policy=self.policy.name,
        )
        create_board(self.run_dir, int(cfg.world_size))
        for det in self.detectors:  # detectors that need a device report once if there is none
            why = det.start()
            if why:
                events.emit("detector_unavailable", detector=det.name, reason=why)
        events.emit("launch", world_size=int(cfg.world_size), max_restarts=self.max_restarts)
        say(f"launching {cfg.world_size} ranks ({cfg.device}, {cfg.backend}); logs in {self.run_dir / 'logs'}")
        try:
            result = agent.run()
            outcome = "failed" if result.is_failed() else "succeeded"
        finally:
            try:
                spec.rdzv_handler.shutdown()
            finally:
                # The supervisor owns what ranks keep in node memory (in-memory snapshots): the ranks cannot
                # remove it, since they may die; it goes whatever the outcome.
                node_memory.cleanup(self.run_dir)
        events.emit("supervisor_end", outcome=outcome, fsync=True)
        events.close()
        return outcome
