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

from reports.cell import processes_mentioning

ROOT = Path(__file__).resolve().parent.parent


def run_module(module: str, *args: str, timeout: float, merge_stderr: bool = False) -> subprocess.CompletedProcess:
    """``python -m MODULE ARGS`` from the repository root in its own process group; killed whole on timeout."""
    proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"python -m {module} {' '.join(args)} ran over {timeout} s\n{out[-5000:]}\n{err or ''}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err or "")


def run_cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """``python -m resilience ARGS``."""
    return run_module("resilience", *args, timeout=timeout)


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
