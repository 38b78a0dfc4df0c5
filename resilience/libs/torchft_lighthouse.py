"""torchft's lighthouse, run by the supervisor for the whole run (an ``AgentService``).

The lighthouse forms each step's quorum of replica groups and declares a group dead when its heartbeats stop; it
must outlive every rank, so the supervisor, not a rank, runs it. It is the library's own binary
(``torchft_lighthouse``, installed with torchft), its output in ``lighthouse.log`` in the run directory; the address
it prints reaches the ranks as ``TORCHFT_LIGHTHOUSE``, the variable torchft's ``Manager`` reads.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
LOG_FILE = "lighthouse.log"
LISTENING = re.compile(rb"Lighthouse listening on: (\S+)")
START_TIMEOUT_S = 30.0


class Lighthouse:
    """Starts the ``torchft_lighthouse`` process, publishes its address, stops it at the end of the run."""

    role = None  # nothing reads the workers' role name

    def __init__(self, min_replicas: int, heartbeat_timeout_ms: int, join_timeout_ms: int, quorum_tick_ms: int) -> None:
        self.args = ["--bind", "[::]:0", "--min_replicas", str(min_replicas),
                     "--heartbeat_timeout_ms", str(heartbeat_timeout_ms), "--join_timeout_ms", str(join_timeout_ms),
                     "--quorum_tick_ms", str(quorum_tick_ms)]
        self.proc: subprocess.Popen | None = None

    def start(self, run_id: str, run_dir: Path) -> None:
        log = Path(run_dir) / LOG_FILE
        with open(log, "ab") as out:  # the child keeps its own descriptor
            self.proc = subprocess.Popen([_binary(), *self.args], stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        os.environ[LIGHTHOUSE_ENV] = self._address(log)

    def _address(self, log: Path) -> str:
        """The address the lighthouse prints once it listens (port 0: the system chose it)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            found = LISTENING.search(log.read_bytes())
            if found:
                return found.group(1).decode()
            if self.proc.poll() is not None:
                raise RuntimeError(f"torchft_lighthouse exited with status {self.proc.returncode}; see {log}")
            time.sleep(0.02)
        raise RuntimeError(f"torchft_lighthouse printed no address within {START_TIMEOUT_S:.0f} s; see {log}")

    def before_restart(self) -> None:
        """Nothing: the lighthouse drops a dead group by its heartbeats and admits the replacement by itself."""

    def close(self) -> None:
        os.environ.pop(LIGHTHOUSE_ENV, None)
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            self.proc.wait()


def _binary() -> str:
    """The ``torchft_lighthouse`` script of this interpreter's environment (on PATH only when it is activated)."""
    here = Path(sys.executable).parent / "torchft_lighthouse"
    found = str(here) if here.exists() else shutil.which("torchft_lighthouse")
    if found is None:
        raise ValueError("torchft_lighthouse: not found beside this Python or on PATH; install the extra: "
                         "pip install -e '.[torchft]'")
    return found
