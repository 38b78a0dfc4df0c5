"""strategy=swift_log (docs/pipeline_parallel.md, "swift_log: only the lost stage restarts"): the recovery's plan on
every rank's standing (units), what it refuses in one line, and end to end on 2 stages of gpt_tiny: a killed stage
is replaced alone, replays from its neighbour's log and the run ends on the fault-free run's bits; a kill during the
replay, and the loss of the stage holding the log with it, recover too."""

from __future__ import annotations

import pytest
import torch
from conftest import checked, refusal, run_experiment

from resilience.parallel.boundary_log import BACKWARD, FORWARD, BoundaryLog
from resilience.record.events import read_events
from resilience.strategies.swift_log import Plan, ReplayRefused, Standing, plan

# --- the plan, the same on every rank ----------------------------------------------------------------------------


def test_a_replacement_between_survivors_gets_each_neighbours_log_and_replays_to_their_step():
    got = plan([Standing(True, 7, 4), Standing(False, 4, 4), Standing(True, 7, 0)])
    assert got == Plan(7, {1: 4}, [(0, 1, FORWARD), (2, 1, BACKWARD)])
    assert plan([Standing(False, 0, 0), Standing(True, 3, 0)]) == Plan(3, {0: 0}, [(1, 0, BACKWARD)])


def test_every_stage_restarted_is_a_restart_from_the_checkpoint_they_all_loaded():
    assert plan([Standing(False, 8, 8), Standing(False, 8, 8)]) == Plan(8, {}, [])


REFUSED = [
    ([Standing(False, 8, 8), Standing(False, 4, 4)], "loaded the checkpoints of different steps [4, 8]"),
    ([Standing(True, 7, 4), Standing(True, 8, 4), Standing(False, 4, 4)], "stopped at different steps [7, 8]"),
    ([Standing(True, 7, 8), Standing(False, 4, 4)], "stage 0's log begins at step 8, after the checkpoint"),
    ([Standing(True, 7, 4), Standing(False, 4, 4), Standing(False, 4, 4)], "stages 1 and 2 were lost together"),
    ([Standing(True, 3, 0), Standing(False, 4, 4)], "past the survivors' step 3"),
]


@pytest.mark.parametrize("standings,why", REFUSED, ids=[r[1][:24] for r in REFUSED])
def test_what_would_not_be_exact_is_refused_in_one_line(standings, why):
    with pytest.raises(ReplayRefused) as info:
        plan(standings)
    assert "\n" not in str(info.value) and why in str(info.value) and str(info.value).startswith("swift_log: ")


def test_the_supervisor_ends_the_run_with_the_refusal_a_rank_recorded(tmp_path):
    from resilience.record.events import EventLog
    from resilience.supervise.replacing import refusal as said

    log = EventLog(tmp_path, 1, 1)
    log.emit("rank_error", error="ReplayRefused: swift_log: stage 0's log begins at step 8, after the checkpoint")
    log.close()
    assert said(tmp_path, [1]) == "swift_log: stage 0's log begins at step 8, after the checkpoint"
    assert said(tmp_path, [0]) is None  # another rank's, or another error: the supervisor's own line


# --- the table ---------------------------------------------------------------------------------------------------

PP = ("parallel=pp", "world_size=2", "workload=gpt_tiny", "strategy=swift_log")
TABLE = [
    (("strategy=swift_log",), "parallel=ddp", "use parallel=pp"),
    (("parallel=pp_dp", "world_size=4", "strategy=swift_log"), "parallel=pp_dp", "one pipeline of 2 stages"),
    (("parallel=pp", "parallel.stages=3", "world_size=3", "strategy=swift_log"), "parallel.stages=3",
     "one pipeline of 2 stages"),
    ((*PP, "train.lr_schedule=warmup_cosine"), "train.lr_schedule=warmup_cosine", "train=replayable"),
    ((*PP, "train=real"), "train.rng=carried", "train=replayable"),
    ((*PP, "recovery=rollback"), "recovery=rollback", "strategy=sync"),
    ((*PP, "fault=job_kill"), "fault=job_kill", "strategy=sync"),
    ((*PP, "fault=drain"), "fault=drain", "strategy=swift_log does not hand over"),
    (("parallel=pp", "world_size=2", "strategy=sync", "fault=kill", "fault.phase=during_replay", "fault.at_step=5"),
     "fault.phase=during_replay", "strategy=swift_log"),
]


@pytest.mark.parametrize("overrides,setting,instead", TABLE, ids=[t[1] for t in TABLE])
def test_where_swift_log_cannot_run_is_one_clear_line(tmp_path, overrides, setting, instead):
    line = refusal(tmp_path, overrides)
    assert "\n" not in line and line.startswith(setting) and instead in line, line


def test_swift_log_under_a_pipeline_of_two_stages_passes(tmp_path):
    checked(tmp_path, (*PP, "checkpoint.every=4", "fault=kill", "fault.rank=1", "fault.at_step=[5,7]",
                       "fault.phase=[during_replay,before_forward]", "train.clip_norm=0.5"))


def test_the_log_keeps_every_stages_norm_per_step_until_a_checkpoint_replaces_them():
    log = BoundaryLog(frozenset())
    for step in range(3):
        log.begin(step)
        log.record_norms([torch.tensor(float(step)), torch.tensor(step + 0.5)], 0.5)
    assert log.max_norm == 0.5 and torch.equal(log.norms[2], torch.tensor([2.0, 2.5]))
    log.discard_before(2)
    assert list(log.norms) == [2]


# --- end to end: 2 stages, 12 steps, checkpoints at 4 and 8 -------------------------------------------------------

RUN = (*PP, "steps=12", "seed=0", "detector=[process_exit]")


def replaced_alone(run, result: dict, reference: dict, rank: int, restarts: int = 1) -> list[dict]:
    """The run ended on the reference's bits, only ``rank`` restarted (``restarts`` times), and the other stage loaded
    nothing after the fault; the replacement's events."""
    assert result["status"] == "ok" and result["recovered"] and result["replicas_agree"], result.get("error")
    assert result["final_state_sha256"] == reference["final_state_sha256"]
    assert result["reference"]["matches"] is True
    assert result["ranks_restarted"] == [rank] and result["survivors_restarted"] is False
    events = read_events(run)
    t0 = min(e["t_mono"] for e in events if e["kind"] == "fault_injected")
    after = [e for e in events if e["t_mono"] >= t0]
    starts = [e["rank"] for e in after if e["kind"] == "run_start"]
    assert starts == [rank] * restarts, starts
    read = [e for e in after if e["kind"] in ("ckpt_read_verified", "ckpt_loaded", "stage_loaded")]
    assert {e["rank"] for e in read} == {rank}, read  # the survivor read no checkpoint
    assert all(e["files"] < e["of_files"] for e in read if e["kind"] == "ckpt_read_verified")  # its stage's files
    kept = [e for e in after if e["kind"] == "stage_rejoined" and e["rank"] != rank]
    assert kept and all(e["kept"] for e in kept), kept
    return [e for e in after if e["rank"] == rank]


# The kill of the last stage between checkpoints (4 loaded, steps 4-6 replayed from stage 0's activations: CI), and
# in its write of checkpoint 8 (uncommitted: the survivor kept its log from 4; 4-7 replayed).
KILLS = [("before_forward", 7), ("during_checkpoint", 8)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("phase,at_step", KILLS, ids=[k[0] for k in KILLS])
def test_a_killed_stage_alone_restarts_and_replays_from_its_neighbours_log_bit_exact(tmp_path, pp_reference, phase,
                                                                                    at_step):
    result = run_experiment(tmp_path / "hit", *RUN, "checkpoint.every=4", "fault=kill", "fault.rank=1",
                            f"fault.phase={phase}", f"fault.at_step={at_step}", timeout=400)
    mine = replaced_alone(tmp_path / "hit", result, pp_reference, rank=1)
    replayed = [e for e in mine if e["kind"] == "stage_replayed"]
    assert [(e["from_step"], e["step"], e["steps"], e["sources"]) for e in replayed] == \
        [(4, at_step, at_step - 4, [0])]
    assert result["lost_steps"] == 0 and result["recovery_source"] == "disk:4+log_replay"


# The first stage, from the last stage's gradients, every entry of the log spilled to disk and read back (long tier:
# CI keeps the last stage's kill from memory).
@pytest.mark.timeout(600)
def test_the_first_stage_killed_replays_from_the_last_stages_gradients_bit_exact(tmp_path, pp_reference):
    result = run_experiment(tmp_path / "hit", *RUN, "checkpoint.every=4", "fault=kill", "fault.rank=0",
                            "fault.at_step=6", "strategy.budget_bytes=0", timeout=400)
    mine = replaced_alone(tmp_path / "hit", result, pp_reference, rank=0)
    replayed = [e for e in mine if e["kind"] == "stage_replayed"]
    assert [(e["from_step"], e["step"], e["sources"]) for e in replayed] == [(4, 6, [1])]
    spilled = [e for e in read_events(tmp_path / "hit") if e["kind"] == "log_discarded"]
    assert spilled and all(e["held_bytes"] == 0 for e in spilled) and max(e["spilled_total"] for e in spilled) > 0
    assert not (tmp_path / "hit" / "boundary_log").exists()  # the supervisor removed the spill files


# Killed again in its replay (step 5 of 4-6): the survivor kept its log, the next replacement replays it all again.
@pytest.mark.timeout(600)
def test_a_kill_during_the_replay_replaces_the_stage_again_and_ends_bit_exact(tmp_path, pp_reference):
    result = run_experiment(tmp_path / "hit", *RUN, "checkpoint.every=4", "fault=kill", "fault.rank=1",
                            "fault.at_step=[5,7]", "fault.phase=[during_replay,before_forward]", timeout=500)
    mine = replaced_alone(tmp_path / "hit", result, pp_reference, rank=1, restarts=2)
    assert result["faults_injected"] == 2
    replayed = [e for e in mine if e["kind"] == "stage_replayed"]
    assert [(e["from_step"], e["step"]) for e in replayed] == [(4, 7)]  # the first replay died at step 5


# The stage holding the log lost with the one that needs it (their node lost): both restart from the checkpoint,
# as a restart of every rank does.
@pytest.mark.timeout(600)
def test_the_loss_of_the_stage_holding_the_log_too_restarts_both_from_the_checkpoint_bit_exact(tmp_path,
                                                                                              pp_reference):
    result = run_experiment(tmp_path / "hit", *RUN, "checkpoint.every=4", "fault=node_loss", "ranks_per_node=2",
                            "fault.rank=1", "fault.at_step=7", timeout=400)
    assert result["status"] == "ok" and result["recovered"], result.get("error")
    assert result["final_state_sha256"] == pp_reference["final_state_sha256"]
    assert result["ranks_restarted"] == [0, 1]
    events = read_events(tmp_path / "hit")
    loaded = {e["rank"]: e["step"] for e in events if e["kind"] == "ckpt_loaded"}
    assert loaded == {0: 4, 1: 4}, loaded
    assert not [e for e in events if e["kind"] == "stage_replayed"]


# A warm spare takes the lost stage's rank: it built the whole model before it knew its stage, and keeps the stage's
# part with an optimizer over it alone (the rank's main), then recovers as a cold replacement does.
@pytest.mark.timeout(600)
def test_a_warm_spare_takes_the_lost_stage_and_ends_bit_exact(tmp_path, pp_reference):
    result = run_experiment(tmp_path / "hit", *RUN, "checkpoint.every=4", "fault=kill", "fault.rank=1",
                            "fault.at_step=7", "supervisor.spares=1", timeout=400)
    replaced_alone(tmp_path / "hit", result, pp_reference, rank=1)
    restart = [e for e in read_events(tmp_path / "hit") if e["kind"] == "restart"]
    assert [e["from_spares"] for e in restart] == [[1]]


# train.clip_norm: the replayed stage clips by every stage's norm as its neighbour logged them (its own checked).
@pytest.mark.timeout(600)
def test_with_a_clip_the_replay_clips_by_the_logged_norms_of_every_stage_bit_exact(tmp_path, pp_reference):
    clip = "train.clip_norm=0.1"
    ref = run_experiment(tmp_path / "ref", *RUN[:3], *RUN[4:], "strategy=none", "fault=none", clip, timeout=300)
    assert ref["final_state_sha256"] != pp_reference["final_state_sha256"]  # the clip changed the training
    result = run_experiment(tmp_path / "hit", *RUN, "checkpoint.every=4", "fault=kill", "fault.rank=0",
                            "fault.at_step=7", clip, timeout=400)
    mine = replaced_alone(tmp_path / "hit", result, ref, rank=0)
    assert [(e["from_step"], e["step"]) for e in mine if e["kind"] == "stage_replayed"] == [(4, 7)]


# Selective logging on 2 stages (strategy=swift_log_selective, log_every=2): no boundary logged, so the survivor
# cannot serve a replay; it steps back in place to checkpoint 4 beside the replacement (its process kept), and the
# pipeline trains steps 4-6 again (long tier: CI keeps the replay from the log).
@pytest.mark.timeout(600)
def test_selective_logging_on_two_stages_steps_every_stage_back_in_place_bit_exact(tmp_path, pp_reference):
    result = run_experiment(tmp_path / "hit", *RUN[:3], "strategy=swift_log_selective", *RUN[4:], "checkpoint.every=4",
                            "fault=kill", "fault.rank=1", "fault.at_step=7", timeout=400)
    assert result["status"] == "ok" and result["recovered"], result.get("error")
    assert result["final_state_sha256"] == pp_reference["final_state_sha256"]
    assert result["ranks_restarted"] == [1] and result["survivors_restarted"] is False
    assert result["lost_steps"] == 3 and result["stage_log"]["bytes_per_step"] == 0
    events = read_events(tmp_path / "hit")
    assert {e["rank"]: e["step"] for e in events if e["kind"] == "stage_loaded"} == {0: 4, 1: 4}
    assert not [e for e in events if e["kind"] == "stage_replayed"]
    assert [e["kept"] for e in events if e["kind"] == "stage_rejoined"] == [False, False]
