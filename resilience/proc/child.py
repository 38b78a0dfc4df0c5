"""One way to start a child command: in its own session, and its whole process group ended with it.

Every runner of whole experiments (the pipeline's cells, compare, the parity runs, the benchmarks, the tests) starts
``python -m resilience`` through this module. A run's supervisor starts rank processes in its process group; if
the runner only killed the supervisor on a timeout or a Ctrl-C, the ranks would train on as orphans. Here the
group gets SIGTERM (the supervisor stops its ranks and writes what it measured), then SIGKILL after a grace
period, on every way out: normal exit, timeout, exception, KeyboardInterrupt.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Sequence

from resilience.proc import pool

GRACE_S = 10.0  # SIGTERM to SIGKILL: a supervisor stops its ranks within timeouts.shutdown_s (5 s by default)


def experiment_command(overrides: Sequence[str], run_dir: Path | str | None = None) -> list[str]:
    """``python -m resilience OVERRIDES hydra.run.dir=RUN_DIR`` with this interpreter (forked from the pipeline's
    preloaded interpreter when it has one: ``resilience.proc.pool``)."""
    # Quoted: a directory name may hold "=", which Hydra's override grammar reads as a second assignment.
    tail = [f"hydra.run.dir='{run_dir}'"] if run_dir is not None else []
    return pool.command("resilience", [*overrides, *tail])


def processes_mentioning(text: str) -> list[int]:
    """PIDs of live (non-zombie) processes whose command line contains ``text`` (e.g. a run directory)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if text in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


def kill_mentioning(text: str, within_s: float = GRACE_S) -> None:
    """SIGKILL every process naming ``text`` (a rank that left the group with its own session), until none is left
    or ``within_s`` has passed."""
    deadline = time.monotonic() + within_s
    while (pids := processes_mentioning(text)) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


class Child:
    """A running command in its own session. Use it as a context manager: leaving the block ends its group."""

    def __init__(self, cmd: Sequence[str], cwd: Path | str | None = None, stdout: int | IO | None = subprocess.PIPE,
                 stderr: int | IO | None = subprocess.PIPE, env: dict[str, str] | None = None,
                 grace_s: float = GRACE_S) -> None:
        self.cmd, self.grace_s = list(cmd), grace_s
        self.proc = subprocess.Popen(self.cmd, cwd=cwd, stdout=stdout, stderr=stderr, text=True, env=env,
                                     start_new_session=True)

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait(self, timeout_s: float | None) -> bool:
        """Wait for the command; False if it ran over ``timeout_s`` (it is still running then)."""
        try:
            self.proc.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False

    def stop(self) -> None:
        """SIGTERM the group, SIGKILL it after the grace period; also kills what the command left in its group."""
        if self.proc.poll() is None:
            signal_group(self.proc.pid, signal.SIGTERM)
            if not self.wait(self.grace_s):
                signal_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        signal_group(self.proc.pid, signal.SIGKILL)  # helpers left behind in the group


@dataclass(frozen=True)
class Finished:
    returncode: int | None  # None: killed after running over the timeout
    stdout: str
    stderr: str

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def run(cmd: Sequence[str], timeout_s: float, cwd: Path | str | None = None, merge_stderr: bool = False,
        echo: bool = False, env: dict[str, str] | None = None) -> Finished:
    """Run ``cmd`` to the end (or ``timeout_s``); its output, captured (``echo``: stdout passed through)."""
    stdout = None if echo else subprocess.PIPE
    stderr = subprocess.STDOUT if merge_stderr else subprocess.PIPE
    with Child(cmd, cwd=cwd, stdout=stdout, stderr=stderr, env=env) as child:
        try:
            out, err = child.proc.communicate(timeout=timeout_s)
            return Finished(child.proc.returncode, out or "", err or "")
        except subprocess.TimeoutExpired:
            child.stop()
            try:
                out, err = child.proc.communicate(timeout=GRACE_S)
            except subprocess.TimeoutExpired:  # a process that left the group still holds the pipes: stop reading
                out, err = "", "(output not read: a process outside the command's group kept its pipes open)"
            return Finished(None, out or "", err or "")
