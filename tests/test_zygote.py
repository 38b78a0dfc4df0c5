"""Ranks forked preloaded (resilience.proc.zygote): the same training, restarts cold unless asked, nothing left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from resilience.proc.zygote import STUB, Zygote, cold_argv, launcher_pid
from tests.conftest import run_experiment

KILL = ("steps=12", "checkpoint.every=4", "fault=kill", "fault.rank=1", "fault.at_step=7")


def run_starts(run_dir) -> list[tuple[int, int, bool]]:
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return sorted((e["attempt"], e["rank"], e["preloaded"]) for e in events if e["kind"] == "run_start")


def test_a_preloaded_first_attempt_trains_as_a_cold_one_and_its_restart_is_cold(tmp_path):
    """The suite runs with RB_RESTARTS=preloaded (conftest): each run here names its restarts."""
    warm = run_experiment(tmp_path / "warm", *KILL, "supervisor.restarts=cold")
    cold = run_experiment(tmp_path / "cold", *KILL[:2], "supervisor.first_start=cold", "supervisor.restarts=cold")
    forked = run_experiment(tmp_path / "forked", *KILL, "supervisor.restarts=preloaded")
    assert warm["recovered"] and forked["recovered"] and cold["status"] == "ok"  # cold: fault-free, the same end
    assert warm["final_state_sha256"] == cold["final_state_sha256"] == forked["final_state_sha256"]
    assert warm["first_start"] == "preloaded" and cold["first_start"] == "cold"
    assert (warm["restarts"], cold["restarts"], forked["restarts"]) == ("cold", None, "preloaded")
    assert run_starts(tmp_path / "warm") == [(0, 0, True), (0, 1, True), (1, 0, False), (1, 1, False)]
    assert run_starts(tmp_path / "cold") == [(0, 0, False), (0, 1, False)]
    assert run_starts(tmp_path / "forked") == [(0, 0, True), (0, 1, True), (1, 0, True), (1, 1, True)]
    assert warm["detector"] == "process_exit" and warm["detected_rank"] == 1  # the stub died of the same SIGKILL


def test_a_stub_that_finds_no_zygote_starts_the_rank_cold_and_a_killed_stub_takes_its_rank_along(tmp_path):
    """The stub's two ways out of the zygote path, without a run: no listener (exec'd cold: same pid, the cold
    command line), and a rank forked for a stub that is then SIGKILLed (the rank dies too, the zygote ends)."""
    config = tmp_path / "config.yaml"  # never read: the cold rank fails on it, the forked one is killed first
    config.write_text("{}\n")
    stub = subprocess.Popen([sys.executable, "-u", "-S", str(STUB), "rb-zygote-none", str(config)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    cmdline = open(f"/proc/{stub.pid}/cmdline", "rb").read().split(b"\0") if stub.poll() is None else []
    stub.wait(timeout=60)
    assert cmdline == [] or cmdline[1:4] == [b"-u", b"-m", b"resilience.rank"], cmdline  # exec'd in place
    assert cold_argv(config)[1:4] == ["-u", "-m", "resilience.rank"]

    zygote = Zygote.start(1, config, [])  # nothing preloaded: the fork's rank starts its own imports
    try:
        assert zygote.ready()
        env = {**os.environ, "TORCHELASTIC_RESTART_COUNT": "0"}
        stub = subprocess.Popen(zygote.rank_argv(config), env=env, start_new_session=True)
        rank = _forked_child(zygote.proc.pid)
        # The rank imports torch and then fails on this config: >= 1 s on an idle core. Killed at once, its stub's
        # death must end it well before that (its lifeline reacts in milliseconds).
        os.kill(stub.pid, signal.SIGKILL)
        stub.wait(timeout=10)
        _wait_gone(rank, within_s=0.5)
        zygote.proc.wait(timeout=10)  # its one rank started and ended: it has nothing left to do
    finally:
        zygote.close()


def test_a_preloaded_rank_names_the_supervisor_as_its_launcher(monkeypatch):
    monkeypatch.setenv("RB_LAUNCHER_PID", "4242")
    assert launcher_pid() == 4242
    monkeypatch.delenv("RB_LAUNCHER_PID")
    assert launcher_pid() == os.getppid()


def _forked_child(parent: int, within_s: float = 30) -> int:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            children = open(f"/proc/{parent}/task/{parent}/children").read().split()
        except OSError:
            children = []
        if children:
            return int(children[0])
        time.sleep(0.05)
    pytest.fail("the zygote forked no rank")


def _wait_gone(pid: int, within_s: float = 10) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            return
        if state == "Z":
            return
        time.sleep(0.05)
    pytest.fail(f"rank {pid} outlived its SIGKILLed stub")
