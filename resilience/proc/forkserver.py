"""What a process that forks preloaded children on request does (the run's zygote, the pipeline's pool).

A small stub (``zygote_stub.py``: standard library only) stands where the child should be: it hands its stdio, its
environment and its directory over a Unix socket, gets the child's pid back, relays its signals to it and, once the
server reports the child's end, ends the same way. The server forks one child per request; the child takes the
stub's place and runs a module as ``python -m`` would. The server stays single-threaded, so that a fork copies no
lock another thread holds.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Callable

# become(request, module): in the forked child, once it has the stub's stdio, environment and directory
Become = Callable[[dict, str], None]


def retitle(argv: list[str]) -> None:
    """Make this process's command line (``/proc/<pid>/cmdline``: what ``ps`` and the run's process finders read,
    ``resilience.proc.child``) say ``argv``, as the command started cold would: a forked child's is its server's.
    Written over the memory of the command line this process started with (as ``setproctitle`` does), so it
    fits in that room (the pool's start leaves plenty) and is cut beyond it."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end: stat's fields 48 and 49
    except (OSError, IndexError, ValueError):
        return
    if start <= 0 or end <= start:
        return
    data = "\0".join(argv).encode()[: end - start - 1]
    ctypes.memmove(start, data + b"\0" * (end - start - len(data)), end - start)  # ends with a NUL: read as args


def listen(name: str, backlog: int) -> socket.socket:
    """An abstract Unix socket (nothing on disk to leave behind) that takes one stub per connection."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind("\0" + name)
    listener.listen(backlog)
    return listener


def child_ends() -> tuple[int, int]:
    """A pipe that becomes readable when a child ends (SIGCHLD through the wakeup fd), for ``select``."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wakeup fd hears of each child's end
    return wake_r, wake_w


def report_ends(stubs: dict[int, socket.socket]) -> None:
    """Tell each ended child's stub how it ended (its wait status), and forget it."""
    while stubs:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        conn = stubs.pop(pid, None)
        if conn is not None:
            try:
                conn.send(json.dumps({"status": status}).encode())
            except OSError:  # the stub is gone (killed): the child died with it
                pass
            conn.close()


def fork_for(conn: socket.socket, closing: list, modules: tuple[str, ...], become: Become,
             default: str | None = None) -> int:
    """Fork a child for the stub on ``conn`` that runs one of ``modules`` (the request's, else ``default``); 0 if
    the request was unreadable or asks for another module (the stub then starts it cold)."""
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    request = json.loads(data) if data else {}
    module = request.get("module", default)
    if len(fds) != 3 or module not in modules:
        for fd in fds:
            os.close(fd)
        conn.close()
        return 0
    pid = os.fork()
    if pid == 0:
        _child(request, module, fds, [*closing, conn], become)
    for fd in fds:
        os.close(fd)
    conn.send(json.dumps({"pid": pid}).encode())
    return pid


def _child(request: dict, module: str, fds: list[int], closing: list, become: Become) -> None:
    """In the forked child: take the stub's place (stdio, environment, directory, session), run the module, exit."""
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for thing in closing:
            thing.close() if hasattr(thing, "close") else os.close(thing)
        os.setsid()  # as torch's agent starts a rank: its own session
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        search_path(request["env"].get("PYTHONPATH", ""))
        become(request, module)
        retitle([sys.executable, "-m", module, *request["args"]])
        sys.argv = [module, *request["args"]]  # argv[0] becomes the module's file, as with -m
        import runpy

        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        from resilience.record.quick_exit import exit_code

        code = exit_code(exc)
    except BaseException:  # noqa: BLE001 (the child's own traceback, as a cold start would print it)
        import traceback

        traceback.print_exc()
        code = 1
    os._exit(code)


def search_path(pythonpath: str) -> None:
    """The command's own ``PYTHONPATH`` on the import path, as its cold interpreter would have put it there (after
    the command's directory, before the installed packages): the server's path was set when it started, and a
    user's module in a folder outside the project is found through it (tests/test_extend.py, docs/own_model.md)."""
    entries = [entry for entry in pythonpath.split(os.pathsep) if entry and entry not in sys.path]
    sys.path[1:1] = entries


class Forked:
    """A child forked from this process that runs ``run()`` with a pipe on its stdin and one on its stdout: the
    part of ``subprocess.Popen`` a zygote's handle uses (for a supervisor forked from the pool, whose imports its
    zygote needs too)."""

    def __init__(self, run: Callable[[], None]) -> None:
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()  # or what is buffered is written twice
        self.pid = os.fork()
        if self.pid == 0:
            code = 0
            try:
                os.dup2(in_r, 0)
                os.dup2(out_w, 1)
                for fd in (in_r, in_w, out_r, out_w):
                    os.close(fd)
                run()
            except BaseException:  # noqa: BLE001 (its traceback, as a started process would print it)
                import traceback

                traceback.print_exc()
                code = 1
            os._exit(code)
        os.close(in_r)
        os.close(out_w)
        self.stdin, self.stdout = os.fdopen(in_w, "wb"), os.fdopen(out_r, "rb")
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
