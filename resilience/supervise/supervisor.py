"""The supervisor: starts the rank processes of one experiment on this host and recovers them until done.

Two ways to recover, one class each, chosen by the strategy (``resilience.__main__.supervisor_for``):

* ``resilience.supervise.elastic.ElasticSupervisor`` restarts every rank after a failure: PyTorch's elastic agent (what
  torchrun runs), which every checkpointing strategy relies on;
* ``resilience.supervise.replacing.ReplacingSupervisor`` restarts only the failed ranks, while the survivors keep their
  state and re-form the group in place: what a strategy that ``recovers_in_place`` (``replica``) needs.

Both report through the same ``Observer`` (detectors -> ``fault_detected`` events) and heartbeat board, so that
detection and recovery times come from the same event log whichever way the run recovers.
"""

from __future__ import annotations

import signal
import time
from abc import ABC, abstractmethod
from pathlib import Path

from torch.distributed.elastic.multiprocessing import SignalException

from omegaconf import DictConfig

from injectors.base import Injector
from resilience.detectors.base import Detector
from resilience.proc.orphans import adopt_orphans, kill_children, kill_sessions, remove_unreachable
from resilience.proc import pool
from resilience.proc.zygote import Zygote, cold_argv
from resilience.record.events import EventLog, read_events
from resilience.settings.identity import job_first_attempt
from resilience.record.host_load import HostLoadSampler
from resilience.record.memory import MemorySampler
from resilience.record.board import create_board
from resilience.supervise.observer import Observer, say
from resilience.recovery.base import RecoveryPolicy
from resilience.runtime.rank import AgentService
from resilience.strategies.base import CheckpointStrategy

__all__ = ["Interrupted", "Supervisor", "say"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
THRESHOLDS = ("max_other_cpu", "max_steal", "max_memory_pressure")  # validity.* (conf/config.yaml)


class Interrupted(Exception):
    """SIGINT (Ctrl-C) or SIGTERM reached the supervisor: stop the ranks, record what was measured, leave."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _interrupt(signum: int, frame: object) -> None:
    raise Interrupted(signum)


class Supervisor(ABC):
    """Runs ``world_size`` rank processes of one experiment on this host, until done or out of restarts."""

    mode: str = "base"  # how it recovers, in the ``launch`` event: "restart_all" or "replace_failed"
    zygote: Zygote | None = None  # where the first attempt's ranks are forked from (resilience.proc.zygote)
    fault: Injector | None = None  # the run's injector, for a part of it the supervisor runs (fault.clock=wall)

    def __init__(self, cfg: DictConfig, config_path: Path, strategy: CheckpointStrategy, detectors: list[Detector],
                 policy: RecoveryPolicy) -> None:
        self.cfg, self.config_path, self.strategy = cfg, config_path, strategy
        self.detectors, self.policy, self.max_restarts = detectors, policy, policy.max_restarts
        self.run_dir = Path(cfg.run_dir)
        self.world_size = int(cfg.world_size)
        self._services: list[AgentService] | None = None  # built at the first ask, once for the whole run

    def run(self) -> str:
        """Return the outcome: "succeeded", "failed" (restart budget exhausted) or "interrupted" (SIGINT/SIGTERM;
        the ranks are stopped then, and ``interrupted_by`` names the signal)."""
        events = EventLog(self.run_dir, rank=None, attempt=job_first_attempt(self.cfg))  # numbered on (resume=)
        create_board(self.run_dir, self.world_size)
        for det in self.detectors:  # detectors that need a device report once if there is none
            why = det.start()
            if why:
                events.emit("detector_unavailable", detector=det.name, reason=why)
        events.emit("launch", world_size=self.world_size, max_restarts=self.max_restarts, recovery=self.mode,
                    supervisor="preloaded" if pool.forked() else "cold")
        say(f"launching {self.world_size} ranks ({self.cfg.device}, {self.cfg.backend}); "
            f"logs in {self.run_dir / 'logs'}")
        observer = Observer(events, self.detectors, self.run_dir, self.world_size)
        # torch's elastic agent installs its own handlers while its workers run (raising SignalException, after
        # it stopped them); these cover the rest of the supervisor's life.
        adopt_orphans()  # what a library starts in a rank becomes ours when the rank dies: killed at the end
        previous = {s: signal.signal(s, _interrupt) for s in STOP_SIGNALS}
        self.interrupted_by: str | None = None
        sampler = MemorySampler(float(self.cfg.supervisor.memory_sample_s)).start()
        host = HostLoadSampler(float(self.cfg.validity.sample_s)).start()
        try:
            outcome = self._run(events, observer)
        except (Interrupted, SignalException, KeyboardInterrupt) as exc:
            signum = getattr(exc, "signum", None) or getattr(exc, "sigval", None) or signal.SIGINT
            self.interrupted_by = signal.Signals(signum).name
            outcome = "interrupted"
        finally:
            peak, samples = sampler.stop()
            events.emit("host_memory", peak_pss_bytes=peak, samples=samples)
            for s, handler in previous.items():
                signal.signal(s, handler)
            # What the ranks leave on the host for recovery (e.g. in-memory snapshots) is the supervisor's to
            # remove: the ranks cannot, since they may die; it goes whatever the outcome.
            self.strategy.clean_up_run(self.run_dir)
            if self.zygote is not None:  # ours, not an orphan: ended (it has, once its ranks have) and reaped
                self.zygote.close()
            left = kill_children()
            left.update(kill_sessions(rank_pids(self.run_dir)))
            if left:  # a finding about the library that started them: recorded, not hidden
                events.emit("orphans_killed", processes=sorted(left.values()))
            # a dead job's too, where this one resumes it
            segments = remove_unreachable(run_began(self.run_dir))
            if segments:  # every process of the run is gone: what they shared with each other is a leak
                events.emit("shm_leftovers_removed", files=sorted(n for n, _ in segments),
                            bytes=sum(b for _, b in segments))
            # After every process of the run is reaped: their CPU time is then the supervisor's children's.
            events.emit("host_load", **host.stop(), thresholds={k: self.cfg.validity[k] for k in THRESHOLDS})
        events.emit("supervisor_end", outcome=outcome, signal=self.interrupted_by, fsync=True)
        events.close()
        return outcome

    def rank_argv(self) -> list[str]:
        """The command of a rank process: the stub that has it forked preloaded on the first attempt (and execs
        the cold command on any later one), or the cold command itself."""
        return self.zygote.rank_argv(self.config_path) if self.zygote is not None else cold_argv(self.config_path)

    def caveats(self) -> list[str]:
        """What the user should know before trusting this launcher's figures (printed as warnings at the start)."""
        return []

    def agent_services(self) -> list[AgentService]:
        """What the strategy and the detectors run in the supervisor process across rank restarts (built once)."""
        if self._services is None:
            found = [self.strategy.agent_service(), *(d.agent_service() for d in self.detectors)]
            self._services = [s for s in found if s is not None]
        return self._services

    def worker_role(self) -> str:
        """The role name of the rank processes: the one a service needs (e.g. DLRover's), else "rank"."""
        return next((s.role for s in self.agent_services() if s.role), "rank")

    @abstractmethod
    def _run(self, events: EventLog, observer: Observer) -> str:
        """Start the ranks, watch and recover them; return "succeeded" or "failed"."""


def run_began(run_dir: Path) -> float:
    """When the run's first job launched (wall clock), whichever job this is."""
    launches = [e["t_wall"] for e in read_events(run_dir) if e["kind"] == "launch"]
    return min(launches, default=time.time())


def rank_pids(run_dir: Path) -> set[int]:
    """Every rank process the run started (each attempt's ``run_start``): the ones that hand tensors to workers."""
    return {e["pid"] for e in read_events(run_dir) if e["kind"] == "run_start"}
