"""The table's rows for pipeline parallelism (``parallel=pp``, ``pp_dp``, docs/pipeline_parallel.md): what a
pipeline of one stage per rank (or replicas of it), checkpointed per stage and restarted whole, cannot do yet.
``resilience.compat`` appends them to the table after the general rows; each names the setting it refuses and what to
use instead."""

from __future__ import annotations

from resilience.caps import StrategyCaps
from resilience.compat.combination import Combination
from resilience.compat.rules import comparing, Rule


def pipelined(c: Combination) -> bool:
    return c.parallel.stages > 1


def stage_ranks(c: Combination) -> str:
    """The settings that size the world of a pipeline: ``parallel.stages=2`` (x ``parallel.replicas=2``)."""
    stages = c.said("parallel", "stages")
    return stages if c.parallel.pipelines == 1 else f"{stages} x {c.said('parallel', 'pipelines')}"


def from_a_replica(caps: StrategyCaps) -> bool:
    """Whether the strategy recovers a lost rank from another rank's copy of its state (none under a pipeline);
    swift_log recovers in place from the stage's own checkpoint and its neighbours' logs, not from a copy."""
    return (caps.recovers_in_place and not caps.replays_stage) or caps.writes_at_failure


TWIN_ONLY = (
    "heals a lost stage from its twin only with a strategy built for it (replica, waiting for the replacement: "
    "strategy.while_replacing=wait)")


def no_twin(c: Combination, caps: StrategyCaps) -> bool:
    """Whether ``caps``' strategy takes a lost rank's state from a replica that this pipeline does not give it:
    under ``pp`` no stage has one; under ``pp_dp`` each stage has one in every other pipeline, and only a strategy
    that heals a stage from it (``heals_stages``: replica's wait mode) is built for it."""
    return from_a_replica(caps) and not (c.parallel.pipelines > 1 and caps.heals_stages)


def one_pipeline_of_two(c: Combination) -> bool:
    """Where swift_log replays a lost stage: one pipeline of 2 stages (its survivor agrees alone on the last step)."""
    return one_pipeline(c) and c.parallel.stages == 2


def one_pipeline(c: Combination) -> bool:
    return pipelined(c) and c.parallel.pipelines == 1


def unlogged(c: Combination) -> str | None:
    """The loop's setting whose state a stage's replay would not reproduce (None: the replayable loop's)."""
    if c.rng != "reseed":
        return f"train.rng={c.rng}"
    return None if c.lr_schedule == "constant" else f"train.lr_schedule={c.lr_schedule}"


def within_the_job(c: Combination) -> str | None:
    """The setting that needs a recovery beyond the live ranks' logs (None: none does)."""
    if c.recovery.rolls_back:
        return c.set("recovery")
    if c.fault.ends_the_job:
        return c.set("fault")
    return None if c.resume is None else f"resume={c.resume}"


PIPELINE_RULES: list[Rule] = [
    Rule("one_stage_per_rank", ("parallel", "world_size"),
         "A pipeline whose stages (in each of its replicas, pp_dp) do not fill the world, one stage per rank.",
         lambda c: pipelined(c) and c.world_size != c.parallel.stages * c.parallel.pipelines,
         lambda c: f"world_size={c.world_size}: {c.set('parallel')} holds one stage per rank; set "
                   f"world_size={c.parallel.stages * c.parallel.pipelines} ({stage_ranks(c)})"),
    Rule("stages_to_cut", ("parallel", "workload"),
         "A pipeline, with a workload whose model does not cut into stages.",
         lambda c: pipelined(c) and not c.workload.splits_into_stages,
         lambda c: f"{c.set('workload')}: its model does not cut into the stages of {c.set('parallel')}; use "
                   f"{c.instead('workload', lambda w: w.splits_into_stages)} or "
                   f"{c.instead('parallel', lambda p: p.stages == 1)}"),
    Rule("saved_per_stage", ("parallel", "strategy"),
         "A pipeline, with a strategy that checkpoints and is not yet checked to save and load each stage's state.",
         lambda c: pipelined(c) and c.strategy.saves and not c.strategy.saves_stages,
         lambda c: f"{c.set('strategy')}: not yet checked to save and load each stage's state under "
                   f"{c.set('parallel')}; use {c.instead('strategy', lambda s: s.saves_stages)}"),
    Rule("stages_restart_together", ("parallel", "strategy"),
         "A pipeline, with a strategy that takes a lost rank's state from a live replica (in place, or written at the "
         "failure): pp holds each stage once; pp_dp heals a stage from its twin in another pipeline only with a "
         "strategy built for it (replica, waiting for the replacement).",
         lambda c: pipelined(c) and no_twin(c, c.strategy),
         lambda c: f"{c.set('strategy')}: takes a lost rank's state from a live replica, and {c.set('parallel')} "
                   f"{'holds each stage once' if c.parallel.pipelines == 1 else TWIN_ONLY}; use "
                   f"{c.instead('strategy', lambda s: not no_twin(c, s))}"),
    Rule("a_stage_to_replay", ("parallel", "strategy"),
         "A strategy that replays a lost pipeline stage from its neighbours' logs, without one pipeline of 2 stages "
         "(more stages need the survivors' agreement and a group replay; replicas a heal from the stage's replica).",
         lambda c: c.strategy.replays_stage and not one_pipeline_of_two(c),
         lambda c: f"{c.said('parallel', 'stages') if one_pipeline(c) else c.set('parallel')}: {c.set('strategy')} "
                   f"replays a lost stage of one pipeline of 2 stages from its neighbour's log "
                   f"(not yet on more stages, nor across replicas); use "
                   f"{c.instead('parallel', lambda p: p.stages == 2 and p.pipelines == 1)}"),
    Rule("a_replay_on_the_replayable_loop", ("strategy", "train.rng", "train.lr_schedule"),
         "A strategy that replays a lost stage's steps, with a loop whose state besides the model and optimizer it "
         "would not reproduce (carried RNG streams, an LR schedule: not logged yet; a clip's norms over every stage "
         "are).",
         lambda c: c.strategy.replays_stage and unlogged(c) is not None,
         lambda c: f"{unlogged(c)}: {c.set('strategy')} replays a stage's steps with the RNG re-seeded per step and "
                   f"the model and optimizer as the whole state (this setting's state is not logged yet); use "
                   f"train=replayable"),
    Rule("a_replay_within_the_job", ("strategy", "recovery", "fault", "resume"),
         "A strategy that replays a lost stage from its live neighbours' logs, with a policy that rolls back, a fault "
         "that ends the whole job or a resume in a new job (the logs live in the ranks).",
         lambda c: c.strategy.replays_stage and within_the_job(c) is not None,
         lambda c: f"{within_the_job(c)}: {c.set('strategy')} replays "
                   f"a lost stage from its live neighbours' logs, within the job, and rolls no stage back; use "
                   f"{c.instead('strategy', lambda s: s.saves and s.saves_stages and not s.replays_stage)}"),
    Rule("a_replay_to_strike", ("fault", "strategy"),
         "A fault that strikes during a lost stage's replay, with a strategy that never replays one (it would never "
         "fire).",
         lambda c: c.fault.strikes_replay and not c.strategy.replays_stage,
         lambda c: f"fault.phase=during_replay: strikes during a lost stage's replay, which {c.set('strategy')} never "
                   f"runs; use {c.instead('strategy', lambda s: s.replays_stage)}"),
    Rule("stages_keep_their_world", ("parallel", "recovery"),
         "A pipeline, with a policy that changes the world size or restarts the training inside its processes.",
         lambda c: pipelined(c) and (c.recovery.resizes_world or c.recovery.restarts_in_process),
         lambda c: f"{c.set('recovery')}: {c.set('parallel')} needs every stage's rank, each in a new process, "
                   f"after a failure; use "
                   f"{c.instead('recovery', lambda p: not (p.resizes_world or p.restarts_in_process))}"),
    Rule("no_ddp_in_a_pipeline", ("parallel", "fault"),
         "A pipeline, with a fault that reaches into DDP's module and reduction.",
         lambda c: pipelined(c) and c.fault.reaches_into_ddp,
         lambda c: f"{c.set('fault')}: reaches into DDP's module and reduction, which {c.set('parallel')} has not; "
                   f"use {c.instead('fault', lambda f: not f.reaches_into_ddp)}"),
    Rule("stages_compared", ("parallel", "detector"),
         "A pipeline, with a detector that compares the ranks' states (they hold different stages).",
         lambda c: pipelined(c) and bool(comparing(c)),
         lambda c: f"detector={comparing(c)}: compares the ranks' states, which are different stages under "
                   f"{c.set('parallel')}; leave it out of the detector list"),
    Rule("stages_in_fp32", ("parallel", "train.precision"),
         "A pipeline, with autocast (bf16, fp16: not yet checked around the schedule, nor a scaler per stage).",
         lambda c: pipelined(c) and c.precision != "fp32",
         lambda c: f"train.precision={c.precision}: {c.set('parallel')} trains in fp32 for now (autocast around "
                   f"its schedule is not yet checked); use train.precision=fp32"),
    Rule("micro_batches_accumulate", ("parallel", "train.grad_accum"),
         "A pipeline, with the loop's gradient accumulation (the pipeline's micro-batches are its accumulation).",
         lambda c: pipelined(c) and c.grad_accum > 1,
         lambda c: f"train.grad_accum={c.grad_accum}: under {c.set('parallel')} a step's micro-batches are "
                   f"parallel.microbatches; set train.grad_accum=1"),
    Rule("stages_on_synthetic_data", ("parallel", "train.data"),
         "A pipeline, with the token file's loader (the first stage's loader is not yet built).",
         lambda c: pipelined(c) and c.data == "loader",
         lambda c: f"train.data=loader: {c.set('parallel')} trains on synthetic batches for now (a loader on the "
                   f"first stage is not yet built); use train.data=synthetic"),
]
