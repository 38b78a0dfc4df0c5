"""The whole job's state (train=real): every part restored after a kill is named exact, and a strategy that drops
parts is named for each part it lost, from the first step that differs (issue "whole job state")."""

from __future__ import annotations

import pytest

from conftest import SHORT_REAL, run_experiment
import torch

from resilience.state.parts import Counters, JobParts, require_parts
from resilience.state.train import RestorePoint, TrainState

pytestmark = pytest.mark.slow

# gpt_tiny with dropout: the RNG streams decide the masks, so a lost RNG shows
LOOP = ("train=real", "train.data=synthetic", "workload.dropout=0.1", "reference.check=run")
REAL = ("train=real", "workload.dropout=0.1", "reference.check=run", "steps=12")  # data through the loader


@pytest.fixture
def real_reference(fault_free_run) -> None:
    """REAL's training is SHORT_REAL's: its fault-free run, once for the session (tests/test_preempt.py's too), is
    the reference reference.check=run finds; it hashes the parts at every step (the point of the load at 5 too)."""
    fault_free_run(*SHORT_REAL)


def lost(result: dict) -> dict[str, int]:
    return {p: v["first_diff_step"] for p, v in result["state_parts"].items() if v["exact"] is False}


def test_three_kills_of_the_real_loop_restore_every_part_and_every_sample_exactly_once(tmp_path):
    """The issue's acceptance run (docs/job_state.md): the token file through a StatefulDataLoader with 2 workers,
    4 epochs in 16 steps, a checkpoint every 3; kills in step 6's save, at step 10 (loading step 9, mid-epoch) and
    at step 13 (loading step 12, an epoch's end)."""
    r = run_experiment(tmp_path / "sync", "train=real", "workload.dropout=0.1", "reference.check=run", "steps=16",
                       "checkpoint.every=3", "strategy=sync", "fault=kill", "fault.at_step=[6,10,13]",
                       "fault.phase=[during_checkpoint,before_optimizer_step,before_forward]")
    assert r["status"] == "ok" and r["faults_injected"] == 3 and r["recoveries"] == 3
    assert r["reference"]["matches"] is True
    assert set(r["state_parts"]) == {"model", "optimizer", "lr_scheduler", "rng", "train_state", "dataloader"}
    assert lost(r) == {} and all(v["checked_points"] > 0 for v in r["state_parts"].values())
    assert r["ledger"]["exactly_once"] is True and r["ledger"]["steps_checked"] == 32  # 16 steps x 2 ranks


@pytest.mark.usefixtures("real_reference")
@pytest.mark.parametrize("control, must_lose", [
    ("sync_model_only", {"lr_scheduler", "rng", "train_state", "dataloader", "model", "optimizer"}),
    ("sync_no_rng", {"rng", "model", "optimizer"}),
])
def test_the_negative_controls_are_named_not_exact_with_the_parts_they_lose(tmp_path, control, must_lose):
    r = run_experiment(tmp_path / control, *REAL, f"strategy={control}", "fault=kill", "fault.at_step=7")
    assert r["status"] == "ok" and r["reference"]["matches"] is False
    assert set(lost(r)) == must_lose
    # the load at step 5 is the first checked point after the kill: the parts not saved differ from there on
    assert all(lost(r)[p] == 5 for p in must_lose - {"model", "optimizer"})
    assert set(r["state_parts"]) - must_lose <= {"lr_scheduler", "train_state", "dataloader"}  # kept: exact
    # the samples: a loader started over trains some twice and skips others; one restored trains each once
    assert r["ledger"]["exactly_once"] is ("dataloader" not in must_lose)


def test_fp16_a_kill_after_steps_the_scaler_skipped_recovers_exact(tmp_path):
    """A loss scale of 2^24 overflows the fp16 gradients of the first steps: the scaler skips them and halves
    its scale. The kill at step 4 reloads step 2, whose scaler state must come back (a fresh scaler would skip
    steps again and train on)."""
    r = run_experiment(tmp_path / "fp16", *LOOP, "train.precision=fp16", "train.fp16_init_scale=16777216",
                       "checkpoint.every=2", "steps=6", "strategy=sync", "fault=kill", "fault.at_step=4")
    assert r["status"] == "ok" and r["reference"]["matches"] is True and lost(r) == {}
    assert "scaler" in r["state_parts"]


def test_the_parts_travel_as_bytes_and_load_back_into_their_rank_only():
    sent = JobParts(0, job={"train_state": Counters()}, per_rank={"dataloader": Counters()})
    sent.job["train_state"].advance(8, 512, 1)
    sent.per_rank["dataloader"].advance(4, 256, 1)
    sd = sent.state_dict()
    assert set(sd) == {"job", "rank"} and isinstance(sd["rank"]["0"]["dataloader"], bytes)
    other = JobParts(1, job={"train_state": Counters()}, per_rank={"dataloader": Counters()})
    other.load_state_dict(sd)  # the job-wide part is everyone's; rank 0's own part is not rank 1's to take
    assert other.job["train_state"].samples == 8 and other.per_rank["dataloader"].samples == 0
    same = JobParts(0, job={"train_state": Counters()}, per_rank={"dataloader": Counters()})
    same.load_state_dict(sd)
    assert same.hashes() == sent.hashes()


def test_a_strategy_names_only_parts_there_are():
    assert require_parts("strategy.parts", ["rng", "dataloader"]) == ("rng", "dataloader")
    with pytest.raises(ValueError, match=r"strategy.parts=\['rngs'\]: must be all, or a list of the parts"):
        require_parts("strategy.parts", ["rngs"])


def test_a_load_that_loads_nothing_puts_the_parts_back_too():
    """A rejected checkpoint leaves no trace (issue "job resume", item 8), in the job's parts as in the optimizer."""
    model = torch.nn.Linear(2, 2)
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1),
                       JobParts(0, job={"train_state": Counters()}, per_rank={"dataloader": Counters()}))
    state.parts.job["train_state"].advance(8, 512, 0)
    before = state.parts.hashes()
    point = RestorePoint(state)
    state.parts.job["train_state"].advance(8, 512, 1)  # what a half-done load may have written
    state.parts.per_rank["dataloader"].advance(1, 1, 1)
    point.restore()
    assert state.parts.hashes() == before
