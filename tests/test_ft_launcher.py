"""NVRx's ``ft_launcher`` as the launcher (``supervisor.launcher=ft_launcher``): fault-free it is the plain run; a hung
rank stops sending NVRx heartbeats, NVRx's rank monitor kills it, the launcher restarts every rank and the run ends
bit-exact; NVRx's verdicts come from the launcher's log, timed and blamed like our detectors'."""

from __future__ import annotations

import importlib.util

import pytest

from resilience.supervise.ft_launcher import verdicts
from tests.conftest import run_experiment

needs_nvrx = pytest.mark.skipif(importlib.util.find_spec("nvidia_resiliency_ext") is None,
                                reason="nvidia_resiliency_ext is not installed: pip install -e '.[nvrx]'")
COMMON = ("supervisor.launcher=ft_launcher", "strategy=sync", "world_size=2", "seed=0",
          "detector=[nvrx_heartbeat,process_exit]")


@needs_nvrx
@pytest.mark.timeout(300)
def test_fault_free_run_under_ft_launcher(tmp_path):
    result = run_experiment(tmp_path / "run", *COMMON, "fault=none", "steps=8", "checkpoint.every=4")
    assert result["status"] == "ok" and result["attempts"] == 1 and result["supervised"] is False
    assert result["false_alarms"] == 0 and (tmp_path / "run" / "ft_launcher.log").exists()


@needs_nvrx
@pytest.mark.timeout(400)
def test_a_hung_rank_is_killed_by_nvrx_and_the_run_recovers_bit_exact(tmp_path, reference):
    result = run_experiment(tmp_path / "run", *COMMON, "steps=30", "checkpoint.every=5", "fault=hang",
                            "fault.mode=sigstop", "fault.rank=1", "fault.at_step=13", "timeouts.heartbeat_s=3",
                            timeout=360)
    assert result["recovered"] and result["supervised"] is False
    # NVRx decided (its first verdict after the fault); which rank it names first is its race (the peer blocked in the
    # all-reduce stops beating too: docs/recovery_peers.md), not asserted
    assert result["detector"] == "nvrx_heartbeat" and result["detected_rank"] in (0, 1)
    assert result["detection_latency_s"] >= 3  # not before its timeout
    assert result["final_state_sha256"] == reference["final_state_sha256"]


def test_verdicts_are_read_from_the_launchers_log(tmp_path):
    log = tmp_path / "ft_launcher.log"
    log.write_text(
        "[2026-11-25 05:00:16,335] [WARNING] [RankMonServer6382@vm:1] Did not get subsequent heartbeat. Waited 3.00 "
        "seconds.\n[2026-11-25 05:00:04,637] [ALWAYS] [RankMonServer.Restarter] [NestedRestarter] state=initialize\n"
        "[2026-11-25 05:00:16,145] [WARNING] [RankMonServer6381@host-a:0] Did not get initial heartbeat. Waited "
        "60.00 seconds.\n")
    found = verdicts(log)
    assert [(v["rank"], v["which"], v["waited"]) for v in found] == [(0, "initial", 60.0), (1, "subsequent", 3.0)]
    assert round(found[1]["t_wall"] - found[0]["t_wall"], 3) == 0.19  # in time order, to the millisecond
    assert verdicts(tmp_path / "absent.log") == []
