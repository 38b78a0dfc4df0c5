"""The limits probe (measurements, cache, command) and the comparison's table and targets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from resilience.bench import compare, probe


def test_disk_and_memcpy_measurements_are_plausible(tmp_path):
    disk = probe.measure_disk(tmp_path, size_mb=16, samples=2)
    assert disk["probe_bytes"] == 16 << 20 and len(disk["write_samples_GBps"]) == 2
    assert min(disk["write_samples_GBps"]) <= disk["write_GBps"] <= max(disk["write_samples_GBps"])
    assert disk["write_GBps"] > 0 and disk["read_GBps"] > 0
    assert list(tmp_path.iterdir()) == []  # scratch files removed
    assert probe.measure_memcpy(size_mb=16) > 0.1


def test_load_limits_reuses_a_fresh_snapshot_beside_the_results_only(tmp_path, monkeypatch):
    """No cache shared by checkouts: the snapshot is a file in the given directory, reused only while fresh."""
    calls = []
    figures = dict.fromkeys(probe.FIGURES, 1.0)
    monkeypatch.setattr(probe, "probe", lambda d, size_mb: calls.append(d) or {**figures, "dir": str(d),
                                                                               "measured_at": time.time()})
    first = probe.load_limits(tmp_path / "not" / "yet" / "created")  # probed where it will be created
    assert calls == [tmp_path] and first["write_GBps"] == 1.0
    assert json.loads((tmp_path / "not" / "yet" / "created" / "limits.json").read_text()) == first
    assert probe.load_limits(tmp_path / "not" / "yet" / "created") == first and len(calls) == 1  # fresh: reused
    assert probe.cached_limits(tmp_path / "not" / "yet" / "created") == first
    probe.load_limits(tmp_path, refresh=True)
    assert len(calls) == 2 and (tmp_path / "limits.json").exists()
    assert probe.cached_limits(tmp_path / "elsewhere") is None  # another directory shares nothing


def test_a_stale_snapshot_or_one_from_an_older_probe_is_measured_again(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(probe, "probe", lambda d, size_mb: calls.append(d) or {
        **dict.fromkeys(probe.FIGURES, 2.0), "measured_at": time.time()})
    snapshot = tmp_path / "limits.json"
    snapshot.write_text(json.dumps({**dict.fromkeys(probe.FIGURES, 1.0), "measured_at": time.time() - 7200}))
    assert probe.load_limits(tmp_path, max_age_s=3600)["write_GBps"] == 2.0 and len(calls) == 1
    snapshot.write_text(json.dumps({"write_GBps": 1.0, "measured_at": time.time()}))  # no p2p_GBps: older probe
    assert probe.load_limits(tmp_path)["p2p_GBps"] == 2.0 and len(calls) == 2


def test_probe_command_rejects_a_negative_age(tmp_path):
    with pytest.raises(SystemExit) as info:
        probe.main(["--dir", str(tmp_path), "--max-age-h", "-1"])
    assert info.value.code == 2


@pytest.mark.timeout(60)
def test_probe_command_prints_and_writes_the_figures(tmp_path):
    env = dict(os.environ)
    cmd = [sys.executable, "-m", "resilience.bench.probe", "--dir", str(tmp_path / "ckpt"),
           "--out", str(tmp_path / "limits.json"), "--size-mb", "64"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "disk write (fsync, median)" in done.stdout and "rank start (2 ranks" in done.stdout
    limits = json.loads((tmp_path / "limits.json").read_text())
    assert limits["write_GBps"] > 0 and limits["read_GBps"] > 0 and limits["memcpy_GBps"] > 0
    assert 0 < limits["rank_start_s"] < 60 and limits["probe_bytes"] == 64 << 20
    assert limits["p2p_GBps"] > 0 and "rank-to-rank transfer" in done.stdout
    assert limits["host"] and limits["measured_at"] <= time.time()
    assert f"snapshot {tmp_path / 'limits.json'}" in done.stdout


def fake(stall, durable, nbytes=1e9, sha="a", **extra):
    return {"status": "ok", "ckpt_stall_s": stall, "ckpt_durable_s": durable, "ckpt_bytes": nbytes,
            "step_time_s": 0.05, "final_state_sha256": sha, **extra}


def test_comparison_rows_table_and_targets():
    limits = {"write_GBps": 1.0}
    killed = fake(0.1, 1.0, recovery_source="disk", recovery_time_s=5.0, lost_steps=100,
                  recovery_breakdown_s={"load": 2.0})
    rows = [compare.row("dlrm_emb", "sync", fake(1.25, 1.25), killed, "a", limits),
            compare.row("dlrm_emb", "async", fake(0.05, 2.0), {**killed, "final_state_sha256": "b"}, "a", limits),
            compare.row("dlrm_emb", "dcp_async", fake(3.0, 7.0), {"status": "error"}, "a", limits),
            compare.row("dlrm_emb", "inmemory", fake(0.01, None, None), killed, "a", limits)]
    assert rows[0]["write_GBps"] == pytest.approx(0.8) and rows[0]["write_pct_of_disk"] == pytest.approx(80)
    assert (rows[1]["bit_exact_free"], rows[1]["bit_exact_killed"]) == (True, False)
    assert rows[2]["bit_exact_killed"] is None and rows[3]["write_GBps"] is None
    text = compare.table(rows)
    assert text.count("\n") == 5 and "| dlrm_emb | async | 0.050 | 2.000 |" in text and "yes/NO" in text
    verdicts = compare.targets(rows, limits)
    assert verdicts[0].startswith("[MET] async stall <= 5% of sync save time: 0.050 s vs 1.250 s = 4.0%")
    assert verdicts[1].startswith("[MET] async stall <= dcp_async stall")
    assert verdicts[2].startswith("[MET] sync durable write bandwidth >= 70%")


def test_compare_finds_the_strategy_options_of_the_repository():
    """compare reads conf/strategy/ from the repository root (it moved one floor down once and lost it)."""
    from resilience import compat
    from resilience.bench import compare

    saves = {name: o.caps.saves for name, o in compat.options("strategy").items()}  # what compare reads
    assert saves["sync"] and not saves["none"] and saves["dcp_async_staged"]
    with pytest.raises(SystemExit) as info:
        compare.main(["--strategies", "nope"])
    assert info.value.code == 2
