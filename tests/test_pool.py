"""The pipeline's preloaded interpreter (resilience.proc.pool): a forked supervisor trains as a cold one, names itself
as a cold one would, dies with its cell, and a cell without a pool starts cold."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from resilience.proc import child
from resilience.proc.pool import POOL_ENV, Pool
from resilience.record.events import read_events
from resilience.strategies.replica import measured_rank_start_s
from tests.conftest import left_nothing, run_experiment, sigkill_seen

# the session's reference training (tests/conftest.py: sync, 30 steps, a checkpoint every 5), a rank killed
KILL = ("strategy=sync", "steps=30", "checkpoint.every=5", "world_size=2", "seed=0", "fault=kill", "fault.rank=1",
        "fault.at_step=13", "supervisor.restarts=cold")


@pytest.fixture(scope="module")  # one pool for the file, as for a pipeline: it imports once, at its first command
def pool():
    outer = os.environ.get(POOL_ENV)  # the suite's own pool (tests/conftest.py), unless run cold
    started = Pool.start()
    assert started is not None, "the pool did not come up"
    try:
        yield started
    finally:
        started.stop()
        assert started.proc.returncode == 0 and os.environ.get(POOL_ENV) == outer


@pytest.fixture(scope="module")
def cold_reference(tmp_path_factory) -> dict:
    """The session's reference training (tests/conftest.py) started as a user's command starts: cold, whatever pool
    the suite runs its other commands from."""
    name = os.environ.pop(POOL_ENV, None)
    try:
        return run_experiment(tmp_path_factory.mktemp("cold") / "reference", "strategy=sync", "fault=none",
                              "steps=30", "checkpoint.every=5", "world_size=2", "seed=0")
    finally:
        if name is not None:
            os.environ[POOL_ENV] = name


def test_a_supervisor_forked_from_the_pool_recovers_bit_exact_and_says_how_it_started(pool, cold_reference,
                                                                                      reference, tmp_path):
    run_dir = tmp_path / "run"
    shm_before = set(os.listdir("/dev/shm"))
    cmd = child.experiment_command(KILL, run_dir)
    assert cmd[4:7] == ["--module", "resilience", pool.name]  # the stub, not a cold interpreter
    done = child.run(cmd, timeout_s=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    left_nothing(run_dir, shm_before)
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "ok" and result["recovered"]
    assert result["final_state_sha256"] == cold_reference["final_state_sha256"]  # recovered bit for bit
    assert (result["supervisor_start"], result["first_start"], result["restarts"]) == ("preloaded", "preloaded", "cold")
    assert cold_reference["supervisor_start"] == "cold"  # started as a user's command is
    # two fault-free runs of one training agree bit for bit: this cold one and the session's, from the suite's pool
    # (cold too under RB_TEST_COLD=1)
    assert cold_reference["final_state_sha256"] == reference["final_state_sha256"]
    events = read_events(run_dir)
    # the first attempt's ranks forked from the zygote, the restart's started cold (supervisor.restarts=cold)
    starts = sorted((e["attempt"], e["rank"], e["preloaded"]) for e in events if e["kind"] == "run_start")
    assert starts == [(0, 0, True), (0, 1, True), (1, 0, False), (1, 1, False)], starts
    # the kill as the supervisor saw it: rank 1's stub, the process it watches, died of the same SIGKILL
    sigkill_seen(events)
    assert result["detector"] == "process_exit" and result["detected_rank"] == 1 and result["detected_rank_correct"]
    # killed before step 13's forward pass: sync's step-10 checkpoint (checkpoint.every=5) is loaded
    assert result["lost_steps"] == 3
    # a replacement's deadline (strategy=replica's auto) counts the pool's imports its zygote inherited: without them
    # a preloaded first start read 1.5 s where the cold restart took 4.8 s (and 0.38 s in a matrix, where 10x of it
    # was missed); with them 5.2 s
    restart = next(e["t_mono"] for e in events if e["kind"] == "restart")
    cold = min(e["t_mono"] for e in events if e["kind"] == "run_start" and e["attempt"] == 1) - restart
    assert measured_rank_start_s(events) > cold / 2, (measured_rank_start_s(events), cold)


def test_a_config_error_through_the_pool_is_one_line_and_exit_2(pool, tmp_path):
    done = child.run(child.experiment_command(["strategy=no_such_strategy"], tmp_path / "bad"), timeout_s=60)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "strategy" in done.stderr, done.stderr


def test_a_killed_cell_takes_its_forked_supervisor_and_ranks_along(pool, tmp_path):
    """What reports.cell does on its time limit, without the grace: SIGKILL to the command's group (the stub)."""
    run_dir = tmp_path / "run"
    running = child.Child(child.experiment_command(["strategy=sync", "steps=2000", "world_size=2"], run_dir))
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and b'"step_end"' not in _read(run_dir / "events.jsonl"):
            time.sleep(0.1)
        named = child.processes_mentioning(str(run_dir))
        assert len(named) >= 5, named  # stub, supervisor, zygote, two ranks (and their stubs): each names the run
        child.signal_group(running.proc.pid, signal.SIGKILL)
        running.proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while child.processes_mentioning(str(run_dir)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert child.processes_mentioning(str(run_dir)) == [], "the forked supervisor or its ranks outlived the cell"
    finally:
        running.stop()
        child.kill_mentioning(str(run_dir))


def test_a_cell_without_its_pool_starts_cold(monkeypatch):
    monkeypatch.setenv(POOL_ENV, "rb-pool-that-is-not-there")
    done = child.run(child.experiment_command(["--help"]), timeout_s=60)
    assert done.returncode == 0 and "Usage" in done.stdout
    monkeypatch.delenv(POOL_ENV)
    assert child.experiment_command([])[1:3] == ["-m", "resilience"]


def _read(path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""
