"""The loader's fork server forked from the rank itself, instead of started as a fresh interpreter.

multiprocessing starts its fork server (``resilience.data.workers``: the loader's workers come from one) as a new
interpreter that imports torch and the dataset's module again: ~0.9 s of CPU per rank, at its first batch, at every
start of every rank, restarts included (in a gpt_tiny cell of the default matrix, 12 steps, the first step took
1.33 s against 0.12 s for the next ones). The rank has imported all of that already, so ``start`` forks the server
from it, before the rank joins its process group (no collective's thread or socket yet, and no CUDA: on a GPU rank
the ordinary server is used), and hands multiprocessing its address, as its own ``ensure_running`` would. The
server's child is what the stdlib's would have been: the stdlib's own ``forkserver.main`` serves the workers, every
descriptor but the two it needs is closed, every signal handler is the default one. The rank is still a cold
process when it was started cold: only the second interpreter it would start after its own is saved.

A library that starts processes from the fork server in the rank (DLRover's saver with ``saver=rank``, through
the ``saver_by_forkserver`` patch) gets them from this server too: forked from the rank before any of its threads
existed, so that no lock is held in them, which is what that patch is for.

The server's private state (``multiprocessing.forkserver._forkserver``'s fields, ``main``'s signature) is declared
as a workaround (``loader_fork_server``), checked on the Python releases in ``CHECKED_ON``; elsewhere the stdlib
starts its own server, as before.
"""

from __future__ import annotations

import importlib
import multiprocessing.forkserver as forkserver
import os
import platform
import secrets
import signal
import socket
from multiprocessing import resource_tracker
from typing import Any

from resilience.record.torch_workarounds import declare

CHECKED_ON = ("3.11.7",)
SERVED = ("resilience.data.dataset", "resilience.data.workers", "torchdata.stateful_dataloader")
WORKAROUND = declare(
    "loader_fork_server", "the stdlib starts the data loader's fork server as a fresh interpreter (~0.9 s of imports "
    "per rank start): the rank forks it from itself and sets multiprocessing.forkserver._forkserver's "
    "_forkserver_address, _forkserver_alive_fd and _forkserver_pid, then runs forkserver.main in the child",
    CHECKED_ON, __name__, package="python")


def start_for(train: Any, device_type: str) -> bool:
    """``start`` where the rank's batches will come from loader workers through a fork server (``train``: the run's
    ``train`` settings), on a CPU rank; True if it started one."""
    from resilience.data.workers import START_METHOD

    uses = str(train.data) == "loader" and int(train.loader.workers) > 0 and START_METHOD == "forkserver"
    if not uses or device_type != "cpu":
        return False
    for module in SERVED:  # what the stdlib's server would have preloaded, and the workers' own loop
        importlib.import_module(module)
    return start()


def start() -> bool:
    """Fork this process's fork server now, unless one runs or this Python was not checked; True if it did."""
    if platform.python_version() not in CHECKED_ON:
        return False
    server = forkserver._forkserver
    with server._lock:
        if server._forkserver_pid is not None:
            return False  # an earlier attempt in this process started it (in-process restarts)
        resource_tracker.ensure_running()  # as ensure_running does: the workers' shared memory is tracked
        listener = socket.socket(socket.AF_UNIX)
        # an abstract address (Linux): nothing on disk; the stdlib's path in a /tmp/pymp-* directory is removed by an
        # exit handler that a rank, which ends with os._exit, never runs (thousands of them had piled up in /tmp)
        address = f"\0rb-fork-server-{os.getpid()}-{secrets.token_hex(4)}"
        listener.bind(address)
        listener.listen()
        alive_r, alive_w = os.pipe()  # the server ends when this process (the write end's only holder) does
        pid = os.fork()
        if pid == 0:
            _serve(listener.fileno(), alive_r)
        os.close(alive_r)
        listener.close()
        server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
    WORKAROUND.acted()
    return True


def _serve(listener_fd: int, alive_r: int) -> None:
    """The child: nothing of the rank but its memory and stdio, then the stdlib's server loop; never returns."""
    code = 1
    try:
        for sig in signal.valid_signals():  # a fresh interpreter's handlers (the rank's would run in each worker)
            try:
                handler = signal.getsignal(sig)
                if callable(handler) and handler not in (signal.default_int_handler,):
                    signal.signal(sig, signal.SIG_DFL)
            except (OSError, ValueError):
                pass
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.set_wakeup_fd(-1)
        keep = {0, 1, 2, listener_fd, alive_r}
        for fd in sorted(int(name) for name in os.listdir("/proc/self/fd")):
            if fd not in keep:
                try:
                    os.close(fd)
                except OSError:
                    pass  # the directory's own descriptor, closed by now
        forkserver.main(listener_fd, alive_r, [])  # imports nothing: the rank has
    except SystemExit:  # main's own end: no client left
        code = 0
    finally:
        os._exit(code)  # none of the rank's exit handlers, buffers or finalizers
