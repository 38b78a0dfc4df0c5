"""End to end: real rank processes, a real SIGKILL, a real restart, and a bit-exact final state."""

from __future__ import annotations

import pytest

from conftest import run_experiment

COMMON = ("steps=30", "checkpoint.every=5", "world_size=2", "seed=0")

# (description, overrides, expected lost steps)
SCENARIOS = [
    ("sync: killed before forward at step 13 -> reload step 10", ("strategy=sync", "fault=kill", "fault.rank=1",
                                                                 "fault.at_step=13"), 3),
    ("none: killed at step 13 -> restart from scratch", ("strategy=none", "fault=kill", "fault.rank=1",
                                                        "fault.at_step=13"), 13),
    ("sync: rank 0 killed between backward and optimizer step", ("strategy=sync", "fault=kill", "fault.rank=0",
                                                                 "fault.at_step=7",
                                                                 "fault.phase=before_optimizer_step"), 2),
    ("sync: rank 1 killed in the middle of the step-15 save -> previous checkpoint", (
        "strategy=sync", "fault=kill", "fault.rank=1", "fault.at_step=15", "fault.phase=during_checkpoint"), 5),
    ("sync: SIGTERM instead of SIGKILL", ("strategy=sync", "fault=kill", "fault.rank=1", "fault.at_step=22",
                                          "fault.signal=SIGTERM"), 2),
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
