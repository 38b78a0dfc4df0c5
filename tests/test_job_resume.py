"""Resume in a new job (issue 30, items 1 and 2): ``fault=job_kill`` SIGKILLs the supervisor and every rank; the
first job's command line plus ``resume=DIR`` goes on with the same run and ends bit-exact with the fault-free run.
The refusals run in process, before anything is created."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from omegaconf import OmegaConf, open_dict

from conftest import SHORT, left_nothing, run_cli, run_module
from resilience.__main__ import precheck
from resilience.ckpt.shm_store import SHM_DIR
from resilience.config import CONF_DIR, ConfigError, check_group_choices, resolve
from resilience.record.events import EventLog, read_events
from resilience.record.metrics import compute_result
from resilience.settings.command_line import compose_checked
from resilience.supervise.resume import Resume, with_run_dir

# gpt_tiny on 2 ranks, short; the detectors leave the state alone, so one fault-free run serves every case
TRAINING = SHORT


@pytest.fixture
def fault_free(fault_free_run) -> dict:
    """The fault-free run (strategy=none, which records itself as the reference of its training), the session's:
    tests/test_jit.py's runs of this training are checked against it too."""
    return fault_free_run(*TRAINING)


# (strategy, the fault's settings, the step it kills at, the checkpoint the resume loads)
CASES = [("sync", ("fault.at_step=6",), 6, 4),
         ("async", ("fault.at_step=8", "fault.phase=during_checkpoint"), 8, 4)]  # killed before step 8's commit


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("strategy", "fault", "at", "loaded"), CASES, ids=[c[0] for c in CASES])
def test_a_killed_job_resumes_in_a_new_job_bit_exact(tmp_path, fault_free, strategy, fault, at, loaded):
    run, shm_before = tmp_path / "run", set(os.listdir(SHM_DIR))
    command = (f"strategy={strategy}", "fault=job_kill", *fault, *TRAINING)
    killed = run_cli(*command, f"hydra.run.dir={run}", timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr  # the first job's command itself was killed
    assert not (run / "result.json").exists()
    left_nothing(run, shm_before)  # every rank died with the supervisor
    said = run_module("resilience.result", str(run), timeout=60)
    assert "result: interrupted" in said.stdout, said.stdout + said.stderr

    resumed = run_cli(*command, f"resume={run}", timeout=120)  # the same command line: resume= names the directory
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resumed from step {loaded}\n" in resumed.stdout
    left_nothing(run, shm_before)
    resumed_bit_exact(run, fault_free, at, loaded)


def resumed_bit_exact(run: Path, fault_free: dict, at: int, loaded: int) -> None:
    """What a job killed at step ``at`` and resumed from checkpoint ``loaded`` leaves in ``run``: the fault-free
    run's state, two jobs, attempts numbered on, the fault fired once, and the job restart's lost work and times."""
    result = json.loads((run / "result.json").read_text())
    assert result["status"] == "ok" and result["final_state_sha256"] == fault_free["final_state_sha256"]
    assert result["reference"]["matches"] is True  # the run says itself that it ended on the reference
    assert result["jobs"] == 2 and result["lost_steps"] == at - loaded  # lost work: the steps since the checkpoint

    events = read_events(run)
    lost, start = (next(e for e in events if e["kind"] == kind) for kind in ("job_lost", "job_resumed"))
    assert lost["found_by"] == "resume" and lost["last_attempt"] == 0 and start["first_attempt"] == 1
    assert {e["attempt"] for e in events if e["kind"] == "run_start"} == {0, 1}  # attempts numbered on
    assert sum(e["kind"] == "fault_injected" for e in events) == 1  # the planned point does not fire again
    restart = result["job_restarts"][0]
    assert restart["loaded_step"] == loaded and restart["lost_steps"] == restart["died_at_step"] - loaded
    parts = restart["breakdown_s"]
    assert all(v >= 0 for v in parts.values()) and sum(parts.values()) == pytest.approx(restart["job_restart_s"])


# ---- in process: what a resume refuses, one line each, before anything is created ----

def first_job(run: Path, *overrides: str, ended: str | None = None) -> None:
    """What a first job leaves in ``run``: its config.yaml and an event log that a killed job ends with."""
    composed = compose_checked(CONF_DIR, "config", [*overrides, f"hydra.run.dir={run}"])
    choices = {k: v for k, v in composed.hydra.runtime.choices.items() if not k.startswith("hydra")}
    with open_dict(composed):
        del composed["hydra"]
    cfg = resolve(composed, run, choices)
    with open_dict(cfg):
        cfg.run_id, cfg.job = "0123456789abcdef", {"number": 1, "first_attempt": 0}
    run.mkdir(parents=True)
    OmegaConf.save(cfg, run / "config.yaml")
    sup, rank = EventLog(run, None, 0), EventLog(run, 0, 0)
    sup.emit("launch", world_size=2, max_restarts=3, recovery="restart_all")
    rank.emit("step_end", step=3, loss=1.0, duration_s=0.1)
    if ended:
        sup.emit("supervisor_end", outcome=ended, signal=None)


def checked(*argv: str) -> Resume | None:
    """The command's validation of ``argv``, as ``python -m resilience`` runs it."""
    argv_ = with_run_dir(list(argv))
    check_group_choices(argv_)
    return precheck(argv_)


def refused(*argv: str) -> str:
    with pytest.raises(ConfigError) as info:
        checked(*argv)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_a_resume_takes_the_runs_identity_and_numbers_its_attempts_on(tmp_path):
    run = tmp_path / "run"
    first_job(run, "steps=12")
    resume = checked("steps=12", f"resume={run}")
    assert (resume.run_id, resume.job, resume.first_attempt) == ("0123456789abcdef", 2, 1)
    assert resume.lost["last_step"] == 3 and resume.lost["last_attempt"] == 0


def test_a_resume_of_a_directory_that_does_not_exist_is_refused(tmp_path):
    assert "no such run directory" in refused(f"resume={tmp_path / 'nope'}")
    assert not (tmp_path / "nope").exists()


def test_a_resume_of_a_directory_without_a_run_is_refused(tmp_path):
    (tmp_path / "run").mkdir()
    assert "holds no run of this command" in refused(f"resume={tmp_path / 'run'}")
    assert list((tmp_path / "run").iterdir()) == []


def test_a_resume_with_other_training_settings_is_refused_naming_the_setting(tmp_path):
    run = tmp_path / "run"
    first_job(run, "steps=12")
    assert "steps=16 differs from the first job's steps=12" in refused("steps=16", f"resume={run}")
    assert "strategy=async differs from the first job's strategy=sync" in refused(
        "steps=12", "strategy=async", f"resume={run}")


@pytest.mark.parametrize("outcome", ["succeeded", "failed"])
def test_a_run_that_ended_is_not_resumed(tmp_path, outcome):
    first_job(tmp_path / "run", ended=outcome)
    assert f"the run has ended ({outcome})" in refused(f"resume={tmp_path / 'run'}")


def test_resume_auto_needs_a_run_directory_the_requeue_names_again(tmp_path):
    assert "needs hydra.run.dir" in refused("resume=auto")
    assert checked("resume=auto", f"hydra.run.dir={tmp_path / 'run'}") is None  # the first job: a fresh run
    first_job(tmp_path / "run")
    assert checked("resume=auto", f"hydra.run.dir={tmp_path / 'run'}").job == 2  # the requeued one resumes


@pytest.mark.parametrize(("overrides", "says"), [
    (("fault=job_kill", "supervisor.launcher=torchrun"), "supervisor.launcher=torchrun: fault=job_kill kills"),
    (("fault=job_kill", "strategy=replica"), "fault=job_kill: ends the whole job, and strategy=replica"),
    (("-m", "resume=auto", "steps=10,12"), "not with --multirun"),
])
def test_what_a_job_kill_or_a_resume_cannot_go_with_is_refused(tmp_path, overrides, says):
    assert says in refused(*overrides, f"hydra.run.dir={tmp_path / 'run'}")


def test_the_job_restart_is_split_into_gap_start_up_load_and_replay():
    def ev(kind: str, t: float, rank: int | None = 0, attempt: int = 0, step: int = 0, **kw) -> dict:
        return {"kind": kind, "t_wall": t, "t_mono": t, "rank": rank, "attempt": attempt, "step": step, **kw}

    events = [ev("launch", 0, None, world_size=1, max_restarts=0, recovery="restart_all"),
              ev("run_start", 1), ev("step_end", 2, step=6, loss=1.0, duration_s=0.1),
              ev("job_lost", 50, None, died_t_wall=2, last_attempt=0, last_step=6, found_by="resume"),
              ev("job_resumed", 50, None, 1, job=2, first_attempt=1, started_t_wall=10),
              ev("launch", 51, None, 1, world_size=1, max_restarts=0, recovery="restart_all"),
              ev("run_start", 13, attempt=1), ev("ckpt_loaded", 14, attempt=1, step=4, duration_s=0.5),
              ev("step_end", 15, attempt=1, step=5, loss=1.0, duration_s=0.1),
              ev("step_end", 16, attempt=1, step=6, loss=1.0, duration_s=0.1),
              ev("run_end", 17, attempt=1, step=6, final_state_sha256="x", peak_rss_mb=1.0),
              ev("supervisor_end", 18, None, 1, outcome="succeeded", signal=None)]
    result = compute_result(events, {"world_size": 1, "strategy": "sync"})
    assert result["status"] == "ok" and result["jobs"] == 2 and result["attempts"] == 2
    restart = result["job_restarts"][0]
    assert restart["breakdown_s"] == {"gap": 8, "startup": 3, "load": 1, "replay": 2}
    assert (restart["job_restart_s"], restart["first_step_s"], restart["lost_steps"]) == (14, 13, 2)


@pytest.mark.timeout(300)
def test_the_pipeline_runs_a_killed_job_and_its_resume_as_one_cell(tmp_path, fault_free, capsys):
    """The sync case of CASES, the same command, killed and resumed as the pipeline runs it: CI's job resume (the
    direct test's [sync] is in the long tier, tests/tiers.py), with that test's checks but those made between the
    two jobs (no result.json and ``resilience.result`` saying interrupted: tests/test_recovery.py's killed
    supervisor)."""
    from reports.cell import run_cell

    strategy, fault, at, loaded = CASES[0]
    run_dir, shm_before = tmp_path / "runs" / f"{strategy}-job_kill", set(os.listdir(SHM_DIR))
    spec = {"cell": run_dir.name, "overrides": [f"strategy={strategy}", "fault=job_kill", *fault, *TRAINING]}
    record = run_cell(run_dir / "done.json", spec, timeout_s=240)
    assert record["state"] == "ok", record["error_detail"]
    assert [j["exit_code"] for j in record["jobs"]] == [-signal.SIGKILL, 0]  # the job killed, then its resume
    assert record["elapsed_s"] >= sum(j["elapsed_s"] for j in record["jobs"])
    assert f"resumed from step {loaded}\n" in capsys.readouterr().out  # the jobs' console, passed through
    left_nothing(run_dir, shm_before)  # nothing of either job is left (the cell kills what escaped its group)
    resumed_bit_exact(run_dir, fault_free, at, loaded)  # the cell keeps the event log (its checkpoints it removes)
