"""result.json's provenance block and environment.json: where, when and with what a run was measured."""

from __future__ import annotations

import json
import shutil
import subprocess
from datetime import datetime
from pathlib import Path

import pandas as pd

from conftest import ROOT
from reports.tables import environment_table
from resilience.record import environment
from resilience.record.events import read_events
from resilience.record.result import provenance

RUN = Path(__file__).parent / "fixtures" / "runs" / (
    "gpt_tiny-sync-kill.phase=before_forward.at_step=7.rank=1-process_exit-every4-ws2-steps12-seed0")


def fixture_run(tmp_path: Path) -> Path:
    run_dir = tmp_path / "runs" / "sync-kill-fd2e563d"
    run_dir.mkdir(parents=True)
    shutil.copy(RUN / "events.jsonl", run_dir)
    return run_dir


def test_start_host_commit_and_versions_name_the_pipelines_environment(tmp_path, monkeypatch):
    run_dir = fixture_run(tmp_path)
    shared = tmp_path / "probe" / "20260101T000000Z" / "environment.json"
    shared.parent.mkdir(parents=True)
    shared.write_text("{}")  # the probe rule's
    monkeypatch.setenv(environment.ENV_VAR, str(shared))
    events = read_events(run_dir)
    p = provenance(run_dir, events)
    launch = next(e for e in events if e["kind"] == "launch")
    assert datetime.fromisoformat(p["started"]).timestamp() == int(launch["t_wall"])
    assert p["host"] == launch["host"]
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert p["git_commit"] == head.strip() and isinstance(p["git_dirty"], bool)
    assert p["torch"].startswith("2.") and p["python"].count(".") == 2
    assert (run_dir / p["environment"]).resolve() == shared.resolve()  # named, not captured again per cell
    assert not (run_dir / "environment.json").exists() and shared.read_text() == "{}"


def test_a_recomputation_keeps_the_runs_commit_and_versions(tmp_path, monkeypatch):
    run_dir = fixture_run(tmp_path)
    monkeypatch.setenv(environment.ENV_VAR, str(tmp_path / "environment.json"))
    old = {"git_commit": "0123abc", "git_dirty": False, "torch": "2.12.0", "python": "3.11.1",
           "environment": "../environment.json", "started": "x", "host": "x"}
    (run_dir / "result.json").write_text(json.dumps({"provenance": old}))
    p = provenance(run_dir, read_events(run_dir))
    assert {k: p[k] for k in ("git_commit", "torch", "python")} == {"git_commit": "0123abc", "torch": "2.12.0",
                                                                    "python": "3.11.1"}
    assert p["host"] != "x" and p["started"] != "x"  # from the events, always


def test_outside_a_checkout_the_commit_says_so(tmp_path):
    assert environment.git_commit(tmp_path) == {"git_commit": environment.NOT_GIT, "git_dirty": None}


def test_a_run_outside_the_pipeline_writes_its_own_environment_from_collect_env(tmp_path, monkeypatch):
    run_dir = fixture_run(tmp_path)
    monkeypatch.delenv(environment.ENV_VAR, raising=False)
    assert provenance(run_dir, read_events(run_dir))["environment"] == "environment.json"
    env = json.loads((run_dir / "environment.json").read_text())
    assert env["collect_env"]["torch_version"] == env["torch_version"]  # torch.utils.collect_env, as bug reports
    assert env["cpu_cores"] >= 1 and env["host"] and env["git_commit"]
    # The report shows collect_env's comparable fields, not its package lists.
    shown = environment_table(env, {}, pd.DataFrame())
    assert set(shown[shown["group"] == "collect_env"]["key"]) <= set(environment.COLLECT_ENV_SHOWN)
    assert "os" in set(shown["key"]) and "pip_packages" not in set(shown["key"])
