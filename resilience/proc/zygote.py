"""The first attempt's rank processes forked from a preloaded interpreter: what a cell pays before its first step.

A rank's start is mostly imports (torch, DDP's ``torch._dynamo``, DCP: ~1.9 s of a gpt_tiny cell's 8.8 s on 2 idle
cores, docs/performance.md). The supervisor starts one *zygote* as early as it can (a fresh interpreter that imports
what a rank imports, beside the supervisor's own imports on the other core: before the command imports Hydra when
its command line names the run directory, the ranks to serve and the strategy's module following once the command
is composed, else once it is) and the first attempt's ranks are forked
from it, each a fresh child of an interpreter that has done nothing but import: no thread, no torch operation, no
state of the supervisor. Every later start (a restart after a fault, a replacement, a spare) is a cold process
start, as in production (the stub execs the ordinary rank command there), and a rank says which it was
(``run_start``'s ``preloaded``; ``result.json``'s ``first_start``). ``supervisor.first_start=cold`` turns it off.
``supervisor.restarts=preloaded`` forks every later start from it too, for runs whose recovery times do not matter
(the test suite: a restart's correctness does not depend on how its process started, its time does); the result
says so (``restarts``).

The agent starts, watches and signals a small stub (``zygote_stub.py``, standard library only, ``python -S``: ~20
ms) in the rank's place. The stub hands its stdio, environment and directory to the zygote, which forks the rank
with them; the stub relays signals to it (SIGCONT too: a rank frozen by SIGSTOP must be resumed to be stopped) and
ends as the rank ended (killed by the same signal, or with its exit code), so that the agent sees what it would
have seen. The rank dies if its stub dies (a SIGKILL from the agent after the grace period); the zygote exits once
the first attempt's ranks have ended, or when the supervisor does.
"""

from __future__ import annotations

import importlib
import os
import secrets
import select
import socket
import subprocess
import sys
import time
from pathlib import Path

from resilience.proc import forkserver, pool
from resilience.proc.orphans import killed_with_parent

LAUNCHER_ENV = "RB_LAUNCHER_PID"  # in a preloaded rank: the process that launched it (its stub's parent)
STUB_ENV = "RB_STUB_PID"  # in a preloaded rank: the process the launcher started for it
IMPORTS_ENV = "RB_PRELOAD_S"  # in a preloaded rank: the seconds its zygote took to import, which it did not pay
STUB = Path(__file__).with_name("zygote_stub.py")
RUN_DIR_ARG = "hydra.run.dir="
RANK = "resilience.rank"  # the module a zygote runs in what it forks
ORDERS_ON_STDIN = "stdin"  # an early zygote's count of ranks: told once the command is composed
READY_S = 30.0  # how long the supervisor waits for the zygote to listen before starting its ranks cold
# What every rank imports before its first step, whatever the strategy (the strategy's own module is added).
PRELOAD = ("torch", "torch._inductor.config", "torch._dynamo", "torch.nn.parallel", "resilience.ckpt.dcp_files",
           "resilience.rank.main")


def cold_argv(config_path: Path | str) -> list[str]:
    return [sys.executable, "-u", "-m", "resilience.rank", str(config_path)]


def launcher_pid() -> int:
    """The process that launched this rank: its parent when started cold, its stub's parent when preloaded."""
    return int(os.environ.get(LAUNCHER_ENV) or os.getppid())


def stub_pid() -> int | None:
    """The stub of a preloaded rank (None for a cold one: it is its own stub)."""
    return int(os.environ[STUB_ENV]) if STUB_ENV in os.environ else None


def preloaded() -> bool:
    return LAUNCHER_ENV in os.environ


def preload_s() -> float | None:
    """The imports a preloaded rank inherited (its zygote's seconds), None for a cold rank: what a cold start of
    the same rank adds to its measured start."""
    return float(os.environ[IMPORTS_ENV]) if IMPORTS_ENV in os.environ else None


class Zygote:
    """The supervisor's handle on its zygote process: started early, asked for the first attempt's rank command."""

    def __init__(self, proc: subprocess.Popen, name: str, config_path: Path, early: bool = False) -> None:
        self.proc, self.name, self.config_path, self.early = proc, name, config_path, early
        self._ready: bool | None = None

    @classmethod
    def early_for(cls, argv: list[str]) -> Zygote | None:
        """Started before the command imports Hydra (~0.3 s sooner: the zygote's imports are what the first step
        waits for) when the command line names its run directory plainly; told the ranks to serve and the
        strategy's module once the command is composed (:meth:`confirm`), closed if the composed run wants none or
        lives elsewhere. None when the command line does not say where the run goes in so many words."""
        values = [a.split("=", 1)[1] for a in argv if a.startswith(RUN_DIR_ARG)]
        if len(values) != 1 or any(not a or a[0] == "-" or "=" not in a for a in argv):
            return None  # a flag (help, --multirun, ...) or no plain run directory: composed first, as before
        value = values[0]
        if len(value) > 1 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        if not value or any(c in value for c in "$'\",[]{} \\"):
            return None  # an interpolation, a sweep, a quoted oddity: Hydra's to read
        return cls._spawn(None, Path(value).resolve() / "config.yaml", list(PRELOAD), early=True)

    def confirm(self, ranks: int | None, modules: list[str]) -> None:
        """An early zygote's orders, once the command is composed: serve ``ranks`` starts (None: every start)
        and import ``modules`` too."""
        self.proc.stdin.write(f"{ranks or 0} {' '.join(modules)}\n".encode())
        self.proc.stdin.close()

    @classmethod
    def start(cls, ranks: int | None, config_path: Path, modules: list[str]) -> Zygote:
        """Serves the first ``ranks`` starts (every start while the supervisor lives: None). ``config_path`` is only
        named on its command line, as on each forked rank's (``forkserver.retitle``): whatever finds a run's
        processes by the config file they name (``resilience.proc.child``) finds these too."""
        return cls._spawn(ranks or 0, config_path, modules)

    @classmethod
    def _spawn(cls, ranks: int | None, config_path: Path, modules: list[str], early: bool = False) -> Zygote:
        """``ranks`` None: the orders come on its stdin (:meth:`confirm`)."""
        name = f"rb-zygote-{os.getpid()}-{secrets.token_hex(4)}"  # an abstract socket: nothing on disk to leave
        if early and pool.forked():  # a supervisor forked from the pipeline's pool, no thread yet: already imported
            supervisor, argv = os.getpid(), cls._argv(name, None, config_path, modules)
            return cls(forkserver.Forked(lambda: _serve_as(argv, name, supervisor, modules)), name, config_path, early)
        proc = subprocess.Popen(cls._argv(name, ranks, config_path, modules),
                                stdin=subprocess.PIPE if early else subprocess.DEVNULL, stdout=subprocess.PIPE)
        return cls(proc, name, config_path, early)

    @staticmethod
    def _argv(name: str, ranks: int | None, config_path: Path, modules: list[str]) -> list[str]:
        return [sys.executable, "-u", "-m", "resilience.proc.zygote", name,
                ORDERS_ON_STDIN if ranks is None else str(ranks), str(os.getpid()), str(config_path), *modules]

    def ready(self) -> bool:
        """Whether the zygote listens (it says so once bound, before it imports): else the ranks start cold."""
        if self._ready is None:
            readable, _, _ = select.select([self.proc.stdout], [], [], READY_S)
            self._ready = bool(readable) and self.proc.stdout.readline() == b"listening\n"
        return self._ready

    def rank_argv(self, config_path: Path | str) -> list[str]:
        if not self.ready():
            return cold_argv(config_path)
        return [sys.executable, "-u", "-S", str(STUB), self.name, str(config_path)]

    def close(self) -> None:
        """End it (it has usually ended by itself once its ranks have) and reap it: it is no orphan of the run.
        Once; again is nothing."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()


def serve(name: str, ranks: int | None, supervisor_pid: int, modules: list[str]) -> None:
    """The zygote: listen, import, then fork one rank per request until ``ranks`` have been started and have
    ended (or the supervisor has; ``ranks`` 0: every request until then; None: the count and more modules come
    on stdin, from an early start). Single-threaded, so that a fork copies no lock held by another thread."""
    # Dies with the command that started it, whatever way that ends (a config error, an exception, SIGKILL): a
    # zygote outliving it would hold ~300 MB each (the suite once filled the host's memory with them).
    killed_with_parent()
    if os.getppid() != supervisor_pid:  # it ended before the line above
        return
    supervisor = os.pidfd_open(supervisor_pid)
    listener = forkserver.listen(name, ranks or 8)
    print("listening", flush=True)  # connections wait in the backlog while the imports run
    began = time.perf_counter()
    for module in modules:
        importlib.import_module(module)
    if ranks is None:  # started early: its orders once the command is composed (an empty line: not wanted)
        orders = sys.stdin.readline().split()
        if not orders:
            return
        ranks = int(orders[0])
        for module in orders[1:]:
            importlib.import_module(module)
    # with what a supervisor forked from the pipeline's pool inherited: a cold replacement pays that too
    imports_s = time.perf_counter() - began + pool.inherited_imports_s()
    wake_r, wake_w = forkserver.child_ends()
    stubs: dict[int, socket.socket] = {}  # rank pid -> its stub's connection
    started, limit = 0, ranks or float("inf")
    while started < limit or stubs:
        watched = [supervisor, wake_r] + ([listener] if started < limit else [])
        readable, _, _ = select.select(watched, [], [])
        if supervisor in readable:
            return  # its ranks watch their parent (resilience.rank.orphan): they clean up and die
        if wake_r in readable:
            os.read(wake_r, 512)
            forkserver.report_ends(stubs)
        if listener in readable:
            conn, _ = listener.accept()
            started += 1
            pid = forkserver.fork_for(conn, [listener, supervisor, wake_r, wake_w], (RANK,),
                                      lambda request, _module: _as_rank(request, imports_s), default=RANK)
            if pid:
                stubs[pid] = conn
        if started == limit and listener.fileno() >= 0:
            listener.close()  # later starts are cold: a stub that finds no zygote execs the ordinary command


def _serve_as(argv: list[str], name: str, supervisor: int, modules: list[str]) -> None:
    """A zygote forked from its supervisor (itself forked from the pipeline's pool): named as a started one is."""
    forkserver.retitle(argv)
    serve(name, None, supervisor, modules)


def _as_rank(request: dict, imports_s: float) -> None:
    """In the forked rank, before it runs: who launched it, its stub (it dies with it), the imports it skipped."""
    os.environ[LAUNCHER_ENV] = str(request["launcher"])
    os.environ[STUB_ENV] = str(request["stub"])
    os.environ[IMPORTS_ENV] = f"{imports_s:.3f}"
    from resilience.proc.lifeline import die_with

    die_with(request["stub"])  # the agent's SIGKILL reaches the stub: the rank goes with it


if __name__ == "__main__":
    serve(sys.argv[1], None if sys.argv[2] == ORDERS_ON_STDIN else int(sys.argv[2]), int(sys.argv[3]),
          sys.argv[5:])  # argv[4]: the run's config, named
    os._exit(0)  # its ranks have ended: nothing to flush, and no interpreter teardown after torch
