"""What each role declares about itself: its name (``Named``: its option's) and a frozen capability record per role
kind, a class attribute (``caps``).

The table of rules (``resilience.compat``) reads these records, never the roles' code, to say which roles go
together; the report, the hints in the refusals and ``docs/compatibility.md`` read them over the options in
``conf/`` without building a role. A capability that depends on one of the option's settings is declared with the
record: ``when`` changes fields where a setting has a value (``"executor=process"``), ``of_setting`` takes a field's
value from a setting (``replicas`` from ``replicate``); ``under(**settings)`` gives the record for those settings, and
a role whose record depends on its settings sets ``self.caps = self.caps.under(...)`` where it is built.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from dataclasses import dataclass, field, replace
from typing import Any, Self

import yaml


@dataclass(frozen=True, kw_only=True)
class Caps:
    """The base of every record: the settings that change it."""

    when: Mapping[str, Mapping[str, Any]] = field(default_factory=dict, compare=False, repr=False)
    of_setting: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    def under(self, **settings: Any) -> Self:
        """The record for an option with ``settings`` (those that ``when`` and ``of_setting`` do not name are
        ignored; a setting left out keeps the declared value)."""
        changes = {name: settings[key] for name, key in self.of_setting.items() if settings.get(key) is not None}
        for case, fields in self.when.items():
            key, _, value = case.partition("=")
            if key in settings and str(settings[key]) == value:
                changes.update(fields)
        return replace(self, **changes)


@dataclass(frozen=True, kw_only=True)
class StrategyCaps(Caps):
    family: str | None = None  # the checkpointing technique it implements (the report's families); None: no technique
    saves: bool = True  # False: it never writes a checkpoint
    # True: survivors of a failure keep running and recover in place; the supervisor replaces only the failed ranks.
    recovers_in_place: bool = False
    # A replacement's model is built uninitialised: the strategy overwrites every byte of it (a replica's heal).
    overwrites_replacement_state: bool = False
    keeps_world_group: bool = True  # False: ranks train in groups of their own, or a group shrinks while one is replaced
    writes_through_checkpoint_fs: bool = False  # every checkpoint file goes through DCP's file-system layer (ckpt_fs)
    shards_state: bool = False  # saves and loads a sharded model's state (each rank its shards)
    sharded_refusal: str = "it keeps whole-model copies"  # why not, in one clause, where ``shards_state`` is False
    reshards_on_load: bool = False  # every load is DCP's read of the checkpoint files: it fits any world size
    runs_in_supervisor: bool = False  # runs part of itself in the local supervisor across rank restarts
    min_replica_groups: int | None = None  # the fewest replica groups a step commits with (replicas across groups)
    owns_step: bool = False  # it applies the optimizer step itself (torchft's commit vote), not the training loop
    # its recovery state lives in the job's own processes (strategy=shadow's shadow beside our supervisor), not on
    # disk: a new job (resume=, after a preemption's notice or a fault that ends the job) finds none of it
    state_with_the_job: bool = False
    dense_gradients: bool = False  # it copies every step's reduced gradients as dense tensors (not sparse ones)
    # it writes the state from a surviving replica when a failure is detected (just-in-time), never on an interval
    writes_at_failure: bool = False
    # it saves, between full checkpoints, only the embedding rows that sparse gradients touched (Check-N-Run): it
    # needs a workload with such tables (``WorkloadCaps.sparse_gradients``)
    saves_touched_rows: bool = False
    # it saves and loads each pipeline stage's state (``parallel=pp``; checked so far for sync alone)
    saves_stages: bool = False
    # only a lost pipeline stage restarts: from its own checkpoint, replaying the steps since from its neighbours'
    # logs of what they sent it (Swift's logging); the other stages keep their state (``parallel=pp``)
    replays_stage: bool = False
    # a lost pipeline stage is healed from the same stage of another pipeline, its twin (``parallel=pp_dp``); the
    # other ranks keep their processes and state
    heals_stages: bool = False
    # why a restore from its checkpoints is not the saved state bit for bit, by design (quantized rows); None: it is.
    # Its loads then say so (``ckpt_loaded_inexact``), and a run that restored one is not held to the bit-exact check
    # against the fault-free run (``result.json``'s ``bit_exact``: "not by design: ..."); a run without a restore is.
    inexact_restore: str | None = None


@dataclass(frozen=True, kw_only=True)
class ParallelCaps(Caps):
    shards_state: bool = False  # each rank holds only a shard of the training state
    replicas: int | None = None  # how many ranks hold each shard (None: not sharded, every rank holds all of it)
    stages: int = 1  # pipeline stages the model is cut into, one per rank (1: not pipelined)
    pipelines: int = 1  # copies of the pipeline, data parallel across them: world_size = stages x pipelines


@dataclass(frozen=True, kw_only=True)
class InjectorCaps(Caps):
    acts_on_checkpoint_fs: bool = False  # the fault reaches a rank only through DCP's file-system layer (ckpt_fs)
    reaches_into_ddp: bool = False  # it hooks DDP's reduction or reaches into DDP's module
    needs_checkpoint: str | None = None  # the setting with which it acts on a checkpoint (None: it does not)
    returns_after_s: float | None = None  # the lost node is back this long after the loss (None: never)
    ends_the_job: bool = False  # it kills our supervisor with every rank: the run goes on only with resume=
    hands_over: bool = False  # it announces a node's loss ahead: the ranks listen and move its ranks to spares
    strikes_replay: bool = False  # it strikes during a lost stage's replay (fault.phase=during_replay)
    # our supervisor strikes it on the rank's processes of each attempt, restarting ones too (fault.clock=wall)
    strikes_from_supervisor: bool = False


@dataclass(frozen=True, kw_only=True)
class DetectorCaps(Caps):
    compares_ranks: bool = False  # collectives across the world's ranks (every rank in the rank's group)
    needs_grad_norm: bool = False  # the rank computes the reduced gradients' norm for it
    runs_in_supervisor: bool = False  # runs part of itself in the supervisor process for the whole run
    served_by: str | None = None  # the launcher that runs that part itself (``supervisor.launcher``)


@dataclass(frozen=True, kw_only=True)
class PolicyCaps(Caps):
    restarts_in_process: bool = False  # trains again in the same processes after a failure
    rolls_back: bool = False  # after silent corruption, reloads a checkpoint taken before it
    resizes_world: bool = False  # restarts fewer ranks after a node is lost (the survivors)
    grows_back: bool = False  # and the full world again once the node has returned
    min_world_size: int = 1  # below this many survivors the world stays


@dataclass(frozen=True, kw_only=True)
class WorkloadCaps(Caps):
    sparse_gradients: bool = False  # some parameters have sparse gradients (embedding tables with sparse=True)
    reads_tokens: bool = False  # it trains on token windows of a text file (train.data=loader)
    schedules_lr: bool = False  # it brings its own LR scheduler (workload.scheduler), in place of train.lr_schedule
    splits_into_stages: bool = False  # its model cuts into pipeline stages (``Workload.pipeline_stage``)


# A role's name is its option's name: written once, as the YAML file's and the module's name.
class Named:
    """``conf/strategy/sync.yaml`` builds a class from ``resilience/strategies/sync.py``: the name is ``sync``.
    A module whose name cannot be the option's (a Python keyword, ``async``) sets ``option``."""

    option: str | None = None

    @property
    def name(self) -> str:
        return self.option or type(self).__module__.rpartition(".")[2]


def base_option(group_dir: Path, option: str) -> str:
    """The option that ``option`` is a variant of, or ``option`` itself. A variant is a YAML whose defaults list
    names another option of its group (``dcp_async_staged``: ``dcp_async`` with other settings): the same class,
    a row of its own in the report."""
    path = Path(group_dir) / f"{option}.yaml"
    spec = yaml.safe_load(path.read_text()) if path.is_file() else None
    bases = [d for d in (spec or {}).get("defaults", []) if isinstance(d, str) and d != "_self_"]
    return base_option(group_dir, bases[0]) if bases else option
