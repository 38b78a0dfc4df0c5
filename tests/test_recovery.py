"""End to end: real rank processes, a real SIGKILL, a real restart, and a bit-exact final state."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from conftest import ROOT, processes_mentioning, run_cli, run_experiment

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
    """The multi-node path: two torchrun agents (as on two hosts) run the prepared config; rank 1 is killed."""
    run_dir = tmp_path / "run"
    done = run_cli("supervisor.launcher=external", "strategy=sync", "fault=kill", "fault.rank=1",
                   "fault.at_step=12", *COMMON, f"hydra.run.dir={run_dir}", timeout=100)
    assert done.returncode == 0 and "torchrun" in done.stdout
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=localhost:{port}", "--rdzv-id=test", "--max-restarts=2",
           "-m", "resilience.rank", str(run_dir / "config.yaml")]
    agents = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True) for _ in range(2)]
    try:
        assert [a.wait(timeout=180) for a in agents] == [0, 0]
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
    assert processes_mentioning(str(run_dir)) == []
    result = subprocess.run([sys.executable, "-m", "resilience.record.result", str(run_dir)], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    r = json.loads((run_dir / "result.json").read_text())
    assert r["status"] == "ok" and r["recovered"] and r["lost_steps"] == 2
    assert r["final_state_sha256"] == reference["final_state_sha256"]
