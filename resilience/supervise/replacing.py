"""Replace-failed recovery: only the failed ranks are started again; the survivors keep running.

torchelastic has no such mode (it restarts every rank), so this supervisor starts the rank processes itself and
hosts the store they form their groups on. Every replacement opens a new *generation* (see ``resilience.rank.group``):
the survivors, whose collectives failed when the peer's sockets closed, wait for it, re-form the group with the
replacement, and hand it their state (``resilience.strategies.replica``). The restart budget counts replacements.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from resilience.runtime.rank import DRAIN_EXIT, NOTHING_TO_RECOVER_EXIT
from resilience.record.events import EventLog, read_events
from resilience.rank.group import GENERATION_KEY, STORE_ENV, failed_key
from resilience.record.board import reset_board
from resilience.supervise.observer import Observer, kill_hard, say
from resilience.rank.spare import SPARE_ENV, assign_key
from resilience.supervise.supervisor import Supervisor
from resilience.proc.zygote import cold_argv


NOTHING_TO_RECOVER = "no rank holds the training state (every replica was lost at once)"
# Ranks that fail together (a node's ranks, killed at one step) exit a few milliseconds apart, more under load: a
# poll that falls between them must not take one incident for two (two generations, the budget spent twice).
SETTLE_S = 0.3


class ReplacingSupervisor(Supervisor):
    """Starts ``world_size`` rank processes and replaces each one that fails, while budget is left.

    SIGINT and SIGTERM end the run through the base class (``Interrupted``); the ranks are stopped on every way out.
    """

    mode = "replace_failed"

    def _run(self, events: EventLog, observer: Observer) -> str:
        self._start_store()
        self._procs: dict[int, subprocess.Popen] = {}
        self._spares: list[tuple[int, subprocess.Popen]] = []
        self._spares_started = 0
        self._killed: set[int] = set()  # ranks a detector had aborted: their exit is no news
        self._prespawned: set[int] = set()  # replacements started while their incident settled (_prespawn)
        self._prespawned_at = 0.0
        self._generation, self._left = 0, self.max_restarts
        # What the strategy and the detectors run beside the ranks for the whole run (torchft's lighthouse, NVRx's
        # rank monitors); the ranks inherit the environment they set (the lighthouse's address).
        started = []
        try:
            for service in self.agent_services():
                service.start(str(self.cfg.run_id), self.run_dir)
                started.append(service)
            for rank in range(self.world_size):
                self._spawn(rank, self._generation)
            for _ in range(int(self.cfg.supervisor.spares)):
                self._spawn_spare()
            while (outcome := self._poll_once(events, observer)) is None:
                pass
            return outcome
        finally:
            self._stop_all()
            for service in reversed(started):
                service.close()  # after the ranks: they must not outlive what they talk to

    def _start_store(self) -> None:
        """The store the ranks form every generation's group on; survivors wait on its generation key."""
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=float(self.cfg.timeouts.collective_s)))
        self._store.set(GENERATION_KEY, "0")
        self._store_at = f"127.0.0.1:{self._store.port}"

    def _poll_once(self, events: EventLog, observer: Observer) -> str | None:
        """One look at the ranks: "succeeded", "failed" (budget spent), or None to look again."""
        codes = {r: p.poll() for r, p in self._procs.items()}
        if all(c == 0 for c in codes.values()):
            return "succeeded"
        failed = {r: c for r, c in codes.items() if c not in (None, 0)}
        if not failed:
            self._abort_hung(observer)
            time.sleep(float(self.cfg.supervisor.monitor_interval_s))
            return None
        # detected now; the replacement waits for the ranks that go with them
        if news := unplanned({r: c for r, c in failed.items() if r not in self._killed}):
            observer.exited(news)
        self._prespawn(failed)
        if late := self._settle(failed):
            if news := unplanned(late):
                observer.exited(news)
            failed |= late
        # every one of them left its node on a maintenance notice (fault=drain): a move, not a failure
        planned = all(c == DRAIN_EXIT for c in failed.values())
        self._killed.clear()
        if NOTHING_TO_RECOVER_EXIT in failed.values():
            ranks = sorted(r for r, c in failed.items() if c == NOTHING_TO_RECOVER_EXIT)
            refused = refusal(self.run_dir, ranks)
            events.emit("unrecoverable", ranks=ranks, reason=refused or NOTHING_TO_RECOVER)
            say(refused or f"{NOTHING_TO_RECOVER}: no restart can mend that, so the run ends here (a strategy that "
                "checkpoints recovers from it)")
            return "failed"
        if self._left == 0 and not planned:
            say(f"rank(s) {sorted(failed)} failed and the restart budget ({self.max_restarts}) is spent")
            return "failed"
        self._replace(sorted(failed), events, planned)
        return None

    def _prespawn(self, failed: dict[int, int]) -> None:
        """Start the replacements of ``failed`` now, while the incident settles: their interpreters and imports need
        no generation to be open, only its number (they form its group once the survivors see it). Not when a warm
        spare will take the rank, the ranks moved on a maintenance notice, or no restart is left (then the
        processes started here are stopped with the run)."""
        if self._left == 0 or any(p.poll() is None for _, p in self._spares) or \
                all(c == DRAIN_EXIT for c in failed.values()) or NOTHING_TO_RECOVER_EXIT in failed.values():
            return
        self._prespawned_at = time.monotonic()
        for rank in sorted(failed):
            self._spawn(rank, self._generation + 1)
            self._prespawned.add(rank)

    def _settle(self, failed: dict[int, int]) -> dict[int, int]:
        """The ranks that fail within ``SETTLE_S`` after ``failed``: the same incident, replaced with them."""
        late: dict[int, int] = {}
        deadline = time.monotonic() + SETTLE_S
        while time.monotonic() < deadline and len(failed) + len(late) < len(self._procs):
            time.sleep(float(self.cfg.supervisor.monitor_interval_s) / 4)
            late |= {r: c for r, p in self._procs.items()
                     if r not in failed and r not in late and (c := p.poll()) not in (None, 0)}
        return late

    def _abort_hung(self, observer: Observer) -> None:
        """Kill the ranks a supervisor-side detector says to abort (a hang); their exit is then no news."""
        for rank in observer.poll():
            kill_hard(self._procs[rank].pid)
            self._procs[rank].wait()  # gone before the next poll, which must not blame it again
            self._killed.add(rank)

    def _replace(self, failed: list[int], events: EventLog, planned: bool = False) -> None:
        """Open the next generation and start (or hand a warm spare) each failed rank; the survivors keep running.
        ``planned``: the ranks left their node on a maintenance notice; that move spends no restart budget."""
        self._left -= 0 if planned else 1
        self._generation += 1
        generation = events.attempt = self._generation
        reset_board(self.run_dir, self.world_size, ranks=failed)
        self._store.set(failed_key(generation), json.dumps(failed))  # before the generation: survivors read it then
        self._store.set(GENERATION_KEY, str(generation))  # survivors waiting to re-form the group see it now
        for service in self.agent_services():
            service.before_restart()
        started, self._prespawned = self._prespawned, set()
        by_spare = [rank for rank in failed if rank not in started and self._assign_spare(rank, generation)]
        for rank in sorted(set(failed) - set(by_spare) - started):
            self._spawn(rank, generation)
        used = self.max_restarts - self._left
        events.emit("restart", policy=self.policy.name, restart=used, max_restarts=self.max_restarts, ranks=failed,
                    from_spares=by_spare, planned=planned,
                    spawned_s_before=round(time.monotonic() - self._prespawned_at, 4) if started else 0.0)
        others = "; the others keep running" if len(failed) < self.world_size else ""
        spares = ' with warm spares' if by_spare else ''
        say(f"moving rank(s) {failed} off their node before its maintenance{spares}{others}" if planned else
            f"replacing rank(s) {failed}{spares}{others} (restart {used} of {self.max_restarts})")
        for _ in by_spare:
            self._spawn_spare()  # keep the pool full; it gets ready while training goes on

    def _spawn(self, rank: int, generation: int) -> None:
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(self.world_size),
               "LOCAL_WORLD_SIZE": str(self.world_size), "GROUP_RANK": "0",
               "TORCHELASTIC_RESTART_COUNT": str(generation), STORE_ENV: self._store_at}
        self._procs[rank] = subprocess.Popen(self.rank_argv(), env=env)  # a replacement: the stub execs it cold

    def _spawn_spare(self) -> None:
        env = {**os.environ, "WORLD_SIZE": str(self.world_size), "LOCAL_WORLD_SIZE": str(self.world_size),
               "GROUP_RANK": "0", SPARE_ENV: str(self._spares_started), STORE_ENV: self._store_at}
        proc = subprocess.Popen(cold_argv(self.config_path), env=env)  # a warm spare is its own technique
        self._spares.append((self._spares_started, proc))
        self._spares_started += 1

    def _assign_spare(self, rank: int, generation: int) -> bool:
        """Hand ``rank`` to the oldest live spare (it may still be getting ready: it then starts when it is)."""
        while self._spares:
            spare, proc = self._spares.pop(0)
            if proc.poll() is None:
                self._store.set(assign_key(spare), f"{rank} {generation}")
                self._procs[rank] = proc
                return True
        return False

    def _stop_all(self) -> None:
        """SIGTERM every rank and spare still running, SIGKILL what is left after ``timeouts.shutdown_s``."""
        live = [p for p in [*self._procs.values(), *(p for _, p in self._spares)] if p.poll() is None]
        for p in live:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGCONT)
                p.terminate()
        deadline = time.monotonic() + float(self.cfg.timeouts.shutdown_s)
        for p in live:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill_hard(p.pid)
                p.wait()


# The exceptions whose one line says why a rank's recovery cannot be made (each a ``NothingToRecover``): swift_log's
# replay that would not be exact; a shard's or a pipeline stage's every replica lost while the others live.
REFUSALS = ("ReplayRefused", "ReplicasLost")


def refusal(run_dir: Path, ranks: list[int]) -> str | None:
    """The one line a rank refused its recovery with (one of ``REFUSALS``, recorded as its ``rank_error``), or
    None."""
    errors = [e["error"] for e in read_events(run_dir) if e["kind"] == "rank_error" and e["rank"] in ranks]
    refused = [e.partition(": ")[2] for e in errors if e.partition(": ")[0] in REFUSALS]
    return refused[-1] if refused else None


def unplanned(exits: dict[int, int]) -> dict[int, int]:
    """The exits that are failures: a rank that left its node on a maintenance notice is not one."""
    return {r: c for r, c in exits.items() if c != DRAIN_EXIT}
