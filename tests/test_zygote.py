"""Ranks forked preloaded (resilience.proc.zygote): a cold first attempt trains as the preloaded ones do, a stub
with no zygote starts its rank cold, a killed stub takes its rank along. A preloaded first attempt with a cold
restart is tests/test_pool.py's run; one forked at every start, every kill test's (tests/conftest.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from resilience.proc.zygote import STUB, Zygote, cold_argv, launcher_pid
from tests.conftest import SHORT, run_experiment


def run_starts(run_dir) -> list[tuple[int, int, bool]]:
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return sorted((e["attempt"], e["rank"], e["preloaded"]) for e in events if e["kind"] == "run_start")


def test_a_cold_first_attempt_trains_as_a_preloaded_one(tmp_path, fault_free_run):
    """The suite runs with RB_RESTARTS=preloaded (conftest): the run here names its restarts."""
    # SHORT's fault-free run (strategy=none), the session's (tests/test_jit.py's reference), started preloaded as
    # conf/config.yaml says: the same training, and the strategy does not change the final state
    preloaded = fault_free_run(*SHORT)
    cold = run_experiment(tmp_path / "cold", *SHORT, "supervisor.first_start=cold", "supervisor.restarts=cold")
    assert cold["status"] == "ok" and not cold["fault_injected"]
    assert cold["final_state_sha256"] == preloaded["final_state_sha256"]
    assert (preloaded["first_start"], cold["first_start"]) == ("preloaded", "cold")
    assert cold["restarts"] is None  # fault-free: no restart to say anything of
    assert run_starts(tmp_path / "cold") == [(0, 0, False), (0, 1, False)]


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
