"""The command as a Hydra user meets it: --help, shell completion, sweeps, a fault step that follows `steps=`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from conftest import ROOT, run_cli
from resilience.__main__ import drop_checkpoints
from resilience.config import resolve

CONSOLE_SCRIPT = Path(sys.executable).parent / "resilience-bench"


def resolved(tmp_path: Path, *overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
    return resolve(cfg, tmp_path, {"strategy": "sync", "fault": "kill", "workload": "gpt_tiny"})


@pytest.mark.timeout(60)
def test_help_lists_this_commands_groups_and_settings():
    done = run_cli("--help", timeout=60)
    assert done.returncode == 0, done.stderr
    groups = [line.split()[0] for line in done.stdout.splitlines() if line.startswith("  ") and "[" in line]
    assert groups == ["workload", "parallel", "strategy", "fault", "recovery", "train", "detector"]  # not matrix
    assert "replica_torchft" in done.stdout and "keep_after_run" in done.stdout and "resilience-bench" in done.stdout


@pytest.mark.timeout(60)
@pytest.mark.skipif(not CONSOLE_SCRIPT.exists(), reason="the console script is installed by `make venv` (pip -e)")
def test_the_console_script_completes_a_group_and_a_key():
    def complete(line: str) -> list[str]:
        env = {**os.environ, "COMP_LINE": line, "COMP_POINT": str(len(line))}
        done = subprocess.run([str(CONSOLE_SCRIPT), "-sc", "query=bash"], env=env, cwd="/", capture_output=True,
                              text=True, timeout=50)
        return done.stdout.split()

    assert {"strategy=sync", "strategy=replica_torchft"} <= set(complete("resilience-bench strategy="))
    assert "checkpoint.every=" in complete("resilience-bench checkpoint.")


@pytest.mark.parametrize("overrides,step", [((), 13), (("steps=10",), 5), (("steps=4",), 2),
                                            (("fault.phase=during_checkpoint",), 10),
                                            (("steps=8", "fault.phase=during_checkpoint"), 5),
                                            (("fault.at_step=7",), 7)])
def test_the_fault_step_follows_the_run_length(tmp_path, overrides, step):
    assert resolved(tmp_path, "fault=kill", *overrides).fault.at_step == step


@pytest.mark.parametrize("keep,multirun,kept", [("auto", False, True), ("auto", True, False), (True, True, True),
                                                (False, False, False)])
def test_checkpoints_after_a_run(tmp_path, keep, multirun, kept):
    cfg = resolved(tmp_path, "fault=none")
    with open_dict(cfg):
        cfg.checkpoint.keep_after_run = keep
    Path(cfg.checkpoint.dir, "step_5").mkdir(parents=True)
    drop_checkpoints(cfg, multirun=multirun)
    assert Path(cfg.checkpoint.dir).exists() == kept


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_sweep_runs_every_job_and_leaves_no_checkpoints(tmp_path):
    done = run_cli("-m", "strategy=sync,async", "fault=none", "steps=4", "checkpoint.every=2",
                   f"hydra.sweep.dir={tmp_path}", timeout=240)
    assert done.returncode == 0, done.stderr
    results = [json.loads((tmp_path / str(job) / "result.json").read_text()) for job in (0, 1)]
    assert [r["status"] for r in results] == ["ok", "ok"]
    assert not any((tmp_path / str(job) / "ckpt").exists() for job in (0, 1))
