"""A preemption with notice (issue 30, items 2 and 3): ``fault=preempt`` sends SIGTERM to the supervisor and every
rank and SIGKILLs what is left after ``fault.grace_s``; without ``checkpoint.on_notice`` the steps since the last
checkpoint are lost, with it the ranks finish the step, save, and the resumed job loses nothing. Both resumed runs
end bit-exact with the fault-free run, every part of the real loop's state (the loader's workers get the SIGTERM
too, as every process of a job does: they must outlive it while the rank saves their state)."""

from __future__ import annotations

import json
import os

import pytest

from conftest import SHORT, SHORT_REAL, left_nothing, refusal, run_cli
from resilience.ckpt.shm_store import SHM_DIR
from resilience.record.events import read_events

TRAINING = (*SHORT, "train=real", "workload.dropout=0.1")  # SHORT_REAL's training, a checkpoint every 4 steps
AT = 6  # preempted before step 6's forward: the newest checkpoint is step 4's


@pytest.fixture
def fault_free(fault_free_run) -> dict:
    """The session's fault-free run of this training (tests/test_job_state.py's reference too); it hashes the parts
    at every step, the points of either job included."""
    return fault_free_run(*SHORT_REAL)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("strategy", "on_notice", "loaded"),
                         [("sync", False, 4), ("sync", True, AT + 1), ("inmemory", True, AT + 1)],
                         ids=["no-save", "save-on-notice", "inmemory-save-on-notice"])
def test_a_preempted_job_resumes_bit_exact_and_a_save_on_notice_loses_nothing(tmp_path, fault_free, strategy,
                                                                              on_notice, loaded):
    """In-memory's save on the notice goes to disk too: its snapshots in memory do not outlive the job."""
    run, shm_before = tmp_path / "run", set(os.listdir(SHM_DIR))
    command = (f"strategy={strategy}", "fault=preempt", f"fault.at_step={AT}", "fault.grace_s=20",
               f"checkpoint.on_notice={str(on_notice).lower()}", *TRAINING)
    first = run_cli(*command, f"hydra.run.dir={run}", timeout=120)
    assert first.returncode != 0, first.stdout + first.stderr
    left_nothing(run, shm_before)  # the ranks, the supervisor and the scheduler's executioner are gone
    said = json.loads((run / "result.json").read_text())  # a SIGTERMed supervisor still writes its result
    assert said["status"] == "interrupted"
    assert said["notice"]["grace_s"] == 20
    if on_notice:  # every rank finished step 6, saved step 7 and ended well within the grace period
        assert said["notice"]["step"] == AT + 1 and said["notice"]["fitted"] is True
        assert said["notice"]["saved_s"] < 20
    else:
        assert said["notice"]["step"] is None and said["notice"]["fitted"] is None

    resumed = run_cli(*command, f"resume={run}", timeout=120)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resumed from step {loaded}\n" in resumed.stdout
    left_nothing(run, shm_before)
    result = json.loads((run / "result.json").read_text())
    assert result["status"] == "ok" and result["final_state_sha256"] == fault_free["final_state_sha256"]
    assert result["state_parts"] and all(v["exact"] for v in result["state_parts"].values()), result["state_parts"]
    assert result["jobs"] == 2 and result["job_restarts"][0]["lost_steps"] == (0 if on_notice else AT - 4)
    events = read_events(run)
    assert sum(e["kind"] == "fault_injected" for e in events) == 1  # the notice does not come again
    assert {e["rank"] for e in events if e["kind"] == "notice_saved"} == ({0, 1} if on_notice else set())


@pytest.mark.parametrize(("overrides", "said"), [
    (("strategy=none", "checkpoint.on_notice=true"), "strategy=none never saves"),
    (("strategy=replica", "fault=preempt"), "fault=preempt: ends the whole job"),
    (("fault=preempt", "fault.grace_s=0"), "fault.grace_s=0"),
    (("fault=preempt", "supervisor.launcher=torchrun"), "supervisor.launcher=torchrun"),
])
def test_what_a_preemption_cannot_go_with_is_refused_in_one_line(tmp_path, overrides, said):
    assert said in refusal(tmp_path, (*overrides, *TRAINING))


def test_the_job_loss_bench_refuses_unknown_names_and_says_what_a_notice_save_was_worth(capsys):
    from resilience.bench import job_loss
    assert job_loss.main(["--cases", "job_kill at noon"]) == 2 and "--cases=job_kill at noon" in capsys.readouterr().err
    assert job_loss.main(["--strategies", "sync,nope"]) == 2 and "nope unknown" in capsys.readouterr().err
    row = {"resume_exit": 0, "status": "ok", "matches": True, "parts_lost": [], "lost_steps": 7, "loaded_step": 0,
           "notice": {"step": 7, "saved_s": 0.14, "fitted": True}, "shm_left": [], "processes_left": ["saver"]}
    said = job_loss.verdict(row)  # saved in time, but where no new job finds it (a memory copy), and a leak
    assert said.startswith("bit-exact, 7 lost (from step 0); saved 0.14 s") and "did not outlive the job" in said
    assert said.endswith("1 process(es) outlived the job")
    assert job_loss.verdict({**row, "matches": False, "parts_lost": ["rng"]}).startswith("NOT bit-exact (rng lost)")
