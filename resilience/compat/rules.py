"""The table's rows: each a condition on one ``Combination`` and the one-line refusal it says, in the order the
command applies them (the first refusal is the one said). A plug-in's module appends rows of its own to ``RULES``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from resilience.caps import StrategyCaps
from resilience.compat.combination import Combination


@dataclass(frozen=True)
class Rule:
    """A row of the table: where ``when`` holds, the combination is refused with the line ``says``. ``reads``: the
    groups and run settings it reads (what the documentation and the test enumerate); ``doc``: what it refuses."""

    name: str
    reads: tuple[str, ...]
    doc: str
    when: Callable[[Combination], bool]
    says: Callable[[Combination], str]

    def check(self, c: Combination) -> str | None:
        return self.says(c) if self.when(c) else None


def comparing(c: Combination) -> str:
    """The detectors that compare the ranks over the world's group, as ``detector=`` lists them ('' for none)."""
    return ",".join(name for name, d in c.detectors.items() if d.compares_ranks)


def hosted(c: Combination) -> list[str]:
    """The roles that run part of themselves in our supervisor, which the run's launcher does not run for them."""
    return [*([c.names["strategy"]] if c.strategy.runs_in_supervisor else []),
            *(name for name, d in c.detectors.items() if d.runs_in_supervisor and d.served_by != c.launcher)]


def unsplit(c: Combination, world_size: int) -> str | None:
    """Why ``world_size`` ranks cannot hold the parallelism's replicas of the shards (None: they can)."""
    replicas = c.parallel.replicas or 1
    if replicas > 1 and (world_size % replicas or world_size // replicas < 2):
        return (f"{c.said('parallel', 'replicas')}: world_size={world_size} must split into {replicas} replicas of "
                f"at least 2 shards (e.g. world_size=4 parallel.replicate=2)")
    return None


def replica_groups(c: Combination) -> int:
    """How many replica groups the run has: each rank one; with sharded state each replica of the shards."""
    return (c.parallel.replicas or 1) if c.parallel.shards_state else c.world_size


def hands_over(caps: StrategyCaps) -> bool:
    """Whether the strategy can give a leaving rank's place to a spare at a step boundary: ours that recover in
    place in the world's group (torchft's quorum, which owns the step, takes a rank in only as a failure; survivors
    training on in a group of their own would agree on the move in another group than the spare's)."""
    return caps.recovers_in_place and not caps.owns_step and caps.keeps_world_group and not caps.replays_stage


def saving(caps: StrategyCaps) -> bool:
    return caps.saves


def survivors(c: Combination) -> int:
    """The ranks left by the loss of one node."""
    return c.world_size - c.ranks_per_node


# The table, in the order the command applies it: the first refusal is the one said.
RULES: list[Rule] = [
    Rule("needs_a_checkpoint", ("fault", "strategy"),
         "A fault that acts on a checkpoint, with a strategy that never takes one.",
         lambda c: c.fault.needs_checkpoint is not None and not c.strategy.saves,
         lambda c: f"{c.fault.needs_checkpoint}: acts on a checkpoint, and {c.set('strategy')} never checkpoints; "
                   f"use another {str(c.fault.needs_checkpoint).partition('=')[0]} or "
                   f"{c.instead('strategy', saving)}"),
    Rule("spares_replace_in_place", ("supervisor.spares", "strategy"),
         "Warm spare ranks, with a strategy that restarts every rank (only one that recovers in place takes a spare).",
         lambda c: c.spares > 0 and not c.strategy.recovers_in_place,
         lambda c: f"supervisor.spares={c.spares}: only a strategy that recovers in place "
                   f"({c.instead('strategy', lambda s: s.recovers_in_place)}) uses spare ranks; set "
                   f"supervisor.spares=0"),
    Rule("fault_outside_the_writer", ("fault", "strategy"),
         "A fault that acts through DCP's file-system layer, with a strategy that opens its checkpoint files itself: "
         "the fault would fire and change nothing.",
         lambda c: c.fault.acts_on_checkpoint_fs and c.strategy.saves and not c.strategy.writes_through_checkpoint_fs,
         lambda c: f"{c.set('fault')}: not applicable to {c.set('strategy')}, whose checkpoint files do not go "
                   f"through DCP's file-system layer that this fault acts on (docs/peers.md)"),
    Rule("world_group_to_compare", ("detector", "strategy"),
         "A detector that compares the ranks over the world's group, with a strategy that does not keep that group "
         "(a rank alone in its group would be compared with itself, a shrunk group's ranks misnamed).",
         lambda c: bool(comparing(c)) and not c.strategy.keeps_world_group,
         lambda c: f"detector={comparing(c)}: compares the ranks over the whole world's group, which "
                   f"{c.set('strategy')} does not keep (its own groups, or a shrunk one); leave it out of the "
                   f"detector list"),
    Rule("parts_in_the_supervisor", ("strategy", "detector", "supervisor.launcher"),
         "A role that runs part of itself in our supervisor across rank restarts, under another launcher (unless "
         "that launcher runs the part itself).",
         lambda c: c.launcher != "local" and bool(hosted(c)),
         lambda c: f"supervisor.launcher={c.launcher}: {', '.join(hosted(c))} runs part of itself in the local "
                   f"supervisor across rank restarts (see its option file); use supervisor.launcher=local"),
    Rule("in_place_or_in_process", ("strategy", "recovery"),
         "A strategy that recovers in place, with a policy that restarts the training in its process: both would "
         "re-form the group after a failure, each its own way.",
         # (swift_log's: a pipeline's row, stages_keep_their_world, names the policies a pipeline keeps)
         lambda c: c.strategy.recovers_in_place and not c.strategy.replays_stage and c.recovery.restarts_in_process,
         lambda c: f"{c.set('recovery')}: restarts every rank's training in its process; {c.set('strategy')} "
                   f"recovers in place itself; use recovery=restart"),
    Rule("written_before_the_interrupt", ("strategy", "recovery"),
         "A strategy that writes the state at a failure before its process ends, with a policy that interrupts every "
         "rank's training in its process at a failure (the write would be cut).",
         lambda c: c.strategy.writes_at_failure and c.recovery.restarts_in_process,
         lambda c: f"{c.set('recovery')}: interrupts every rank's training in its process at a failure, which would "
                   f"cut the write of the state that {c.set('strategy')} makes then; use "
                   f"{c.instead('recovery', lambda p: not p.restarts_in_process)}"),
    Rule("nothing_to_roll_back_to", ("strategy", "recovery"),
         "A strategy that recovers in place (it keeps no checkpoint), with a policy that rolls back to one.",
         lambda c: c.strategy.recovers_in_place and not c.strategy.saves and c.recovery.rolls_back,
         lambda c: f"{c.set('recovery')}: {c.set('strategy')} keeps no checkpoint to roll back to; use "
                   f"recovery=restart or recovery=fail"),
    Rule("in_place_needs_our_supervisor", ("strategy", "supervisor.launcher"),
         "A strategy that recovers in place, under a launcher that restarts every rank.",
         lambda c: c.strategy.recovers_in_place and c.launcher != "local",
         lambda c: f"supervisor.launcher={c.launcher}: {c.set('strategy')} needs the local supervisor, which "
                   f"replaces failed ranks (torchrun restarts every rank)"),
    Rule("the_job_it_ends", ("fault", "supervisor.launcher"),
         "A fault that kills our supervisor with every rank, under a launcher that runs the ranks without it.",
         lambda c: c.fault.ends_the_job and c.launcher != "local",
         lambda c: f"supervisor.launcher={c.launcher}: {c.set('fault')} kills our supervisor with every rank, which "
                   f"this launcher does not run; use supervisor.launcher=local"),
    Rule("struck_from_our_supervisor", ("fault", "strategy", "recovery", "supervisor.launcher"),
         "A fault our supervisor strikes on each attempt's rank processes (a wall-clock trace), where that supervisor "
         "does not restart every rank: another launcher, a strategy that recovers in place, a policy that resizes "
         "the world or restarts in the process.",
         lambda c: c.fault.strikes_from_supervisor and (
             c.launcher != "local" or c.strategy.recovers_in_place or c.recovery.resizes_world
             or c.recovery.restarts_in_process),
         lambda c: f"fault.clock=wall: {c.set('fault')} is struck by our supervisor's restart-all agent on each "
                   f"attempt's rank processes; needs supervisor.launcher=local with a strategy and a recovery that "
                   f"restart every rank (not {c.set('strategy')}, {c.set('recovery')}, "
                   f"supervisor.launcher={c.launcher}), or fault.clock=steps"),
    Rule("nothing_outlives_the_job", ("fault", "strategy"),
         "A fault that ends the whole job, with a strategy whose state lives only in the ranks (nothing to resume).",
         lambda c: c.fault.ends_the_job and c.strategy.recovers_in_place and not c.strategy.saves,
         lambda c: f"{c.set('fault')}: ends the whole job, and {c.set('strategy')} keeps the state only in the "
                   f"ranks' memory, which the job takes with it; use "
                   f"{c.instead('strategy', lambda s: not s.recovers_in_place)}"),
    Rule("a_rank_to_hand_over", ("fault", "strategy"),
         "A node's maintenance notice (its ranks move to spares), with a strategy that cannot recover in place.",
         lambda c: c.fault.hands_over and not hands_over(c.strategy),
         lambda c: f"{c.set('fault')}: moves the node's ranks to spares at a step boundary, with the state of a live "
                   f"replica, which {c.set('strategy')} does not hand over (a checkpointing job's notice is "
                   f"fault=preempt with checkpoint.on_notice=true); use {c.instead('strategy', hands_over)}"),
    Rule("a_save_on_notice", ("strategy", "checkpoint.on_notice"),
         "A save on a preemption's notice, with a strategy that never saves.",
         lambda c: c.on_notice and not c.strategy.saves,
         lambda c: f"checkpoint.on_notice=true: {c.set('strategy')} never saves, so there is nothing to save on the "
                   f"notice; use {c.instead('strategy', lambda s: s.saves)}"),
    Rule("a_job_to_resume", ("strategy", "resume"),
         "A resume in a new job, with a strategy whose state lived only in the ranks of the job that died.",
         lambda c: c.resume is not None and c.strategy.recovers_in_place and not c.strategy.saves,
         lambda c: f"resume={c.resume}: {c.set('strategy')} kept the state only in the ranks' memory, which died "
                   f"with the job; nothing to resume from"),
    Rule("a_shadow_dies_with_its_job", ("fault", "strategy"),
         "A fault that ends the whole job, with a strategy whose state lives in the job's own processes (a shadow "
         "beside the supervisor, nothing on disk): the job takes it with it.",
         lambda c: c.fault.ends_the_job and c.strategy.state_with_the_job,
         lambda c: f"{c.set('fault')}: ends the whole job, and {c.set('strategy')} keeps the state in the job's own "
                   f"processes (its shadow beside the supervisor), which end with it; use "
                   f"{c.instead('strategy', lambda s: s.saves and not s.state_with_the_job)}"),
    Rule("a_shadow_to_resume", ("strategy", "resume"),
         "A resume in a new job, with a strategy whose state lived in the processes of the job that died.",
         lambda c: c.resume is not None and c.strategy.state_with_the_job,
         lambda c: f"resume={c.resume}: {c.set('strategy')} kept the state in the processes of the job that died "
                   f"(its shadow), which wrote nothing to disk; nothing to resume from"),
    Rule("a_shadow_on_notice", ("strategy", "checkpoint.on_notice"),
         "A save on a preemption's notice, with a strategy whose state lives in the job's own processes (the save "
         "would end with the job).",
         lambda c: c.on_notice and c.strategy.state_with_the_job,
         lambda c: f"checkpoint.on_notice=true: {c.set('strategy')} keeps the state in the job's own processes (its "
                   f"shadow), which end with the job, so a save on the notice has nowhere to last; use "
                   f"{c.instead('strategy', lambda s: s.saves and not s.state_with_the_job)}"),
    Rule("dense_gradients_to_copy", ("workload", "strategy"),
         "A workload whose embedding gradients are sparse, with a strategy that copies every step's gradients dense.",
         lambda c: c.workload.sparse_gradients and c.strategy.dense_gradients,
         lambda c: f"{c.set('workload')}: its embedding gradients are sparse, and {c.set('strategy')} copies every "
                   f"step's reduced gradients to its shadow as dense tensors; use "
                   f"{c.instead('strategy', lambda s: s.saves and not s.dense_gradients)}"),
    Rule("survivors_restart_together", ("recovery", "strategy", "supervisor.launcher"),
         "A policy that restarts fewer ranks (the survivors), with a strategy that recovers in place or another "
         "launcher than our supervisor's elastic agent.",
         lambda c: c.recovery.resizes_world and (c.strategy.recovers_in_place or c.launcher != "local"),
         lambda c: f"{c.set('recovery')}: restarts fewer ranks through the local supervisor's elastic agent; needs "
                   f"supervisor.launcher=local and a strategy that restarts every rank (not {c.set('strategy')} "
                   f"with supervisor.launcher={c.launcher})"),
    Rule("replicas_split_the_world", ("parallel", "world_size"),
         "A parallelism that replicates shards, on a world that its replicas of at least 2 shards do not fill.",
         lambda c: unsplit(c, c.world_size) is not None,
         lambda c: str(unsplit(c, c.world_size))),
    Rule("sparse_gradients_whole", ("parallel", "workload"),
         "Sharded state, with a workload whose gradients are sparse (FSDP's reduce-scatter cannot shard them).",
         lambda c: c.parallel.shards_state and c.workload.sparse_gradients,
         lambda c: f"{c.set('parallel')}: the workload's embeddings have sparse gradients, which FSDP's "
                   f"reduce-scatter cannot shard; use {c.instead('parallel')}"),
    Rule("touched_rows_to_save", ("workload", "strategy"),
         "A strategy that saves the embedding rows sparse gradients touched, with a workload that has no such table.",
         lambda c: c.strategy.saves_touched_rows and not c.workload.sparse_gradients,
         lambda c: f"{c.set('workload')}: {c.set('strategy')} saves, between full checkpoints, the embedding rows "
                   f"that sparse gradients touched, and {c.names['workload']} has no embedding table with sparse "
                   f"gradients; use {c.instead('workload', lambda w: w.sparse_gradients)} or "
                   f"{c.instead('strategy', lambda s: s.saves and not s.saves_touched_rows)}"),
    Rule("sharded_state_saved", ("parallel", "strategy"),
         "Sharded state, with a strategy that checkpoints and cannot save it.",
         lambda c: c.parallel.shards_state and c.strategy.saves and not c.strategy.shards_state,
         lambda c: f"{c.set('parallel')}: {c.set('strategy')} does not save sharded state "
                   f"({c.strategy.sharded_refusal}); use {c.instead('strategy', saving)}"),
    Rule("sharded_state_healed", ("parallel", "strategy"),
         "Sharded state, with a strategy that recovers in place with whole-model state.",
         lambda c: c.parallel.shards_state and c.strategy.recovers_in_place and not c.strategy.shards_state,
         lambda c: f"{c.set('parallel')}: {c.set('strategy')} recovers in place with whole-model state "
                   f"({c.strategy.sharded_refusal}); use {c.instead('parallel')}"),
    Rule("a_replica_to_heal_from", ("parallel", "strategy"),
         "Each shard held once, with a strategy that takes a lost rank's state from a replica.",
         lambda c: c.parallel.shards_state and c.strategy.recovers_in_place and (c.parallel.replicas or 1) < 2,
         lambda c: f"{c.set('parallel')}: {c.set('strategy')} takes a lost rank's state from a replica, and "
                   f"{c.names['parallel']} holds each shard once; use {c.instead('parallel')}, or a strategy that "
                   f"checkpoints"),
    Rule("a_twin_to_heal_from", ("world_size", "parallel", "strategy"),
         "One rank alone, with a strategy that takes a lost rank's state from a twin replica.",
         lambda c: c.strategy.recovers_in_place and not c.parallel.shards_state and c.world_size < 2,
         lambda c: f"world_size={c.world_size}: {c.set('strategy')} takes a lost rank's state from a twin replica, "
                   f"and one rank has none; use world_size >= 2, or {c.instead('strategy', saving)}"),
    Rule("a_replica_to_write_from", ("parallel", "strategy"),
         "Each shard held once, with a strategy that writes a failed rank's state at the failure from a surviving "
         "replica of it.",
         lambda c: c.strategy.writes_at_failure and c.parallel.shards_state and (c.parallel.replicas or 1) < 2,
         lambda c: f"{c.set('parallel')}: {c.set('strategy')} writes a failed rank's state at the failure from a "
                   f"surviving replica of it, and {c.names['parallel']} holds each shard once; use "
                   f"{c.instead('parallel')}"),
    Rule("into_ddp", ("parallel", "fault"),
         "Sharded state, with a fault that reaches into DDP's module and reduction.",
         lambda c: c.parallel.shards_state and c.fault.reaches_into_ddp,
         lambda c: f"{c.set('parallel')}: {c.set('fault')} reaches into DDP's module and reduction, which a sharded "
                   f"model has not; use {c.instead('parallel')}"),
    Rule("comparing_shards", ("parallel", "detector"),
         "Sharded state, with a detector that compares the ranks' states (they are different shards).",
         lambda c: c.parallel.shards_state and bool(comparing(c)),
         lambda c: f"{c.set('parallel')}: detector={comparing(c)} compares the ranks' states, which are different "
                   f"shards here; leave it out of the detector list"),
    Rule("enough_replica_groups", ("strategy", "parallel", "world_size"),
         "A strategy whose steps commit with a quorum of replica groups, asking for more groups than the run has "
         "(each rank a group; under hsdp each replica of the shards).",
         lambda c: c.strategy.min_replica_groups is not None and c.strategy.min_replica_groups > replica_groups(c),
         lambda c: f"{c.said('strategy', 'min_replica_groups')}: at most the {replica_groups(c)} replica groups of "
                   f"{c.set('parallel')} "
                   f"({c.said('parallel', 'replicas') if c.parallel.shards_state else f'world_size={c.world_size}'})"),
    Rule("grown_back_from_dcp", ("recovery", "strategy"),
         "A policy that goes back to the full world, with a strategy that does not checkpoint sharded state that DCP "
         "reshards on load.",
         lambda c: c.recovery.grows_back and not (c.strategy.saves and c.strategy.shards_state
                                                  and c.strategy.reshards_on_load),
         lambda c: f"{c.set('recovery')}: goes back to the full world from a checkpoint that DCP reshards on load, "
                   f"which {c.set('strategy')} does not load from; use {c.instead('strategy', saving)}"),
    Rule("shrunk_from_a_resharded_load", ("recovery", "parallel", "strategy"),
         "A policy that restarts fewer ranks, with sharded state that the strategy's load does not reshard: its "
         "snapshots hold each old rank's shards, which a survivor of another number would load wrongly, silently.",
         lambda c: c.recovery.resizes_world and c.parallel.shards_state and not c.strategy.reshards_on_load,
         lambda c: f"{c.set('recovery')}: loads the checkpoint resharded to fewer ranks, which {c.set('strategy')} "
                   f"cannot under {c.set('parallel')} (its load holds each old rank's shard); use "
                   f"{c.instead('strategy', saving)}"),
    Rule("a_world_to_grow_back", ("recovery", "world_size"),
         "A policy that grows back, where the node loss would leave fewer ranks than its smallest world.",
         lambda c: c.recovery.grows_back and survivors(c) < c.recovery.min_world_size,
         lambda c: f"recovery.min_world_size={c.recovery.min_world_size}: the node loss would leave {survivors(c)} "
                   f"ranks, fewer than that, so the world never shrinks and there is nothing to grow back; lower it "
                   f"or use recovery=restart"),
    Rule("survivors_hold_the_replicas", ("recovery", "parallel", "world_size"),
         "A policy that trains on the survivors until it grows back, where they cannot hold the parallelism's "
         "replicas of the shards.",
         lambda c: c.recovery.grows_back and unsplit(c, survivors(c)) is not None,
         lambda c: f"{c.set('recovery')}: the survivors of the node loss are {survivors(c)} ranks, where "
                   f"{unsplit(c, survivors(c))}"),
    Rule("rank_parts_in_one_world", ("recovery", "train.rng", "train.data"),
         "A policy that changes the world size, with a loop whose state has per-rank parts (its RNG streams, a data "
         "loader's position): no rank of the new world owns them.",
         lambda c: c.recovery.resizes_world and (c.rng == "carried" or c.data == "loader"),
         lambda c: f"{c.set('recovery')}: changes the world size, and train.rng={c.rng} train.data={c.data} keep "
                   f"per-rank state that no rank of the new world owns; use train=replayable or "
                   f"{c.instead('recovery', lambda p: not p.resizes_world)}"),
    Rule("scaler_steps_the_optimizer", ("strategy", "train.precision"),
         "fp16's gradient scaler, with a strategy that applies the optimizer step itself, without the scaler.",
         lambda c: c.precision == "fp16" and c.strategy.owns_step,
         lambda c: f"train.precision=fp16: {c.set('strategy')} applies the optimizer step itself, without the "
                   f"gradient scaler; use train.precision=bf16 or fp32"),
    Rule("autocast_dense", ("workload", "train.precision"),
         "Autocast, with a workload whose embedding gradients are sparse (autocast does not cover them).",
         lambda c: c.precision != "fp32" and c.workload.sparse_gradients,
         lambda c: f"train.precision={c.precision}: {c.set('workload')} has sparse embedding gradients, which "
                   f"autocast does not cover; use train.precision=fp32"),
    Rule("clip_dense", ("workload", "train.clip_norm"),
         "Gradient clipping, with a workload whose embedding gradients are sparse (torch's clip_grad_norm_ cannot "
         "norm them).",
         lambda c: c.clip_norm is not None and c.workload.sparse_gradients,
         lambda c: f"train.clip_norm={c.clip_norm}: {c.set('workload')} has sparse embedding gradients, which "
                   f"torch.nn.utils.clip_grad_norm_ cannot norm; use train.clip_norm=null"),
    Rule("one_lr_schedule", ("workload", "train.lr_schedule"),
         "A workload that brings its own LR scheduler, with the loop's schedule too: the LR would be set twice.",
         lambda c: c.workload.schedules_lr and c.lr_schedule != "constant",
         lambda c: f"train.lr_schedule={c.lr_schedule}: {c.set('workload')} brings its own LR scheduler "
                   f"(workload.scheduler); set train.lr_schedule=constant, or leave workload.scheduler out"),
    Rule("tokens_to_read", ("workload", "train.data"),
         "The token file's loader, with a workload that does not train on token windows.",
         lambda c: c.data == "loader" and not c.workload.reads_tokens,
         lambda c: f"train.data=loader: {c.set('workload')} does not train on token windows; use train.data="
                   f"synthetic or {c.instead('workload', lambda w: w.reads_tokens)}"),
]
