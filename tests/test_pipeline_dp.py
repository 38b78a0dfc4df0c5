"""Replicated pipelines (``parallel=pp_dp``, docs/pipeline_parallel.md): every rank forms every group in one order
and holds the stage and pipeline its rank says; a world the pipelines do not fill is refused in one line (exit 2);
end to end, a fault-free run repeats bit for bit with the replicas of each stage agreeing, a rank killed mid-run
restarts with every rank from the stages' checkpoint and ends on the fault-free run's state, and under
``strategy=replica`` a killed rank alone is replaced and healed from its twin (the same stage of the other
pipeline), bit exact, while the loss of both replicas of a stage ends the run saying so."""

from __future__ import annotations

from datetime import timedelta

import pipeline_ranks
import pytest
import torch.distributed as dist
from conftest import checked, exact, of_kind, refusal, run_cli, run_experiment
from sharded_ranks import spawn

from resilience.record.events import read_events
from resilience.runtime.pipeline import group_order, make_layout

TIMEOUT = timedelta(seconds=42)


def test_every_rank_forms_every_group_in_one_order_and_holds_its_stage_of_its_pipeline(monkeypatch):
    """Stages outermost (stage ``r // replicas``, pipeline ``r % replicas``); ``new_group`` is collective over the
    world, so each rank forms the same groups in the same order (the stages' data-parallel groups, then the
    pipelines), each with the collective timeout, and keeps its own."""
    stages, replicas = 3, 2
    formed: dict[int, list] = {}
    for rank in range(stages * replicas):
        calls = formed[rank] = []

        def new_group(ranks, timeout=None, calls=calls):
            calls.append((tuple(ranks), timeout))
            return f"group{tuple(ranks)}"

        monkeypatch.setattr(dist, "new_group", new_group)
        layout = make_layout(rank, stages * replicas, stages, replicas, TIMEOUT)
        stage, replica = rank // replicas, rank % replicas
        assert (layout.stage, layout.replica, layout.stages, layout.replicas) == (stage, replica, stages, replicas)
        assert layout.pp_ranks == tuple(s * replicas + replica for s in range(stages))
        assert layout.dp_ranks == tuple(stage * replicas + r for r in range(replicas))
        assert layout.pp_group == f"group{layout.pp_ranks}" and layout.dp_group == f"group{layout.dp_ranks}"
    expected = [((0, 1), TIMEOUT), ((2, 3), TIMEOUT), ((4, 5), TIMEOUT), ((0, 2, 4), TIMEOUT), ((1, 3, 5), TIMEOUT)]
    assert [g for g, _ in expected] == group_order(stages, replicas)
    assert all(calls == expected for calls in formed.values()), formed


def test_one_pipeline_forms_no_group():
    """``parallel=pp``: the world's group carries the activations (no collective call before the first step)."""
    layout = make_layout(1, 2, 2)
    assert (layout.stage, layout.replica, layout.pp_ranks, layout.pp_group, layout.dp_group) == (1, 0, (0, 1), None,
                                                                                                  None)


def test_a_world_the_pipelines_do_not_fill_is_refused_in_one_line_with_exit_2(tmp_path):
    done = run_cli("parallel=pp_dp", "world_size=2", "workload=gpt_tiny", f"hydra.run.dir={tmp_path / 'run'}",
                   timeout=60)
    assert done.returncode == 2 and done.stderr.count("\n") <= 1, done.stderr
    assert "world_size=2" in done.stderr and "set world_size=4 (parallel.stages=2 x parallel.replicas=2)" in \
        done.stderr, done.stderr
    line = refusal(tmp_path, ("parallel=pp_dp", "parallel.replicas=3", "world_size=4"))
    assert "set world_size=6 (parallel.stages=2 x parallel.replicas=3)" in line, line


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_stages_replicas_average_its_gradients_summed_in_rank_order(tmp_path):
    """Three replicas: no backend's all-reduce order, the rank-order sum (``reduce.ordered_mean``), bit for bit."""
    spawn(pipeline_ranks.ordered_mean_rank, 3, str(tmp_path))


REFUSED = [
    (("parallel=pp_dp", "world_size=4", "strategy=replica", "strategy.while_replacing=continue"), "strategy=replica",
     "heals a lost stage from its twin only with a strategy built for it"),
    (("parallel=pp", "world_size=2", "strategy=replica"), "strategy=replica", "holds each stage once"),
    (("parallel=pp_dp", "world_size=4", "strategy=async"), "strategy=async", "strategy=sync"),
    (("parallel=pp_dp", "world_size=2", "parallel.replicas=1"), "parallel.replicas=1", ">= 2"),
]


@pytest.mark.parametrize("overrides,setting,said", REFUSED, ids=[r[1] for r in REFUSED])
def test_what_replicated_pipelines_cannot_do_yet_is_one_clear_line(tmp_path, overrides, setting, said):
    line = refusal(tmp_path, overrides)
    assert "\n" not in line and setting in line and said in line, line


@pytest.mark.parametrize("overrides", [("strategy=none",), ("strategy=sync",), ("strategy=replica",),
                                       ("parallel.stages=4", "parallel.replicas=2", "world_size=8")])
def test_the_replicated_pipeline_combinations_pass(tmp_path, overrides):
    checked(tmp_path, ("parallel=pp_dp", "world_size=4", *overrides))


def test_a_stage_with_no_replica_at_the_newest_step_is_one_line_that_ends_the_run(tmp_path):
    """The heal's source per stage (every rank computes every rank's from the same positions): a stage whose replicas
    were all lost, or are a step behind the others, is ``ReplicasLost``, whose line the supervisor ends the run with."""
    from resilience.ckpt.replica_transfer import ReplicasLost, _source
    from resilience.record.events import EventLog
    from resilience.supervise.replacing import refusal as said

    stages = [0, 0, 1, 1]
    assert [_source(r, [7, 7, 7, -2], stages, 7, "stage") for r in range(4)] == [0, 0, 2, 2]  # rank 3 from its twin
    with pytest.raises(ReplicasLost, match=r"^replica: stage 0 was lost \(every replica of it\); no rank holds its "
                                           r"state of step 5"):
        _source(1, [-2, -2, 5, 5], stages, 5, "stage")
    with pytest.raises(ReplicasLost, match="stage 1 is at step 7, not with the others at 8"):
        _source(3, [8, 8, 7, -2], stages, 8, "stage")
    log = EventLog(tmp_path, 0, 1)
    log.emit("rank_error", error="ReplicasLost: replica: stage 0 was lost (every replica of it); ...")
    log.close()
    assert said(tmp_path, [0]) == "replica: stage 0 was lost (every replica of it); ..."


# End to end: gpt_tiny's 5 blocks as 3 | 2, two pipelines (4 ranks), 4 micro-batches of 2 samples, 12 steps.
PP_DP = ("parallel=pp_dp", "world_size=4", "workload=gpt_tiny", "steps=12", "seed=0", "detector=[process_exit]")


@pytest.fixture(scope="module")
def pp_dp_reference(tmp_path_factory) -> dict:
    """The fault-free run (strategy=none: the reference of its training, recorded for the runs that follow)."""
    ref = run_experiment(tmp_path_factory.mktemp("pp-dp-ref"), *PP_DP, "strategy=none", "fault=none", timeout=400)
    assert ref["status"] == "ok" and ref["replicas_agree"]  # both pipelines end on one hash: their stages agree
    return ref


@pytest.mark.timeout(900)
def test_a_fault_free_replicated_pipeline_run_repeats_bit_for_bit(tmp_path, pp_dp_reference):
    again = run_experiment(tmp_path / "again", *PP_DP, "strategy=none", "fault=none", timeout=400)
    assert again["replicas_agree"] and again["final_state_sha256"] == pp_dp_reference["final_state_sha256"]
    assert again["reference"]["matches"] is True


@pytest.mark.timeout(900)
def test_a_killed_replica_restarts_with_every_rank_and_ends_bit_exact(tmp_path, pp_dp_reference):
    """Rank 3 (the last stage of pipeline 1) killed before step 7's forward: every rank restarts and loads step 4,
    each stage reading only the files its plan names (DCP wrote each stage's keys once, deduplicated across its
    replicas), and the run ends on the fault-free run's state."""
    run = tmp_path / "hit"
    hit = run_experiment(run, *PP_DP, "strategy=sync", "checkpoint.every=4", "fault=kill", "fault.rank=3",
                         "fault.at_step=7", timeout=500)
    assert hit["status"] == "ok" and hit["recovered"] and hit["replicas_agree"]
    assert hit["final_state_sha256"] == pp_dp_reference["final_state_sha256"]
    assert hit["reference"]["matches"] is True
    events = read_events(run)
    loaded = {e["rank"]: e["step"] for e in events if e["kind"] == "ckpt_loaded"}
    assert loaded == {0: 4, 1: 4, 2: 4, 3: 4}, loaded
    read = [e for e in events if e["kind"] == "ckpt_read_verified"]
    assert len(read) == 4 and all(e["files"] < e["of_files"] for e in read), read
    by_stage = {e["rank"] // 2: e["bytes"] for e in read}
    assert all(e["bytes"] == by_stage[e["rank"] // 2] for e in read), read  # the replicas of a stage read alike


# strategy=replica: a killed rank (one stage of one pipeline) is replaced alone and takes its stage from its twin,
# the same stage of the other pipeline (ranks 2s and 2s+1 on 2 x 2); the other three keep their processes and state.
# CI keeps the last stage's kill before step 7's forward; the first stage's, and a kill after the stage's reduction
# (before the optimizer step: the twin and the other stage apply step 7, the heal is at step 8), are the long tier's.
HEALS = [(2, "before_forward"), (1, "before_forward"), (3, "before_optimizer_step")]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("rank,phase", HEALS, ids=[f"rank{r}-{p}" for r, p in HEALS])
def test_a_killed_stage_alone_is_replaced_and_healed_from_its_twin_bit_exact(tmp_path, pp_dp_reference, rank, phase):
    run = tmp_path / "hit"
    result = run_experiment(run, *PP_DP, "strategy=replica", "fault=kill", f"fault.rank={rank}",
                            f"fault.phase={phase}", "fault.at_step=7", timeout=400)
    exact(result)
    assert result["final_state_sha256"] == pp_dp_reference["final_state_sha256"] and result["replicas_agree"]
    assert result["ranks_restarted"] == [rank] and result["survivors_restarted"] is False
    assert result["lost_steps"] == 0
    events = read_events(run)
    t0 = min(e["t_mono"] for e in events if e["kind"] == "fault_injected")
    assert [e["rank"] for e in events if e["kind"] == "run_start" and e["t_mono"] >= t0] == [rank]
    at = 7 + (phase == "before_optimizer_step")
    twin = rank ^ 1
    healed = of_kind(events, "replica_heal")
    assert [(e["rank"], e["step"], e["source"], e["stage"]) for e in healed] == \
        [(rank, at, f"replica:{twin}", rank // 2)], healed
    rejoined = of_kind(events, "rejoined")
    assert sorted((e["rank"], e["step"], e["stage"], e["received"]) for e in rejoined) == \
        [(r, at, r // 2, False) for r in range(4) if r != rank], rejoined


# Both replicas of stage 0 on one node (ranks_per_node=2: ranks 0 and 1) lost at once: no twin holds the stage and
# replica keeps no checkpoint, so every rank says so (exit 76) and the run ends after one replacement, not the budget.
@pytest.mark.timeout(300)
def test_both_replicas_of_a_stage_lost_end_the_run_unrecoverable_saying_which(tmp_path):
    result = run_experiment(tmp_path / "run", *PP_DP, "strategy=replica", "fault=node_loss", "ranks_per_node=2",
                            "fault.rank=0", "fault.at_step=5", timeout=300)
    assert result["status"] == "unrecovered" and result["attempts"] == 2
    assert result["unrecoverable"].startswith("replica: stage 0 was lost (every replica of it); no rank holds its "
                                              "state of step 5"), result["unrecoverable"]
