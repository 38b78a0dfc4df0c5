"""NVRx's in-process restart as a recovery policy (``recovery=nvrx_inprocess``): fault-free it is the plain run; after
a rank raises inside the step every rank trains again in its own process from the newest checkpoint and ends
bit-exact with the fault-free run; a dead process is the supervisor's to restart, and result.json says which of the
two recovered the run."""

from __future__ import annotations

import importlib.util

import pytest

from tests.conftest import run_cli, run_experiment


needs_nvrx = pytest.mark.skipif(importlib.util.find_spec("nvidia_resiliency_ext") is None,
                                reason="nvidia_resiliency_ext is not installed: pip install -e '.[nvrx]'")
COMMON = ("recovery=nvrx_inprocess", "strategy=sync", "steps=30", "checkpoint.every=5", "world_size=2", "seed=0")


@needs_nvrx
@pytest.mark.timeout(300)
def test_fault_free_run_is_the_plain_run(tmp_path, reference):
    result = run_experiment(tmp_path / "run", *COMMON, "fault=none")
    assert result["status"] == "ok" and result["attempts"] == 1 and result["false_alarms"] == 0
    info = result["inprocess"]
    assert info["library"] == "nvidia-resiliency-ext" and info["version"] == "0.4.1"
    assert info["restarts"] == 0 and info["recovered_by"] is None
    assert info["patches"] == ["gloo_abort_by_socket_shutdown"]  # declared: the one workaround, on gloo
    assert result["final_state_sha256"] == reference["final_state_sha256"]


@needs_nvrx
@pytest.mark.timeout(300)
def test_a_raised_error_is_restarted_in_the_same_processes_bit_exact(tmp_path, reference):
    run_dir = tmp_path / "run"
    result = run_experiment(run_dir, *COMMON, "fault=kill", "fault.signal=exception", "fault.rank=1",
                            "fault.at_step=13")
    assert result["recovered"] and result["status"] == "ok" and result["attempts"] == 2
    assert result["detector"] == "nvrx_inprocess" and result["detected_rank"] == 1  # NVRx's own blame
    info = result["inprocess"]
    assert info["recovered_by"] == "in_process" and info["restarts"] == 1 and info["fallback"] is None
    # in place: no process was started again (the supervisor restarted nothing; each rank kept its pid)
    assert result["recovery_breakdown_s"]["restart"] < 30  # not the collective timeout: the workaround's effect
    assert result["lost_steps"] == 3 and result["recovery_source"] is not None
    assert result["final_state_sha256"] == reference["final_state_sha256"]
    assert list(run_dir.glob("nvrx_inprocess_monitor_*.log"))


def test_the_exception_fault_raises_in_the_step_only():
    from injectors.kill import InjectedError, Kill

    assert not issubclass(InjectedError, RuntimeError)  # the loop reads a RuntimeError as a lost peer
    with pytest.raises(ValueError, match="fault.phase=during_checkpoint: fault.signal=exception"):
        Kill(signal="exception", phase="during_checkpoint", at_step=10)
    assert Kill(signal="exception", phase="before_optimizer_step").signal == "exception"


@needs_nvrx
def test_a_lost_rank_ends_the_in_process_restart():
    from nvidia_resiliency_ext.inprocess.exception import RestartAbort
    from nvidia_resiliency_ext.inprocess.rank_assignment import RankAssignmentCtx
    from nvidia_resiliency_ext.inprocess.state import State

    from resilience.recovery.nvrx_hooks import EndOnLostRank

    ctx = RankAssignmentCtx(State(rank=0, world_size=2), store=None, terminated_ranks=set())
    assert EndOnLostRank()(ctx) is ctx  # nobody lost: NVRx goes on
    with pytest.raises(RestartAbort, match=r"rank\(s\) \[1\] terminated"):
        EndOnLostRank()(RankAssignmentCtx(State(rank=0, world_size=2), store=None, terminated_ranks={1}))


def test_result_says_which_mechanism_recovered():
    from resilience.record.inprocess import FALLBACK, inprocess_recovery

    def ev(kind, attempt, t, rank=0, **kw):
        return {"kind": kind, "attempt": attempt, "t_mono": t, "rank": rank, "step": 13, **kw}

    def begun(attempt, t, iteration):
        return ev("inprocess_attempt", attempt, t, library="nvidia-resiliency-ext", version="0.4.1", settings={},
                  patches=[{"name": "gloo_abort_by_socket_shutdown", "why": "-"}], iteration=iteration)

    fault = ev("fault_injected", 0, 10.0, rank=1)
    in_place = inprocess_recovery([begun(0, 0.0, 0), fault, begun(1, 12.5, 1)])["inprocess"]
    assert in_place["recovered_by"] == "in_process" and in_place["restarts"] == 1 and in_place["restart_s"] == 2.5
    restarted = inprocess_recovery([begun(0, 0.0, 0), fault, begun(1, 16.0, 0)])["inprocess"]
    assert restarted["recovered_by"] == "process_restart" and restarted["fallback"] == FALLBACK
    assert restarted["restarts"] == 0 and restarted["patches"] == ["gloo_abort_by_socket_shutdown"]
    assert inprocess_recovery([fault])["inprocess"] is None  # every other recovery


def test_the_group_store_variable_is_the_rank_groups():
    from resilience.rank.group import STORE_ENV
    from resilience.recovery.nvrx_inprocess import GROUP_STORE_ENV

    assert GROUP_STORE_ENV == STORE_ENV  # named twice only because the policy sits a floor below the rank


@needs_nvrx
def test_a_strategy_that_recovers_in_place_is_refused_in_one_line(tmp_path):
    done = run_cli("recovery=nvrx_inprocess", "strategy=replica", f"hydra.run.dir={tmp_path / 'run'}", timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == ("error: recovery=nvrx_inprocess: restarts every rank's training "
                                                    "in its process; strategy=replica recovers in place itself; "
                                                    "use recovery=restart")
