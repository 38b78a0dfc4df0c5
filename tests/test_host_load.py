"""The validity of a measurement: CPU used by processes outside the run marks it noisy; the verdict names what was
over its threshold; a run with no record says "unknown", never "valid"."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from resilience.record.host_load import HostLoadSampler
from resilience.record.metrics import _validity

pytestmark = pytest.mark.timeout(60)
HOG = "import time\nend = time.monotonic() + 3\nwhile time.monotonic() < end: pass"
LIMITS = {"max_other_cpu": 0.1, "max_steal": 0.05, "max_memory_pressure": 10}


def test_busy_processes_beside_the_run_count_as_other_cpu():
    sampler = HostLoadSampler(interval_s=0.2).start()
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(2)]  # not this "run's": never reaped
    time.sleep(2.0)
    figures = sampler.stop()  # before the hogs are waited for: their CPU time is not ours
    for hog in hogs:
        hog.wait(timeout=30)
    assert figures["other_cpu_frac"] > 0.4, figures  # two busy loops on this machine's cores
    verdict = _validity({**figures, "thresholds": LIMITS})
    assert verdict["verdict"] == "noisy" and verdict["reasons"][0].startswith("other processes' CPU")


def _other_cpu_around_a_hog(reap_first: bool) -> tuple[float, float]:
    """(other_cpu_frac, the hog's share of the machine) over a 1.5 s busy child, reaped before or after stop."""
    t0 = time.monotonic()
    sampler = HostLoadSampler(interval_s=0.2).start()
    hog = subprocess.Popen([sys.executable, "-c", HOG.replace("3", "1.5")])
    while hog.poll() is None if reap_first else time.monotonic() - t0 < 1.6:
        time.sleep(0.05)
    figures = sampler.stop()
    hog.wait(timeout=30)
    return figures["other_cpu_frac"], 1.5 / ((time.monotonic() - t0) * figures["cpus"])


def test_own_work_is_not_other_cpu():
    """The same busy child counts as other CPU only while it is not the run's (not reaped by it); measured both
    ways side by side, so that a busy machine moves both figures alike."""
    idle = HostLoadSampler(interval_s=0.2).start()
    time.sleep(0.5)
    if idle.stop()["other_cpu_frac"] > 0.3:  # a saturated host: a busy child takes from others, adds nothing
        pytest.skip("the host is too busy to tell the run's CPU from others' (other processes > 30% of it)")
    own, share = _other_cpu_around_a_hog(reap_first=True)
    other, _ = _other_cpu_around_a_hog(reap_first=False)
    assert other - own > share / 2, (own, other, share)


def test_verdicts():
    quiet = {"other_cpu_frac": 0.02, "steal_frac": 0.0, "memory_pressure_max": 0.0, "thresholds": LIMITS}
    assert _validity(quiet)["verdict"] == "valid"
    stolen = {**quiet, "steal_frac": 0.2}
    assert _validity(stolen) | {} and _validity(stolen)["reasons"] == ["CPU steal 0.2 > 0.05"]
    assert _validity(None)["verdict"] == "unknown" and _validity({"other_cpu_frac": None})["verdict"] == "unknown"


def test_rerun_noisy_sets_only_noisy_cells_aside_and_keeps_them(tmp_path):
    import json

    from reports.cell import set_aside_noisy

    for name, verdict in (("a", "noisy"), ("b", "valid"), ("c", None)):
        run = tmp_path / "runs" / name
        run.mkdir(parents=True)
        (run / "done.json").write_text(json.dumps({"cell": name, "validity": verdict}))
        (run / "result.json").write_text("{}")
    assert set_aside_noisy(tmp_path, ["a", "b", "c", "never-ran"]) == ["a"]
    assert not (tmp_path / "runs" / "a").exists() and (tmp_path / "runs" / "b" / "done.json").exists()
    kept = list((tmp_path / "noisy").iterdir())
    assert len(kept) == 1 and kept[0].name.startswith("a-") and (kept[0] / "result.json").exists()
