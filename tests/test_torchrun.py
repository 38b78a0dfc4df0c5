"""supervisor.launcher=torchrun: the stock torchrun restarts every rank, unobserved: the plain baseline of restart
cost. A killed rank is restarted by torchrun's agent, the run recovers bit-exact, the result says no detector of
ours watched it, and nothing is left running."""

from __future__ import annotations

import pytest

from tests.conftest import run_experiment


@pytest.mark.timeout(240)
def test_torchrun_restarts_a_killed_rank_and_the_run_ends_bit_exact(tmp_path, reference):
    result = run_experiment(tmp_path / "run", "strategy=sync", "fault=kill", "fault.rank=1", "fault.at_step=13",
                            "steps=30", "checkpoint.every=5", "world_size=2", "seed=0", "detector=[process_exit]",
                            "supervisor.launcher=torchrun")
    assert result["status"] == "ok" and result["recovered"] and result["attempts"] == 2
    assert result["supervised"] is False and result["detected"] is False  # torchrun's agent, not ours
    assert result["recovery_time_s"] > 0 and result["lost_steps"] == 3
    assert result["final_state_sha256"] == reference["final_state_sha256"]
    assert (tmp_path / "run" / "torchrun.log").stat().st_size > 0


def test_supervisor_side_detectors_are_said_not_to_run():
    from omegaconf import OmegaConf

    from resilience.detectors.heartbeat import Heartbeat
    from resilience.detectors.nonfinite import Nonfinite
    from resilience.supervise.torchrun import TorchrunSupervisor

    sup = TorchrunSupervisor(OmegaConf.create({"run_dir": "/nonexistent", "world_size": 2}), None, None,
                             [Heartbeat(), Nonfinite()], type("P", (), {"max_restarts": 1})())
    caveats = sup.caveats()
    assert len(caveats) == 1 and "heartbeat" in caveats[0] and "nonfinite" not in caveats[0], caveats
