"""The validity of a measurement: CPU used by processes outside the run marks it noisy, CPU of the run's own
descendants never does; the verdict names what was over its threshold; a run with no record says "unknown", never
"valid"."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from resilience.record.host_load import TICK, HostLoadSampler
from resilience.record.metrics import _validity

pytestmark = pytest.mark.timeout(60)
# Burns ARGV[1] s of CPU, prints its CPU time, sleeps ARGV[2] s (so that a sample sees its final CPU), exits.
HOG = ("import sys, time\nwhile time.process_time() < float(sys.argv[1]): pass\n"
       "print(time.process_time(), flush=True)\ntime.sleep(float(sys.argv[2]))")
# A rank that starts a checkpoint process (the hog) and waits: killed, it leaves the hog to whoever adopts orphans.
RANK = ("import subprocess, sys, time\np = subprocess.Popen([sys.executable, '-c', sys.argv[1], *sys.argv[2:]])\n"
        "print(p.pid, flush=True)\ntime.sleep(60)")
LIMITS = {"max_other_cpu": 0.1, "max_steal": 0.05, "max_memory_pressure": 10}


def _cpu_s(pid: int) -> float:
    """A process's own CPU seconds (utime + stime), read as the sampler reads them."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def _wait_until(done, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_an_unrelated_busy_loop_counts_as_other_cpu():
    """A busy loop started outside the run (its parent has exited before the run starts: not a descendant)."""
    starter = subprocess.Popen([sys.executable, "-c", RANK.replace("time.sleep(60)", ""), HOG, "30", "0"],
                               stdout=subprocess.PIPE, text=True)
    hog = int(starter.stdout.readline())
    starter.wait(timeout=30)  # the hog is an orphan now, adopted outside this process's tree
    try:
        before, t0 = _cpu_s(hog), time.monotonic()
        sampler = HostLoadSampler(interval_s=0.1).start()
        _wait_until(lambda: _cpu_s(hog) - before >= 0.3, "the hog to burn 0.3 s of CPU")  # however busy the host
        figures = sampler.stop()
        used, wall = _cpu_s(hog) - before, time.monotonic() - t0
    finally:
        os.kill(hog, signal.SIGKILL)
    assert figures["own_cpu_s"] < used / 2, (figures, used)  # not the run's ...
    assert figures["other_cpu_frac"] * figures["cpus"] * wall > 0.8 * used, (figures, used)  # ... but other's
    verdict = _validity({**figures, "thresholds": LIMITS}, [])
    assert verdict["verdict"] == "noisy" and verdict["reasons"][0].startswith("other processes' CPU")


def test_the_runs_descendants_are_its_own_cpu_whoever_reaps_them():
    """What DCP's process executor does under a kill: the killed rank's checkpoint process burns CPU; it is the
    run's own CPU whether it ends as an unreaped zombie of the run (under the supervisor, a subreaper) or as an
    orphan adopted outside the run's tree. Each counts, by the CPU time the process reports itself."""
    sampler = HostLoadSampler(interval_s=0.1).start()
    zombie = subprocess.Popen([sys.executable, "-c", HOG, "0.4", "0"], stdout=subprocess.PIPE, text=True)
    burned = float(zombie.stdout.readline())
    _wait_until(lambda: _state(zombie.pid) == "Z", "the child to exit")  # exited, not reaped: getrusage lacks it
    rank = subprocess.Popen([sys.executable, "-c", RANK, HOG, "0.4", "0.3"], stdout=subprocess.PIPE, text=True)
    orphan = int(rank.stdout.readline())
    time.sleep(0.2)  # the sampler sees the checkpoint process as the rank's
    rank.kill()  # the fault: the rank dies, its checkpoint process is reparented out of this tree
    rank.wait(timeout=30)
    burned += float(rank.stdout.readline())
    _wait_until(lambda: _state(orphan) in ("gone", "Z"), "the orphan to exit")
    figures = sampler.stop()
    zombie.wait(timeout=30)
    assert figures["own_cpu_s"] >= 0.9 * burned, (figures, burned)


def test_a_child_reaped_during_the_scan_is_counted_once(monkeypatch):
    """The ranks exit as a reading is taken: one reaped between the read of the children's times and the scan of
    /proc was in neither (a window then read more "other processes' CPU" than the cores have). The reading is
    taken again until no child was reaped during its scan."""
    import resource
    from types import SimpleNamespace

    import resilience.record.host_load as hl

    children = iter([1.0, 5.0, 5.0, 5.0])  # a child with 4 s of CPU reaped during the first scan
    real = resource.getrusage
    monkeypatch.setattr(hl.resource, "getrusage", lambda who: real(who) if who == resource.RUSAGE_SELF else
                        SimpleNamespace(ru_utime=next(children), ru_stime=0.0))

    class Run:  # the reaped child is gone from /proc from the first scan on
        def scan(self):
            return self

        def cpu_s(self):
            return 0.0

    me = real(resource.RUSAGE_SELF)
    got = hl.CpuTimes.now(Run())
    assert got.own_s == pytest.approx(me.ru_utime + me.ru_stime + 5.0, abs=0.05) and got.unreaped_s == 0.0


def test_a_process_reaped_inside_the_run_during_a_scan_keeps_its_time(monkeypatch):
    """Its parent's line read before the reap lacks the child's time, and the child is gone when its turn comes:
    the parent is read again once the child is known gone."""
    import resilience.record.host_load as hl

    stale = {"200": True}  # the first read of the parent in the second scan: before it reaped 300
    lines = {"200": (100, 1, 1.0), "300": (200, 2, 4.0)}

    def stat(pid: str):
        if pid == "200" and scans[0] == 2 and stale["200"]:
            stale["200"] = False
            return 100, 1, 1.0
        return lines.get(pid)

    scans = [0]
    monkeypatch.setattr(hl, "_stat", stat)
    monkeypatch.setattr(hl, "PROC", type("P", (), {"iterdir": lambda self: [type("E", (), {"name": n})() for n in
                                                                           sorted(lines)]})())
    run = hl.RunProcesses(root=100)
    scans[0] = 1
    assert run.scan().cpu_s() == 5.0
    del lines["300"]
    lines["200"] = (100, 1, 5.0)  # reaped: the parent's line holds its time now
    scans[0] = 2
    assert run.scan().cpu_s() == 5.0


def test_verdicts():
    quiet = {"other_cpu_frac": 0.02, "steal_frac": 0.0, "memory_pressure_max": 0.0, "thresholds": LIMITS}
    assert _validity(quiet, [])["verdict"] == "valid"
    stolen = {**quiet, "steal_frac": 0.2}
    assert _validity(stolen, [])["reasons"] == ["CPU steal 0.2 > 0.05 over the run"]
    assert _validity(None, [])["verdict"] == "unknown"
    assert _validity({"other_cpu_frac": None}, [])["verdict"] == "unknown"


def _ev(t: float, kind: str, step: int, rank: int | None = 0) -> dict:
    return {"t_mono": t, "kind": kind, "step": step, "rank": rank}


def test_a_run_contended_only_during_its_checkpoint_is_noisy_and_says_where():
    """Over the whole 20 s run another process used 5% of the cores (under the 10% threshold), all of it during
    the checkpoint of step 10 (seconds 8 to 10: 100% of both cores there); the recovery's seconds were quiet."""
    cpus, series = 2, []
    busy = own = 0.0
    for t in range(21):  # one reading a second: the run's own processes use one core throughout
        series.append([float(t), busy, own, 0.0, 2.0 * t])
        own += 1.0
        busy += 1.0 + (2.0 if 8 <= t < 10 else 0.0)
    load = {"other_cpu_frac": 4.0 / (20 * cpus), "steal_frac": 0.0, "memory_pressure_max": 0.0, "cpus": cpus,
            "thresholds": LIMITS, "series": series}
    events = [_ev(8.2, "ckpt_begin", 10), _ev(8.3, "ckpt_stall_end", 10), _ev(9.6, "ckpt_durable", 10),
              _ev(3.1, "ckpt_begin", 5), _ev(3.3, "ckpt_durable", 5),
              _ev(13.0, "fault_injected", 13, rank=1), _ev(16.5, "resumed", 13)]
    verdict = _validity(load, sorted(events, key=lambda e: e["t_mono"]))
    assert verdict["verdict"] == "noisy"
    assert verdict["reasons"] == ["other processes' CPU 1 > 0.1 during the checkpoint of step 10"]
    calm = {**load, "series": [[t, b - (2.0 * min(max(t - 8, 0), 2)), o, s, tot] for t, b, o, s, tot in series]}
    assert _validity(calm, events)["verdict"] == "valid"  # the same run without the neighbour


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


def test_rerun_noisy_makes_the_summary_again_so_that_the_cells_set_aside_run_again(tmp_path, monkeypatch):
    """Without it Snakemake sees a summary newer than the cells left and reruns nothing: the noisy cell was moved
    aside and never measured again (found on a `make run`, 2026-11-27)."""
    import json

    from reports.matrix import load_matrix
    from reports.pipeline_config import pipeline_config

    for key in ("RB_PROBE", "RB_ENVIRONMENT", "RB_DATA_DIR", "PATH"):
        monkeypatch.setenv(key, os.environ.get(key, ""))
    cells = [c.dir for c in load_matrix("smoke").cells]
    for name in cells:
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "done.json").write_text(json.dumps({"cell": name, "validity": "valid"}))
    (tmp_path / "summary.csv").write_text("cell\n")
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "index.html").write_text("<html>")
    pipeline_config({"matrix": "smoke", "results": str(tmp_path), "rerun_noisy": "true"})
    assert (tmp_path / "summary.csv").exists()  # nothing noisy: nothing to make again
    (tmp_path / "runs" / cells[0] / "done.json").write_text(json.dumps({"cell": cells[0], "validity": "noisy"}))
    pipeline_config({"matrix": "smoke", "results": str(tmp_path), "rerun_noisy": "true"})
    assert not (tmp_path / "summary.csv").exists() and not (tmp_path / "runs" / cells[0]).exists()
    assert not (tmp_path / "report" / "index.html").exists()  # the target: Snakemake makes the chain again
