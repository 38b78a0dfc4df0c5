"""A library's checkpoint worker outlives a preemption's SIGTERM (resilience/libs/worker_notice.py): from its first
instant, while its rank keeps its own handler; and it still ends with its rank, whether the rank exits or is
SIGKILLed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

RANK = Path(__file__).resolve().parent / "worker_notice_rank.py"


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def _rank(mode: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(RANK), mode], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)


def _report(rank: subprocess.Popen) -> dict:
    return json.loads(rank.stdout.readline())


def _finished(mode: str) -> dict:
    """Run the stand-in rank in ``mode`` to its end (exit 0); its report."""
    rank = _rank(mode)
    try:
        report = _report(rank)
        assert rank.wait(timeout=30) == 0
    finally:
        os.killpg(rank.pid, signal.SIGKILL) if rank.poll() is None else None
    return report


def test_a_sigterm_in_the_workers_start_up_is_ignored_and_the_rank_keeps_its_handler():
    report = _finished("term")
    assert report["worker_alive"] and report["worker_ignores_term"]
    assert not report["rank_ignores_term"] and report["rank_noted_term"] == 1  # its own handler, restored
    assert _gone(report["worker"], 10)  # ended at the rank's exit


def test_a_rank_that_exits_ends_its_worker_instead_of_waiting_for_it():
    started = time.monotonic()
    report = _finished("exit")
    assert time.monotonic() - started < 25  # the worker sleeps 60 s: multiprocessing's terminate() is ignored
    assert _gone(report["worker"], 5)


@pytest.mark.parametrize("after_s", [0.0, 3.0], ids=["in-its-start-up", "started"])
def test_a_worker_ends_with_its_sigkilled_rank(after_s):
    rank = _rank("wait")
    try:
        report = _report(rank)
        time.sleep(after_s)  # 0: the worker still imports, and will find itself orphaned
        os.kill(rank.pid, signal.SIGKILL)
        rank.wait(timeout=10)
        assert _gone(report["worker"], 10)
    finally:
        try:
            os.killpg(rank.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("mode", ["helper", "forkserver"])
def test_a_helper_started_otherwise_outlives_the_notice_and_ends_with_its_rank(mode):
    """Spawned inside a library's call (NVRx's manager), or a module's function started by a fork server
    (DLRover's saver)."""
    report = _finished(mode)
    assert report["worker_alive"] and report["worker_ignores_term"] and report.get("queue", "written") == "written"
    assert _gone(report["worker"], 10)
