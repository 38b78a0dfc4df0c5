"""How the loader's worker processes start, and how they end when their rank is killed.

Start method: forkserver, with the dataset's module preloaded in the server. Measured on the project's 2-core VM
with a one-off script (3 fresh processes per method, median; the host was running another test too, load ~4),
2 workers, 2048 samples of 64 tokens per rank, batch 8:

=====================  ===========  ===============  ==========  ========  =========================
start method           first batch  after a load(*)  per batch   rollover  peer's EOF after kill(**)
=====================  ===========  ===============  ==========  ========  =========================
fork                   37 ms        30 ms            1.2 ms      2.9 ms    5023 ms
forkserver             913 ms       929 ms           1.2 ms      3.1 ms    14 ms
forkserver + preload   966 ms       74 ms            1.3 ms      4.0 ms    (as forkserver: clean)
spawn                  2416 ms      3233 ms          1.6 ms      4.8 ms    16 ms
=====================  ===========  ===============  ==========  ========  =========================

(*) a second loader in the same process, loading the first one's state. (**) how long after the rank's SIGKILL a
socket it held reads end-of-file in its peer, before ``die_with_rank`` (which brings fork's to 30 ms). The batches
after the load were the uninterrupted loader's under all four. Fork is fastest, but its workers inherit every
descriptor of the rank, the process group's sockets included: a killed rank's peers see its connections close only
when the workers exit, and a fork of a rank whose threads may hold a lock can hang (DLRover's saver did:
resilience/strategies/dlrover_flash.py). Spawn starts clean but imports torch in every worker, every time. The fork
server starts clean once per process, imports the dataset's module (torch with it) once, then forks each worker from
itself in milliseconds.

Its workers are the children of the rank's fork-server process (itself a child of the rank), not of the rank. So
torch's own watchdog (a worker exits when its parent changes) does not fire when the rank is SIGKILLed, and the
server waits for the workers (they hold its liveness pipe): measured, both lived on for 18 minutes, until killed.
``die_with_rank`` closes that: each worker watches the rank's pid and exits when it ends. Measured (2 kills each,
SIGKILL of the rank to every worker and the server gone): forkserver 0.77-0.97 s (the server's own exit, torch
loaded), fork 36-41 ms, spawn 35-64 ms; a peer read end-of-file 14-30 ms after the kill under all three.

A rank of a run does not let the stdlib start that server as a new interpreter (torch imported again, ~0.9 s of
CPU at every rank start): ``resilience.data.fork_server`` forks it from the rank before the rank's threads start.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
from typing import Callable

from resilience.proc.lifeline import outlive_notice

START_METHODS = ("fork", "spawn", "forkserver")
START_METHOD = "forkserver"  # measured: see the module docstring


def context(start_method: str, dataset_module: str) -> multiprocessing.context.BaseContext:
    ctx = multiprocessing.get_context(start_method)
    if start_method == "forkserver":
        # the server, started at the first loader of the process, imports these once; without it every worker
        # imports torch itself (913 ms instead of 74 ms for each later loader)
        ctx.set_forkserver_preload([dataset_module, __name__])
    return ctx


def die_with_rank() -> Callable[[int], None]:
    """A ``worker_init_fn`` (picklable) that makes each worker exit as soon as this process (the rank) ends."""
    return functools.partial(_watch, os.getpid())


def _watch(rank_pid: int, worker_id: int) -> None:
    # The rank decides what a preemption's notice means (checkpoint.on_notice: save first, which reads no batch but
    # needs the loader's state from its workers); they end when it does.
    outlive_notice(rank_pid, f"die-with-rank-{worker_id}")
