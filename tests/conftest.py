"""Shared helpers: run the experiment command as a user would, and check that it leaves nothing behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def processes_mentioning(text: str) -> list[int]:
    """PIDs of live processes whose command line contains ``text`` (e.g. a run directory)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().split()[2]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


def run_cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """``python -m resilience ARGS`` in its own process group; on timeout the whole group is killed."""
    proc = subprocess.Popen([sys.executable, "-m", "resilience", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"python -m resilience {' '.join(args)} ran over {timeout} s\n{out}\n{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_experiment(run_dir: Path, *overrides: str, timeout: float = 180) -> dict:
    """Run one experiment to completion, assert the harness succeeded and left no process, return result.json."""
    done = run_cli(*overrides, f"hydra.run.dir={run_dir}", timeout=timeout)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    deadline = time.monotonic() + 10
    while processes_mentioning(str(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_mentioning(str(run_dir)) == [], "rank processes outlived the run"
    return json.loads((run_dir / "result.json").read_text())


@pytest.fixture(scope="session")
def runs_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="session")
def reference(runs_root) -> dict:
    """The fault-free run that recovered runs must match bit for bit."""
    return run_experiment(runs_root / "reference", "strategy=sync", "fault=none", "steps=30", "checkpoint.every=5",
                          "world_size=2", "seed=0")
