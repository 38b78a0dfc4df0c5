"""Pipeline parallelism (``parallel=pp``, docs/pipeline_parallel.md): the stages cut from gpt_tiny are the whole
model bit for bit and partition its state; what a pipeline cannot do yet is refused in one line; end to end, a
fault-free run repeats bit for bit, and a killed stage restarts with every rank from the stages' checkpoint and ends
on the fault-free run's state.

(Not tests/test_pipeline.py: that one is the Snakemake pipeline of experiments.)"""

from __future__ import annotations

import pipeline_ranks
import pytest
import torch
from conftest import PP, ROOT, checked, refusal, run_experiment
from sharded_ranks import spawn
from hydra.utils import instantiate
from omegaconf import OmegaConf

from resilience.record.events import read_events
from resilience.state.train import TrainState


def workload(name: str = "gpt_tiny"):
    return instantiate(OmegaConf.load(ROOT / "conf" / "workload" / f"{name}.yaml"), seed=0)


def stages_of(stages: int) -> list[torch.nn.Module]:
    """Each stage cut from a model of its own, as each rank builds it."""
    wl = workload()
    return [wl.pipeline_stage(wl.build_model(), s, stages) for s in range(stages)]


@pytest.mark.parametrize("stages", [2, 3, 5])
def test_the_stages_in_a_row_are_the_whole_model_bit_for_bit(stages):
    """Forward, loss and every parameter's gradient: the chained stages compute what the unsplit model does."""
    wl = workload()
    full, cut = wl.build_model(), stages_of(stages)
    x, y = wl.batch(3, 0, torch.device("cpu"))
    whole = full(x)
    out = x
    for stage in cut:
        out = stage(out)
    assert torch.equal(out, whole)
    wl.loss_fn(whole, y).backward()
    wl.loss_fn(out, y).backward()
    grads = {name: p.grad for stage in cut for name, p in stage.named_parameters()}
    assert grads.keys() == dict(full.named_parameters()).keys()
    assert all(torch.equal(grads[name], p.grad) for name, p in full.named_parameters())


@pytest.mark.parametrize("stages", [2, 5])
def test_the_stages_state_keys_partition_the_whole_models_and_flat_optimizer_keys_are_each_stages_own(stages):
    """DCP writes each key once: a key two stages share would be written by one of them for both. The model's keys
    partition the unsplit model's; the flat optimizer state (``TrainState.flat_optim``) is keyed by parameter name,
    where the nested one holds every stage's ``param_groups`` (their parameters' names) under one key."""
    wl = workload()
    whole = set(wl.build_model().state_dict())
    cut = stages_of(stages)
    keys = [set(stage.state_dict()) for stage in cut]
    assert set().union(*keys) == whole and sum(map(len, keys)) == len(whole)
    flat, groups = [], []
    for stage in cut:
        state = TrainState(stage, wl.build_optimizer(stage), flat_optim=True)
        flat.append(set(state.state_dict(parts=())["optim"]))  # a fresh optimizer gets its state here (zero LR)
        groups.append(TrainState(stage, state.optimizer).state_dict(parts=())["optim"]["param_groups"])
    assert all(not (a & b) for i, a in enumerate(flat) for b in flat[i + 1:])
    assert len({str(g[0]["params"]) for g in groups}) == stages  # one key, a different value on each stage


REFUSED = [
    (("parallel=pp", "world_size=3"), "world_size=3", "set world_size=2 (parallel.stages=2)"),
    (("parallel=pp", "workload=dlrm_emb"), "workload=dlrm_emb", "workload=gpt"),
    (("parallel=pp", "strategy=async"), "strategy=async", "strategy=sync"),
    (("parallel=pp", "strategy=replica"), "strategy=replica", "use strategy=none, strategy=swift_log or strategy=sync"),
    (("parallel=pp", "strategy=jit"), "strategy=jit", "use strategy=none, strategy=swift_log or strategy=sync"),
    (("parallel=pp", "recovery=shrink", "fault=node_loss"), "recovery=shrink", "recovery=restart"),
    (("parallel=pp", "fault=bitflip"), "fault=bitflip", "fault=kill"),
    (("parallel=pp", "detector=[replica_fingerprint]"), "replica_fingerprint", "detector list"),
    (("parallel=pp", "train=real"), "train.precision=bf16", "fp32"),
    (("parallel=pp", "train.grad_accum=2"), "train.grad_accum=2", "parallel.microbatches"),
    (("parallel=pp", "parallel.microbatches=3"), "parallel.microbatches=3", "workload.batch_size=8"),
    (("parallel=pp", "parallel.microbatches=1"), "parallel.microbatches=1", "parallel.schedule=1f1b"),
    (("parallel=pp", "parallel.schedule=zero_bubble"), "parallel.schedule=zero_bubble", "gpipe"),
    (("parallel=pp", "workload.n_layer=1"), "workload.n_layer=1", "parallel.stages=2"),
]


@pytest.mark.parametrize("overrides,setting,allowed", REFUSED, ids=[r[1] for r in REFUSED])
def test_what_a_pipeline_cannot_do_yet_is_one_clear_line(tmp_path, overrides, setting, allowed):
    line = refusal(tmp_path, overrides)
    assert "\n" not in line and setting in line and allowed in line, line


@pytest.mark.parametrize("overrides", [("parallel=pp", "strategy=none"), ("parallel=pp", "strategy=sync"),
                                       ("parallel=pp", "parallel.schedule=gpipe", "parallel.microbatches=1")])
def test_the_pipeline_combinations_pass(tmp_path, overrides):
    checked(tmp_path, overrides)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gpipe_and_1f1b_end_on_the_same_bits_and_repeat(tmp_path):
    """Both schedules run each stage's micro-batches forward and backward in the same order: the same sums."""
    spawn(pipeline_ranks.schedules_rank, 2, str(tmp_path))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_stages_checkpoint_loads_back_bit_for_bit_only_with_the_flat_optimizer_state(tmp_path):
    """The regression test of ``TrainState.flat_optim``: without it DCP gives both stages one stage's groups."""
    spawn(pipeline_ranks.round_trip_rank, 2, str(tmp_path))


# End to end: gpt_tiny's 5 blocks as 3 | 2 on 2 ranks, 4 micro-batches of 2 samples, 12 steps.
@pytest.mark.timeout(600)
def test_a_fault_free_pipeline_run_repeats_bit_for_bit(tmp_path, pp_reference):
    again = run_experiment(tmp_path / "again", *PP, "strategy=none", "fault=none", timeout=300)
    assert again["replicas_agree"] and again["final_state_sha256"] == pp_reference["final_state_sha256"]
    assert again["reference"]["matches"] is True


# A kill of the last stage's rank before its forward (checkpoint 4 loaded) and in its part of checkpoint 8's write
# (8 uncommitted: 4 loaded); every rank restarts and each stage loads its own state.
KILLS = [("before_forward", 7), ("during_checkpoint", 8)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("phase,at_step", KILLS, ids=[k[0] for k in KILLS])
def test_a_killed_stage_restarts_with_every_rank_and_ends_bit_exact(tmp_path, pp_reference, phase, at_step):
    run = tmp_path / "hit"
    hit = run_experiment(run, *PP, "strategy=sync", "checkpoint.every=4", "fault=kill", "fault.rank=1",
                         f"fault.phase={phase}", f"fault.at_step={at_step}", timeout=400)
    assert hit["status"] == "ok" and hit["recovered"] and hit["replicas_agree"]
    assert hit["final_state_sha256"] == pp_reference["final_state_sha256"]
    assert hit["reference"]["matches"] is True
    events = read_events(run)
    loaded = {e["rank"]: e["step"] for e in events if e["kind"] == "ckpt_loaded"}
    assert loaded == {0: 4, 1: 4}, loaded
    read = [e for e in events if e["kind"] == "ckpt_read_verified"]  # each stage read its own files, not all
    assert read and all(e["files"] < e["of_files"] for e in read), read
