"""The pipeline's preloaded interpreter: each cell's ``python -m resilience`` forked from it, imports done.

A cell pays ~2 s before its first step that no figure measures: the supervisor's own imports (Hydra, torch for its
roles) and its zygote's (torch, DDP's ``torch._dynamo``, DCP), ~3.5 s of CPU on 2 cores. The pipeline starts one
*pool* for the whole matrix (``Pool.start``, from the Snakefile's ``onstart``; the cells' commands find it through
``RB_POOL``). It imports once, at the first cell (not before: the probe measures the machine alone), then forks
one supervisor per cell: the cell starts ``zygote_stub.py --module resilience`` in its place, which hands over its
stdio, environment and directory, relays its signals and ends as the supervisor ended (``resilience.proc
.forkserver``). The forked supervisor forks its own zygote before it starts any thread, so the first attempt's
ranks start from imported modules too; every restart after a fault stays a cold process start, as in production
(``supervisor.restarts``). ``launch``'s ``supervisor`` and ``result.json``'s ``supervisor_start`` say which start a
run had. No pool (a SLURM job on another node, ``--config preload=false``, a pool that does not answer): the stub
execs the ordinary command.

The pool ends when the pipeline closes its stdin or ends: it takes no new cell, and exits once the running ones
have (a cell outlives a killed Snakemake, as a cold one would).
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

from resilience.proc import forkserver

POOL_ENV = "RB_POOL"  # the pool's socket name, in the environment of the pipeline's jobs
STUB = Path(__file__).with_name("zygote_stub.py")
SUPERVISOR = "resilience"  # the one module it forks: the experiment's command
READY_S = 30.0
ROOM = " " * 8192  # a cell's command line is ~1 kB: its overrides and its run directory
# A supervisor's imports before it runs (its roles' and supervisors' modules, Hydra) and its zygote's; not the
# strategies' libraries, whose imports may start threads.
PRELOAD = ("torch", "torch._inductor.config", "torch._dynamo", "torch.nn.parallel", "resilience.ckpt.dcp_files",
           "resilience.rank.main", "hydra", "resilience.__main__", "resilience.roles", "resilience.supervise.elastic",
           "resilience.supervise.replacing", "resilience.record.result", "resilience.compat")

_stub: int | None = None  # in a supervisor forked from the pool: the process its cell started in its place
_imports_s = 0.0  # in a supervisor forked from the pool: the seconds the pool took to import what it inherited


def command(module: str, args: list[str]) -> list[str]:
    """``python -m MODULE ARGS``, or its stub when this process's pipeline has a pool."""
    name = os.environ.get(POOL_ENV)
    if name:
        return [sys.executable, "-u", "-S", str(STUB), "--module", module, name, *args]
    return [sys.executable, "-m", module, *args]


def forked() -> bool:
    """Whether this process is a supervisor forked from a pool."""
    return _stub is not None


def guard() -> None:
    """In a forked supervisor, once its zygote is forked (a fork must come before any thread): die with its stub,
    as a cold command dies of the SIGKILL its cell sends."""
    if _stub is not None:
        from resilience.proc.lifeline import die_with

        die_with(_stub)


def inherited_imports_s() -> float:
    """The imports this process inherited from the pool (0 when it was started cold): part of what a cold start
    of its ranks pays that a zygote forked from it does not measure (a replacement's deadline counts on it)."""
    return _imports_s


def _as_supervisor(request: dict, _module: str, imports_s: float) -> None:
    global _stub, _imports_s
    _stub, _imports_s = int(request["stub"]), imports_s
    sys.modules.pop("resilience.__main__", None)  # imported for its imports: run afresh as __main__, as -m does


def serve(name: str, parent_pid: int) -> None:
    """Fork a supervisor per request until the pipeline closes stdin or ends; exit once they have all ended."""
    listener = forkserver.listen(name, 8)
    parent = os.pidfd_open(parent_pid)
    print("listening", flush=True)
    wake_r, wake_w = forkserver.child_ends()
    stubs: dict[int, socket.socket] = {}
    imports_s, accepting = None, True
    while accepting or stubs:
        # watched while it takes cells: the pipeline's end (its pidfd) and its close (stdin's end)
        readable, _, _ = select.select([wake_r] + ([parent, sys.stdin, listener] if accepting else []), [], [])
        if parent in readable or sys.stdin in readable:
            accepting = False
            listener.close()
        if wake_r in readable:
            os.read(wake_r, 512)
            forkserver.report_ends(stubs)
        if accepting and listener in readable:
            conn, _ = listener.accept()
            if imports_s is None:  # at the first cell, not at the pipeline's start: the probe runs alone
                began = time.perf_counter()
                for module in PRELOAD:
                    importlib.import_module(module)
                imports_s = time.perf_counter() - began
            pid = forkserver.fork_for(conn, [listener, parent, wake_r, wake_w], (SUPERVISOR,),
                                      lambda request, module: _as_supervisor(request, module, imports_s))
            if pid:
                stubs[pid] = conn


class Pool:
    """The pipeline's handle on its pool."""

    def __init__(self, proc: subprocess.Popen, name: str, outer: str | None = None) -> None:
        self.proc, self.name, self.outer = proc, name, outer  # outer: the pool named before this one, if any

    @classmethod
    def start(cls) -> Pool | None:
        """Start it and name it in this process's environment (the jobs' commands inherit it); None if it does
        not come up (the cells then start cold)."""
        name = f"rb-pool-{os.getpid()}-{secrets.token_hex(4)}"
        # the last argument: room for each forked command's own command line (forkserver.retitle)
        proc = subprocess.Popen([sys.executable, "-u", "-m", "resilience.proc.pool", name, str(os.getpid()), ROOM],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        readable, _, _ = select.select([proc.stdout], [], [], READY_S)
        if not readable or proc.stdout.readline() != b"listening\n":
            proc.kill()
            proc.wait()
            return None
        outer, os.environ[POOL_ENV] = os.environ.get(POOL_ENV), name
        return cls(proc, name, outer)

    def stop(self, timeout_s: float = 30.0) -> None:
        """No new cell; wait for the running ones (none, at the pipeline's end), then make sure it is gone. The
        commands started after it go to the pool named before it (a test's own pool inside the suite's), if any."""
        if self.outer is None:
            os.environ.pop(POOL_ENV, None)
        else:
            os.environ[POOL_ENV] = self.outer
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


if __name__ == "__main__":
    from resilience.proc import pool  # this module under its own name: the one its children's code imports

    pool.serve(sys.argv[1], int(sys.argv[2]))
    os._exit(0)  # no interpreter teardown after torch
