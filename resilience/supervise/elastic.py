"""Restart-all recovery: PyTorch's elastic agent (what torchrun runs) with the benchmark's eyes on it.

``LocalElasticAgent`` spawns the rank processes after a c10d rendezvous, polls them every
``supervisor.monitor_interval_s`` and, when one fails, stops all and restarts the group within its restart budget.
The subclass adds only observation: failures go through the detectors into ``fault_detected`` events, a hung rank
named by the heartbeat is killed, and every restart is logged. With ``recovery=shrink`` a restart starts only the
survivors' ranks; with ``recovery=grow`` the agent also follows the event log and, once the lost node has returned
and the next checkpoint is committed, restarts every rank at the full world size (``world_resized`` both ways).
"""

from __future__ import annotations

import inspect
import logging
import os
import signal
import time
import uuid

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry

from injectors.wall_striker import WallStriker
from resilience.record.events import EVENTS_FILE, EventLog, EventTail
from resilience.record.torch_workarounds import declare
from resilience.runtime.rank import AgentService
from resilience.record.board import reset_board
from resilience.supervise.observer import Observer, kill_hard, say
from resilience.supervise.supervisor import Supervisor

AGENT_HOOKS = declare(
    "elastic_agent_hooks", "the elastic agent has no public hook to watch its ranks: ObservedAgent overrides "
    "LocalElasticAgent's _monitor_workers, _stop_workers and _restart_workers and reads its _pcontext (the ranks' "
    "pids and exit codes), _worker_group and _remaining_restarts", ("2.13.0",), __name__)


class ObservedAgent(LocalElasticAgent):
    """The elastic agent, reporting what it sees to the event log and the console."""

    def __init__(self, *args, events: EventLog, observer: Observer, policy: str, services: list[AgentService],
                 shrink=None, grow=None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._events, self._observer, self._policy, self._services = events, observer, policy, services
        self._reported = False  # one failure per attempt: later failures are the same fault spreading
        self._shrink, self._failed = shrink, []  # recovery=shrink: the world size after a failure of these ranks
        self._grow = grow  # recovery=grow: the policy that says when the lost node rejoins
        self._full, self._max_restarts = kwargs["spec"].local_world_size, kwargs["spec"].max_restarts
        self._grown = 0  # starts at the full size after a shrink (each counted as an attempt, not as a restart)
        self._tail = EventTail(observer.run_dir / EVENTS_FILE)
        self._returned = False  # node_returned recorded for the loss being waited out
        self._durable_step, self._fault_step = 0, None  # from the ranks' records (the tail)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        # Look before the agent does: on the first failure its poll also SIGTERMs the surviving ranks and waits
        # for them, which would both delay the detection and blur which rank died first.
        if not self._reported:
            exited = self._failed_exit_codes(worker_group)
            if exited:
                self._reported = True
                # The ranks a signal ended: survivors whose peers vanished exit on their own (code 1) within the
                # same poll on a quiet host, and counting them as failed would drop their node too.
                self._failed = sorted([r for r, code in exited.items() if code < 0] or exited)
                self._observer.exited(exited)
                self._resume_all()  # the agent's poll is about to stop the others
            else:
                doomed = self._observer.poll()
                if doomed:
                    self._reported = True
                    self._failed = sorted(doomed)
                    pids = self._pcontext.pids()
                    for w in worker_group.workers:
                        if w.global_rank in doomed:
                            kill_hard(pids[w.local_rank])
        result = super()._monitor_workers(worker_group)
        if not self._reported and result.failures:  # a rank died between our look and the agent's
            self._reported = True
            exited = {rank: failure.exitcode for rank, failure in result.failures.items()}
            self._failed = sorted([r for r, code in exited.items() if code < 0] or exited)
            self._observer.exited(exited)
        if self._grow is not None and result.state == WorkerState.HEALTHY:
            if self._follow(worker_group) is not None:  # its ranks start again with the others, from that checkpoint
                self._start_again(worker_group, self._full)
        return result

    def _follow(self, worker_group: WorkerGroup) -> int | None:
        """Read the ranks' new records: the newest committed checkpoint and the last fault; with recovery=grow the
        step of the checkpoint after which the returned node rejoins, once it is committed (else None)."""
        shrunk = worker_group.spec.local_world_size < self._full
        for event in self._tail.read():
            if event["kind"] == "fault_injected":
                self._fault_step = event["step"]
            elif event["kind"] == "ckpt_durable":
                self._durable_step = event["step"]
                if not (shrunk and event["attempt"] == self._events.attempt):
                    continue  # only a checkpoint of the shrunk world is the boundary to grow at
            if self._grow is not None and self._grow.take_back(event) is not None:
                return self._durable_step
        if self._grow is not None and shrunk and not self._returned and self._grow.returned(time.monotonic()):
            self._returned = True
            self._events.emit("node_returned", ranks=self._failed, after_s=self._grow.return_after_s)
            say("the lost node is back: its ranks rejoin after the next checkpoint")
        return None

    def _failed_exit_codes(self, worker_group: WorkerGroup) -> dict[int, int]:
        """Global rank -> exit code of every rank process that has exited with a failure (non-blocking)."""
        handlers = getattr(self._pcontext, "subprocess_handlers", {})  # SubprocessContext: one Popen per rank
        codes = {}
        for local_rank, handler in handlers.items():
            code = handler.proc.poll()
            if code:
                codes[worker_group.workers[local_rank].global_rank] = code
        return codes

    def rank_process(self, rank: int) -> int | None:
        """The process this agent started for global rank ``rank`` in its current attempt (None: not started yet),
        running or not: what a wall-clock trace strikes (``injectors.wall_striker``)."""
        handlers = getattr(self._pcontext, "subprocess_handlers", None) or {}
        group = self._worker_group
        local = next((w.local_rank for w in group.workers if w.global_rank == rank), None) if group else None
        return handlers[local].proc.pid if local in handlers else None

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
        used = worker_group.spec.max_restarts - self._grown - self._remaining_restarts
        say(f"restarting all ranks (restart {used} of {self._max_restarts})")
        size = worker_group.spec.local_world_size
        if self._shrink is not None:  # only the ranks of the nodes that are left start again
            self._returned = False
            size = self._shrink(size, self._failed)
        self._start_again(worker_group, size, restart=used)

    def _start_again(self, worker_group: WorkerGroup, size: int, restart: int | None = None) -> None:
        """Stop every rank and start the next attempt with ``size`` ranks (``restart``: the failure restart's
        number; None: growing back, which spends none of the restart budget, like the agent's membership change)."""
        self._events.attempt += 1
        if restart is None:
            # The ranks number their attempt by the agent's restart count (TORCHELASTIC_RESTART_COUNT = max_restarts
            # - remaining): raise both ends by one, so that it counts this start and the budget stays.
            self._grown += 1
            worker_group.spec.max_restarts += 1
        self._events.emit("restart", policy=self._policy, restart=restart, reason="grow" if restart is None
                          else "failure", max_restarts=self._max_restarts)
        old = worker_group.spec.local_world_size
        if size != old:
            self._follow(worker_group)  # the step the new world resumes from: the newest committed checkpoint
            self._events.emit("world_resized", world_size=size, previous=old, direction="up" if size > old
                              else "down", step=self._durable_step, fault_step=self._fault_step,
                              failed_ranks=self._failed)
            say(f"going on with {size} ranks from the checkpoint of step {self._durable_step}")
            worker_group.spec.local_world_size = self._observer.world_size = size
        reset_board(self._observer.run_dir, worker_group.spec.local_world_size)
        self._reported = False
        for service in self._services:  # e.g. DLRover's saver releases its shared-memory locks (as its agent does)
            service.before_restart()
        super()._restart_workers(worker_group)


class ElasticSupervisor(Supervisor):
    """Every failure stops all ranks and starts them again; they reload the newest good checkpoint."""

    mode = "restart_all"

    def _grace(self) -> dict:
        """The agent's grace between SIGTERM and SIGKILL: ``shutdown_timeout`` since torch 2.13; an older torch (a GPU
        machine's own, ``make gpu-check``) has no such setting and keeps its own default."""
        if "shutdown_timeout" not in inspect.signature(LocalElasticAgent.__init__).parameters:
            logging.getLogger(__name__).warning(
                "this torch's elastic agent takes no shutdown_timeout: timeouts.shutdown_s=%s does not apply (torch's "
                "own grace does)", self.cfg.timeouts.shutdown_s)
            return {}
        return {"shutdown_timeout": int(self.cfg.timeouts.shutdown_s)}

    def _run(self, events: EventLog, observer: Observer) -> str:
        AGENT_HOOKS.acted(events)  # refused here, before any rank starts, on a torch it was not checked on
        # torchelastic logs verbosely at INFO: keep it in supervisor.log, off the console.
        tel = logging.getLogger("torch.distributed.elastic")
        tel.propagate = False
        tel.handlers = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
        # A fresh TCPStore per attempt, hosted by rank 0: with the store shared across restarts (the default since
        # torch 2.4) a restarted rank can read its peer's address from the previous attempt and fail to connect
        # (pytorch/pytorch#135712). Rank processes inherit this setting.
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        run_id = f"rb-{uuid.uuid4().hex[:12]}"
        params = RendezvousParameters(backend="c10d", endpoint="localhost:0", run_id=run_id, min_nodes=1, max_nodes=1)
        services = self.agent_services()
        spec = WorkerSpec(
            role=self.worker_role(),
            local_world_size=self.world_size,
            entrypoint=self.rank_argv()[0],
            args=tuple(self.rank_argv()[1:]),
            rdzv_handler=rdzv_registry.get_rendezvous_handler(params),
            max_restarts=self.max_restarts,
            monitor_interval=float(self.cfg.supervisor.monitor_interval_s),
        )
        agent = ObservedAgent(
            spec=spec,
            logs_specs=DefaultLogsSpecs(log_dir=str(self.run_dir / "elastic")),
            exit_barrier_timeout=5,
            **self._grace(),
            events=events,
            observer=observer,
            policy=self.policy.name,
            services=services,
            shrink=self.policy.world_after if self.policy.caps.resizes_world else None,
            grow=self.policy if self.policy.caps.grows_back else None,
        )
        started: list[AgentService] = []
        striker = None
        if self.fault is not None and self.fault.caps.strikes_from_supervisor:  # fault.clock=wall
            striker = WallStriker(self.fault, self.run_dir, events, self.world_size,
                                  self.strategy.node_memory(self.run_dir), agent)
        try:
            for service in services:
                service.start(run_id, self.run_dir)
                started.append(service)
            if striker is not None:
                striker.start()
            outcome = "failed" if agent.run().is_failed() else "succeeded"
        finally:
            if striker is not None:
                striker.stop()
            for service in reversed(started):
                service.close()
            spec.rdzv_handler.shutdown()
        return outcome
