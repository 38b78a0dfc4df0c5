"""torchft as a recovery peer (``strategy=replica_torchft``): the library's Manager, DDP and Optimizer in every rank,
its lighthouse run by the supervisor. Fault-free, every step commits at full width; after a kill, the survivor trains
on in the same process, the replacement heals from it, and every replica ends with the same state."""

from __future__ import annotations

import math

import pytest

from resilience.record.events import read_events
from resilience.libs.torchft_lighthouse import LOG_FILE
from tests.conftest import run_experiment

try:
    import torchft  # noqa: F401
except ImportError:
    pytest.skip("torchft is not installed: pip install -e '.[torchft]' (or .[peers])", allow_module_level=True)

COMMON = ("strategy=replica_torchft", "steps=30", "world_size=2", "seed=0", "detector=[process_exit]")
KILL = ("fault=kill", "fault.rank=1", "fault.at_step=13")


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory) -> dict:
    run_dir = tmp_path_factory.mktemp("torchft") / "free"
    return {"dir": run_dir, "result": run_experiment(run_dir, "fault=none", *COMMON, timeout=200)}


def check_library_record(result: dict) -> None:
    assert result["peer"]["library"] == "torchft" and result["peer"]["version"] == "0.2.0"


@pytest.mark.timeout(240)
def test_fault_free_run_commits_every_step_at_full_width_bit_exact(fault_free, reference):
    result = fault_free["result"]
    assert result["status"] == "ok" and result["steps_completed"] == 30
    assert result["reduced_width_steps"] == 0 and result["replicas_consistent"] is True
    # torchft's gradient average over gloo is our DDP's, bit for bit: held to the check like every strategy.
    assert result["bit_exact"] is None and result["final_state_sha256"] == reference["final_state_sha256"]
    check_library_record(result)
    assert result["peer_patches"] == ["ddp_hook_after_failed_allreduce"]
    assert "Lighthouse listening on" in (fault_free["dir"] / LOG_FILE).read_text()


@pytest.mark.timeout(300)
def test_a_killed_group_is_replaced_and_heals_while_the_survivor_trains_on(tmp_path, reference):
    run_dir = tmp_path / "run"
    # A cold replacement, as in production: one forked from the preloaded interpreter (the suite's RB_RESTARTS) can
    # be back before the survivor's next step, which then never trains alone
    result = run_experiment(run_dir, *KILL, *COMMON, "supervisor.restarts=cold", timeout=240)
    events = read_events(run_dir)
    assert result["status"] == "ok", result
    # The survivor is one process from start to end; only rank 1 was started again.
    assert len({e["pid"] for e in events if e["kind"] == "run_start" and e["rank"] == 0}) == 1
    assert result["survivors_restarted"] is False and result["lost_steps"] == 0
    assert result["steps_completed"] == 30
    check_library_record(result)
    assert result["peer_patches"] == ["ddp_hook_after_failed_allreduce"]  # what lets the survivor train on
    assert result["bit_exact"] == "not by design"  # the survivor trained alone: another trajectory
    assert result["heal_s"] > 0 and result["heal_transfer_s"] > 0 and result["heal_bytes"] > 1_000_000
    assert result["quorum_detection_s"] is not None and result["survivors_stall_s"] is not None
    assert result["reduced_width_steps"] >= 1  # the survivor trained alone while rank 1 came back
    assert result["replicas_consistent"] is True  # the finding to look for: a heal into a different state
    # the session's reference is this training fault-free; torchft's fault-free run ends on its state (above)
    assert math.isfinite(result["final_loss"]) and result["final_loss"] != reference["final_loss"]
    log = (run_dir / LOG_FILE).read_text()
    assert "Lighthouse listening on" in log and "Quorum!" in log


@pytest.mark.timeout(300)
def test_with_every_group_required_the_survivor_waits_and_the_heal_is_bit_exact(tmp_path, reference):
    """``min_replicas`` = all groups: no step commits without the dead group, so the survivor waits for the
    replacement (as our ``replica`` does) and the run ends in the fault-free state."""
    result = run_experiment(tmp_path / "run", *KILL, *COMMON, "strategy.min_replicas=2", timeout=240)
    assert result["status"] == "ok" and result["survivors_restarted"] is False
    assert result["reduced_width_steps"] == 0 and result["heal_bytes"] > 1_000_000
    assert result["bit_exact"] is None and result["final_state_sha256"] == reference["final_state_sha256"]


@pytest.mark.timeout(300)
def test_as_shipped_the_survivor_of_a_kill_mid_allreduce_crashes(tmp_path):
    """The finding behind the patch: torchft 0.2.0's DDP hook asserts when the all-reduce fails, so the survivor
    dies too and the run can only restart from scratch (the state of every replica is lost)."""
    run_dir = tmp_path / "run"
    result = run_experiment(run_dir, *KILL, *COMMON, "strategy.patches=none", timeout=240)
    assert result["peer_patches"] == []
    errors = [e["error"] for e in read_events(run_dir) if e["kind"] == "rank_error" and e["rank"] == 0]
    assert errors and errors[0].startswith("AssertionError"), errors
