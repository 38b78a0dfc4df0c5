"""NVRx's hang detection as a detector: its rank monitors (started by the supervisor) decide, we record; a hung rank
is killed by the library, no verdict comes before the hang, the run recovers bit-exact, and nothing
of the monitors outlives the run."""

from __future__ import annotations

import glob
import json
import tempfile

import psutil
import pytest

from tests.conftest import run_experiment


def _installed() -> bool:
    try:
        import nvidia_resiliency_ext.fault_tolerance  # noqa: F401
    except ImportError:
        return False
    return True


pytestmark = pytest.mark.skipif(not _installed(), reason="nvidia_resiliency_ext is not installed: "
                                "pip install -e '.[nvrx]'")
COMMON = ("steps=30", "checkpoint.every=5", "world_size=2", "seed=0", "detector=[nvrx_heartbeat,process_exit]",
          "timeouts.heartbeat_s=3")


def leftovers() -> set[str]:
    """The monitors' sockets, and processes started by multiprocessing's spawn (the monitors are)."""
    spawned = {f"pid {p.pid}" for p in psutil.process_iter(["cmdline"])
               if "multiprocessing.spawn" in " ".join(p.info["cmdline"] or [])}
    return set(glob.glob(f"{tempfile.gettempdir()}/rb-nvrx-*.sock")) | spawned


@pytest.mark.timeout(240)
def test_nvrx_kills_the_hung_rank_and_the_run_recovers_bit_exact(tmp_path, reference):
    before = leftovers()
    result = run_experiment(tmp_path / "run", "strategy=sync", "fault=hang", "fault.mode=sigstop", "fault.rank=1",
                            "fault.at_step=13", *COMMON)
    assert result["detected"] and result["detector"] == "nvrx_heartbeat"
    # NVRx's monitors decided and killed; which rank they kill is NVRx's race (each rank's monitor decides alone, and
    # the peer blocked behind the hang stops beating too; seen: only the healthy peer killed, the agent then stopped
    # the hung one): a measured finding (docs/recovery_peers.md), not asserted here.
    verdicts = [json.loads(p.read_text()) for p in (tmp_path / "run" / "nvrx_verdicts").glob("*.json")]
    assert verdicts and result["detected_rank"] in {v["rank"] for v in verdicts}
    assert 3 <= result["detection_latency_s"] < 3 + 3, result["detection_latency_s"]  # timeout + its check period
    assert result["false_alarms"] == 0  # 13 steps of beats before the hang: no verdict before it
    assert result["recovered"] and result["final_state_sha256"] == reference["final_state_sha256"]
    assert list((tmp_path / "run").glob("nvrx_rank_monitor_*.log"))  # the library's own log, in the run directory
    assert leftovers() <= before


@pytest.mark.timeout(240)
def test_fault_free_run_has_no_verdict(tmp_path):
    before = leftovers()
    result = run_experiment(tmp_path / "run", "strategy=sync", "fault=none", "steps=8", "checkpoint.every=4",
                            "world_size=2", "seed=0", "detector=[nvrx_heartbeat,process_exit]", "timeouts.heartbeat_s=3")
    assert result["status"] == "ok" and result["false_alarms"] == 0 and result["attempts"] == 1
    assert not list((tmp_path / "run" / "nvrx_verdicts").glob("*.json"))
    assert leftovers() <= before
