"""Replace-failed recovery: only the failed ranks are started again; the survivors keep running.

torchelastic has no such mode (it restarts every rank), so this supervisor starts the rank processes itself and
hosts the store they form their groups on. Every replacement opens a new *generation* (see ``resilience.group``):
the survivors, whose collectives failed when the peer's sockets closed, wait for it, re-form the group with the
replacement, and hand it their state (``resilience.strategies.replica``). The restart budget counts replacements.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from resilience.events import EventLog
from resilience.group import GENERATION_KEY, STORE_ENV
from resilience.heartbeat import reset_board
from resilience.observer import Observer, kill_hard, say
from resilience.supervisor import Supervisor


class _Terminated(Exception):
    """SIGTERM reached the supervisor: stop the ranks, then leave."""


class ReplacingSupervisor(Supervisor):
    """Starts ``world_size`` rank processes and replaces each one that fails, while budget is left."""

    mode = "replace_failed"

    def _run(self, events: EventLog, observer: Observer) -> str:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=float(self.cfg.timeouts.collective_s)))
        store.set(GENERATION_KEY, "0")
        self._store_at = f"127.0.0.1:{store.port}"
        self._procs: dict[int, subprocess.Popen] = {}
        killed: set[int] = set()  # ranks a detector had aborted: their exit is no news
        generation, left = 0, self.max_restarts
        interval = float(self.cfg.supervisor.monitor_interval_s)
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            for rank in range(self.world_size):
                self._spawn(rank, generation)
            while True:
                codes = {r: p.poll() for r, p in self._procs.items()}
                if all(c == 0 for c in codes.values()):
                    return "succeeded"
                failed = {r: c for r, c in codes.items() if c not in (None, 0)}
                if not failed:
                    for rank in observer.poll():
                        kill_hard(self._procs[rank].pid)
                        self._procs[rank].wait()  # gone before the next poll, which must not blame it again
                        killed.add(rank)
                    time.sleep(interval)
                    continue
                if set(failed) - killed:
                    observer.exited({r: c for r, c in failed.items() if r not in killed})
                killed.clear()
                if left == 0:
                    say(f"rank(s) {sorted(failed)} failed and the restart budget ({self.max_restarts}) is spent")
                    return "failed"
                left -= 1
                generation += 1
                events.attempt = generation
                events.emit("restart", policy=self.policy.name, restart=self.max_restarts - left,
                            max_restarts=self.max_restarts, ranks=sorted(failed))
                say(f"replacing rank(s) {sorted(failed)}; the others keep running "
                    f"(restart {self.max_restarts - left} of {self.max_restarts})")
                reset_board(self.run_dir, self.world_size, ranks=sorted(failed))
                store.set(GENERATION_KEY, str(generation))  # survivors waiting to re-form the group see it now
                for rank in sorted(failed):
                    self._spawn(rank, generation)
        except _Terminated:
            say("terminated: stopping the ranks")
            return "failed"
        finally:
            signal.signal(signal.SIGTERM, previous)
            self._stop_all()

    def _spawn(self, rank: int, generation: int) -> None:
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(self.world_size),
               "LOCAL_WORLD_SIZE": str(self.world_size), "GROUP_RANK": "0",
               "TORCHELASTIC_RESTART_COUNT": str(generation), STORE_ENV: self._store_at}
        self._procs[rank] = subprocess.Popen(
            [sys.executable, "-u", "-m", "resilience.rank", str(self.config_path)], env=env)

    def _stop_all(self) -> None:
        """SIGTERM every rank still running, SIGKILL what is left after ``timeouts.shutdown_s``; reap all."""
        live = [p for p in self._procs.values() if p.poll() is None]
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

    def _on_sigterm(self, signum, frame) -> None:
        raise _Terminated()
