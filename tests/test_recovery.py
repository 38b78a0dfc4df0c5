"""End to end: real rank processes, a real SIGKILL, a real restart, and a bit-exact final state."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import ROOT, processes_mentioning, run_cli, run_experiment
from resilience.proc import child
from resilience.ckpt.shm_store import SHM_DIR, run_id
from resilience.record.events import read_events

COMMON = ("steps=30", "checkpoint.every=5", "world_size=2", "seed=0")

# (description, overrides, expected lost steps)
# (sync killed before forward: tests/test_faults.py, "kill")
SCENARIOS = [
    ("none: killed at step 13 -> restart from scratch", ("strategy=none", "fault=kill", "fault.rank=1",
                                                        "fault.at_step=13"), 13),
    ("sync: rank 0 sent SIGTERM between backward and optimizer step", (
        "strategy=sync", "fault=kill", "fault.rank=0", "fault.at_step=7", "fault.phase=before_optimizer_step",
        "fault.signal=SIGTERM"), 2),
    ("sync: rank 1 killed in the middle of the step-15 save -> previous checkpoint", (
        "strategy=sync", "fault=kill", "fault.rank=1", "fault.at_step=15", "fault.phase=during_checkpoint"), 5),
    ("async: newest checkpoint's data flipped, then rank 1 killed; no integrity detector -> the one before", (
        "strategy=async", "fault=ckpt_damage", "fault.how=flip", "fault.rank=1", "fault.at_step=13",
        "detector=[process_exit]"), 8),
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("description,overrides,lost", SCENARIOS, ids=[s[0].split(":")[0] + f"-{i}"
                                                                      for i, s in enumerate(SCENARIOS)])
def test_kill_and_recover_bit_exact(tmp_path, reference, description, overrides, lost):
    result = run_experiment(tmp_path / "run", *overrides, *COMMON)
    assert result["status"] == "ok"
    assert result["fault_injected"] and result["detected"] and result["recovered"]
    assert result["detector"] == "process_exit"
    assert result["detected_rank"] == result["fault_rank"]
    assert result["lost_steps"] == lost
    assert result["steps_completed"] == 30
    assert result["replicas_agree"]
    assert result["final_state_sha256"] == reference["final_state_sha256"], description
    # the first attempt's ranks forked from the zygote (conf/config.yaml), the restarts as the suite sets them
    # (tests/conftest.py: RB_RESTARTS, preloaded unless set otherwise)
    assert (result["first_start"], result["restarts"]) == ("preloaded", os.environ["RB_RESTARTS"])
    preloaded = [e["preloaded"] for e in read_events(tmp_path / "run") if e["kind"] == "run_start"]
    assert all(preloaded) == (os.environ["RB_RESTARTS"] == "preloaded"), preloaded


@pytest.mark.timeout(240)
def test_fault_free_runs_are_deterministic(tmp_path, reference):
    again = run_experiment(tmp_path / "again", "strategy=sync", "fault=none", *COMMON)
    assert again["status"] == "ok" and not again["fault_injected"]
    assert again["final_state_sha256"] == reference["final_state_sha256"]
    assert again["false_alarms"] == 0


@pytest.mark.timeout(240)
def test_restart_budget_exhausted_is_unrecovered_not_a_crash(tmp_path):
    result = run_experiment(tmp_path / "run", "strategy=sync", "fault=kill", "fault.rank=1", "fault.at_step=3",
                            "recovery=fail", *COMMON)
    assert result["status"] == "unrecovered"
    assert result["detected"] and not result["recovered"]
    assert result["final_state_sha256"] is None


@pytest.mark.timeout(240)
def test_torchrun_two_nodes_recover_bit_exact(tmp_path, reference):
    """The multi-node path: workflow/scripts/run_multinode.sh on two "nodes" (two torchrun agents, as on two
    hosts) with one rank each; node 0 prepares the config, each node resolves device and backend; rank 1 is
    killed and the run recovers bit-exact."""
    run_dir = tmp_path / "run"
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "NNODES": "2", "NPROC_PER_NODE": "1", "RDZV_ENDPOINT": f"localhost:{port}",
           "RUN_DIR": str(run_dir), "RDZV_ID": "test", "PYTHON": sys.executable}
    # Two "nodes" on one host would each take all its cores (threads = local cores / local ranks): the reference's
    # thread count is fixed, since CPU kernels split reductions by thread count (README, Determinism).
    cmd = [str(ROOT / "workflow" / "scripts" / "run_multinode.sh"), "strategy=sync", "fault=kill", "fault.rank=1",
           "fault.at_step=12", *COMMON, f"threads_per_rank={max(1, (os.cpu_count() or 1) // 2)}"]
    nodes = [subprocess.Popen(cmd, cwd=ROOT, env={**env, "NODE_RANK": str(node)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True) for node in (0, 1)]
    try:
        outputs = [n.communicate(timeout=200)[0] for n in nodes]
    finally:
        for n in nodes:
            if n.poll() is None:
                os.killpg(n.pid, signal.SIGKILL)
    assert [n.returncode for n in nodes] == [0, 0], outputs
    assert processes_mentioning(str(run_dir)) == []
    assert OmegaConf.load(run_dir / "config.yaml").device == "auto"  # decided by each node, not where prepared
    r = json.loads((run_dir / "result.json").read_text())
    assert r["status"] == "ok" and r["recovered"] and r["lost_steps"] == 2
    assert r["final_state_sha256"] == reference["final_state_sha256"]


def started(tmp_path, *overrides: str) -> tuple[child.Child, Path]:
    """A long in-memory run (shared memory in use) in its own session, once its ranks are training."""
    run_dir = tmp_path / "run"
    proc = child.Child(child.experiment_command(["strategy=inmemory", "steps=400", "checkpoint.every=2",
                                                 "world_size=2", "detector=[process_exit]", *overrides], run_dir),
                       cwd=ROOT)
    deadline = time.monotonic() + 120
    while not any(e["kind"] == "ckpt_memory_saved" for e in read_events(run_dir)):
        assert proc.proc.poll() is None and time.monotonic() < deadline, "the run did not start training"
        time.sleep(0.2)
    return proc, run_dir


def nothing_left_within(run_dir: Path, seconds: float) -> bool:
    rid = run_id(run_dir)
    deadline = time.monotonic() + seconds
    while processes_mentioning(str(run_dir)) or list(SHM_DIR.glob(f"*{rid}*")):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.timeout(240)
def test_ctrl_c_stops_the_ranks_frees_memory_and_records_an_interrupted_run(tmp_path):
    proc, run_dir = started(tmp_path)
    with proc:
        proc.proc.send_signal(signal.SIGINT)  # the supervisor alone, as `kill -INT` would
        out, err = proc.proc.communicate(timeout=60)
    assert proc.proc.returncode == 130
    assert err.strip().count("\n") == 0 and err.startswith("interrupted by SIGINT"), err
    assert nothing_left_within(run_dir, 5)
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "interrupted" and result["steps_completed"] > 0


@pytest.mark.timeout(240)
def test_a_killed_supervisor_takes_its_ranks_and_their_memory_along(tmp_path):
    proc, run_dir = started(tmp_path)
    with proc:
        os.kill(proc.proc.pid, signal.SIGKILL)
        proc.proc.wait(timeout=10)
        assert nothing_left_within(run_dir, 5)  # nobody cleaned up for them: the ranks did it themselves
    assert not (run_dir / "result.json").exists()
    done = subprocess.run([sys.executable, "-m", "resilience.result", str(run_dir)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("result: interrupted"), done.stdout + done.stderr
    assert json.loads((run_dir / "result.json").read_text())["status"] == "interrupted"
