"""Which roles go together: one table of rules over what the roles declare (``caps``, ``resilience.caps``).

A rule is a row: a condition on one ``Combination`` (each role's option name and capabilities, and the run's
settings) and the refusal it says, one line naming the settings and what is allowed. ``build_roles`` runs the
table before anything starts: the first refusal is a ``ValueError`` (exit 2 from the command line). A plug-in's
module appends rows of its own to ``RULES``, so that it brings them with it. A hint in a refusal ("use
strategy=...") is computed from the table: the options in ``conf/`` that it allows in the refused one's place. The
report's notes and ``docs/compatibility.md`` (``python -m resilience.compat``) are rendered from it too.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields, replace
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

from resilience.caps import base_option, Caps, DetectorCaps, InjectorCaps, ParallelCaps, PolicyCaps, StrategyCaps, WorkloadCaps
from resilience.settings.schema import Launcher

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
GROUPS = ("workload", "parallel", "strategy", "fault", "recovery", "detector")  # the role groups of conf/
# The run's settings that rules read, and the values the table is rendered and tested over.
RUN = {"world_size": (1, 2, 3, 4), "supervisor.launcher": tuple(launcher.value for launcher in Launcher),
       "supervisor.spares": (0, 1)}


@dataclass(frozen=True)
class Option:
    """One option of a group in ``conf/``: its YAML's name, its role's name and what its class declares for it."""

    group: str
    option: str  # dcp_async_process
    name: str  # the role's name, the option it is a variant of: dcp_async
    settings: Mapping[str, Any]
    caps: Caps


@dataclass(frozen=True)
class Combination:
    """One run's roles as the rules see them: each role's option name and capabilities, and the run's settings."""

    names: Mapping[str, str]  # group -> the option's name as the refusals give it
    workload: WorkloadCaps
    parallel: ParallelCaps
    strategy: StrategyCaps
    fault: InjectorCaps
    recovery: PolicyCaps
    detectors: Mapping[str, DetectorCaps] = field(default_factory=dict)
    world_size: int = 2
    launcher: str = "local"
    spares: int = 0
    ranks_per_node: int = 1
    resume: str | None = None  # resume=: the run directory whose job this one continues
    hinted: bool = True  # False while the table judges an alternative for a hint (no hints within hints)

    def caps(self, group: str) -> Caps:
        return {"workload": self.workload, "parallel": self.parallel, "strategy": self.strategy,
                "fault": self.fault, "recovery": self.recovery}[group]

    def set(self, group: str) -> str:
        """The group's setting as the command line writes it: ``strategy=dcp_async``."""
        return f"{group}={self.names[group]}"

    def said(self, group: str, name: str) -> str:
        """The setting behind the capability ``name`` (``parallel.replicate=2``), or the group's (``parallel=fsdp``)."""
        caps = self.caps(group)
        key = caps.of_setting.get(name)
        return f"{group}.{key}={vars(caps)[name]}" if key else self.set(group)

    def choosing(self, option: Option) -> Combination:
        """This combination with ``option`` in its group's place."""
        if option.group == "detector":
            return replace(self, detectors={option.name: option.caps}, names={**self.names, "detector": option.name})
        return replace(self, **{option.group: option.caps}, names={**self.names, option.group: option.name})

    def instead(self, group: str, keep: Callable[[Any], bool] = lambda caps: True) -> str:
        """The options of ``group`` in conf/ that the whole table allows here in this one's place (and whose
        capabilities ``keep`` holds): ``strategy=async, strategy=dcp_async (executor=thread) or strategy=sync``."""
        if not self.hinted:
            return f"another {group}"
        alone = replace(self, hinted=False)
        fine = [o for o in options(group).values() if keep(o.caps) and refusal(alone.choosing(o)) is None]
        return listing(group, fine, options(group).values()) or f"another {group}"


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


def refusal(c: Combination) -> str | None:
    """The first refusal of ``c`` in the table's order, or None: the roles go together."""
    return next((line for r in RULES if (line := r.check(c)) is not None), None)


def check(c: Combination) -> None:
    """Raise ``ValueError`` with the one-line refusal when the roles of ``c`` do not go together."""
    line = refusal(c)
    if line is not None:
        raise ValueError(line)


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
         lambda c: c.strategy.recovers_in_place and c.recovery.restarts_in_process,
         lambda c: f"{c.set('recovery')}: restarts every rank's training in its process; {c.set('strategy')} "
                   f"recovers in place itself; use recovery=restart"),
    Rule("nothing_to_roll_back_to", ("strategy", "recovery"),
         "A strategy that recovers in place (it keeps no checkpoint), with a policy that rolls back to one.",
         lambda c: c.strategy.recovers_in_place and c.recovery.rolls_back,
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
    Rule("nothing_outlives_the_job", ("fault", "strategy"),
         "A fault that ends the whole job, with a strategy whose state lives only in the ranks (nothing to resume).",
         lambda c: c.fault.ends_the_job and c.strategy.recovers_in_place,
         lambda c: f"{c.set('fault')}: ends the whole job, and {c.set('strategy')} keeps the state only in the "
                   f"ranks' memory, which the job takes with it; use "
                   f"{c.instead('strategy', lambda s: not s.recovers_in_place)}"),
    Rule("a_job_to_resume", ("strategy", "resume"),
         "A resume in a new job, with a strategy whose state lived only in the ranks of the job that died.",
         lambda c: c.resume is not None and c.strategy.recovers_in_place,
         lambda c: f"resume={c.resume}: {c.set('strategy')} kept the state only in the ranks' memory, which died "
                   f"with the job; nothing to resume from"),
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
]


# ---- the options in conf/, and what the table says of them ----

def _settings(group: str, option: str) -> dict[str, Any]:
    """An option's settings as written, a variant's over those of the option it names in its defaults list."""
    spec = yaml.safe_load((CONF_DIR / group / f"{option}.yaml").read_text()) or {}
    merged: dict[str, Any] = {}
    for base in [d for d in spec.pop("defaults", []) if isinstance(d, str) and d != "_self_"]:
        merged.update(_settings(group, base))
    return {**merged, **spec}


@cache
def _run_settings() -> dict[str, Any]:
    """The top-level settings of conf/config.yaml, which the options' interpolations refer to."""
    spec = yaml.safe_load((CONF_DIR / "config.yaml").read_text())
    return {k: v for k, v in spec.items() if k != "defaults"}


def _resolved(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` with their interpolations resolved against the run's defaults (those that cannot be stay)."""
    node = OmegaConf.create({**_run_settings(), "_option": settings})
    out = {}
    for key in settings:
        try:
            value = OmegaConf.select(node, f"_option.{key}", throw_on_resolution_failure=True)
        except Exception:  # an interpolation into another group (fault.*): it keeps what is written
            value = settings[key]
        out[key] = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
    return out


@cache
def options(group: str) -> dict[str, Option]:
    """Every option of ``group`` in conf/, with what its class declares under its settings (no role is built)."""
    from hydra.utils import get_class

    found = {}
    for path in sorted((CONF_DIR / group).glob("*.yaml")):
        settings = _resolved(_settings(group, path.stem))
        role = get_class(settings["_target_"])
        found[path.stem] = Option(group, path.stem, base_option(CONF_DIR / group, path.stem), settings,
                                  role.caps.under(**settings))
    return found


@cache
def defaults() -> Combination:
    """The combination of conf/config.yaml's defaults (the other roles of a documented refusal)."""
    spec = yaml.safe_load((CONF_DIR / "config.yaml").read_text())
    chosen = {k: v for d in spec["defaults"] if isinstance(d, dict) for k, v in d.items()}
    picked = {g: options(g)[chosen[g]] for g in GROUPS if g != "detector"}
    detectors = {options("detector")[d].name: options("detector")[d].caps for d in chosen["detector"]}
    return Combination(names={g: o.name for g, o in picked.items()}, detectors=detectors,
                       **{g: o.caps for g, o in picked.items()}, world_size=int(spec["world_size"]),
                       launcher=str(spec["supervisor"]["launcher"]), spares=int(spec["supervisor"]["spares"]),
                       ranks_per_node=int(spec.get("ranks_per_node", 1)))


def combinations(reads: tuple[str, ...]) -> Iterator[tuple[dict[str, Any], Combination]]:
    """Every combination of the options (and run settings' values, ``RUN``) that ``reads`` names, the rest at the
    defaults: each with what it chose."""
    keys = [k for k in reads if k in GROUPS or k in RUN]
    choices = [list(options(k).values()) if k in GROUPS else list(RUN[k]) for k in keys]
    run = {"world_size": "world_size", "supervisor.launcher": "launcher", "supervisor.spares": "spares"}
    for picked in itertools.product(*choices):
        c = defaults()
        for key, value in zip(keys, picked):
            c = c.choosing(value) if key in GROUPS else replace(c, **{run[key]: value})
        yield dict(zip(keys, picked)), c


def listing(group: str, chosen: list[Option], among: Any) -> str:
    """``chosen`` as a refusal names them: ``strategy=a, strategy=b (executor=thread) or strategy=c``; a role of
    which only some options are chosen is named with the setting that tells them apart."""
    by_name: dict[str, list[Option]] = {}
    for o in among:
        by_name.setdefault(o.name, []).append(o)
    said = []
    for name, variants in by_name.items():
        mine = [o for o in variants if o in chosen]
        if not mine:
            continue
        others = [o for o in variants if o not in chosen]
        said.append(f"{group}={name}" + (f" ({_apart(mine, others)})" if others else ""))
    return " or ".join([", ".join(said[:-1]), said[-1]]) if len(said) > 1 else "".join(said)


def _apart(mine: list[Option], others: list[Option]) -> str:
    """The setting whose values in ``mine`` no option of ``others`` has (``executor=thread``), else their names."""
    for key in mine[0].settings:
        values = {str(o.settings.get(key)) for o in mine}
        if len(values) == 1 and not values & {str(o.settings.get(key)) for o in others}:
            return f"{key}={values.pop()}"
    return ", ".join(o.option for o in mine)


ANY = None  # in a line of ``refused``: a choice that does not matter (every value of it is refused)


def refused(r: Rule) -> str:
    """What ``r`` refuses among the options in conf/ (the rest at the defaults), as few lines as cover it:
    ``fault=slow_disk: strategy=a or strategy=b``, a choice that does not matter left out; empty where it refuses
    none of them."""
    keys = [k for k in r.reads if k in GROUPS or k in RUN]
    values = [[o.option for o in options(k).values()] if k in GROUPS else list(RUN[k]) for k in keys]
    rows = [tuple(v.option if isinstance(v, Option) else v for v in picked.values())
            for picked, c in combinations(r.reads) if r.when(c)]
    # each refused row widened to the most choices that do not matter (every value of them refused too)
    wider = sorted((set(w) for n in range(len(keys), -1, -1) for w in itertools.combinations(range(len(keys)), n)),
                   key=len, reverse=True)
    lines: list[tuple[Any, ...]] = []
    known = set(rows)
    for row in rows:
        line = next(tuple(ANY if i in w else (v,) for i, v in enumerate(row)) for w in wider
                    if all(x in known for x in itertools.product(*[values[i] if i in w else [v]
                                                                  for i, v in enumerate(row)])))
        if line not in lines:
            lines.append(line)
    for i in reversed(range(len(keys))):  # lines alike but for one choice become one, last choice first
        merged: dict[tuple[Any, ...], list[Any]] = {}
        for line in lines:
            rest = line[:i] + (line[i] is ANY,) + line[i + 1:]
            merged.setdefault(rest, []).extend(line[i] if line[i] is not ANY else [])
        lines = [rest[:i] + (tuple(vs) if vs else ANY,) + rest[i + 1:] for rest, vs in merged.items()]
    said = []
    for line in lines:
        parts = [_choices(k, vs) for k, vs in zip(keys, line) if vs is not ANY]
        said.append(f"{', '.join(parts[:-1])}: {parts[-1]}" if len(parts) > 1 else "".join(parts))
    return "; ".join(said)


def _choices(key: str, values: tuple[Any, ...]) -> str:
    if key in GROUPS:
        return listing(key, [options(key)[v] for v in values], options(key).values())
    return " or ".join(f"{key}={v}" for v in values)


def render() -> str:
    """``docs/compatibility.md``: the table, what each rule refuses among the options, what each option declares."""
    d = defaults()
    lines = ["# Which roles go together", "",
             "<!-- Generated from the table in resilience/compat.py by `python -m resilience.compat > "
             "docs/compatibility.md`; tests/test_compat.py checks that it is up to date. -->", "",
             "The command refuses a combination of roles that cannot run together before anything starts, in one "
             "line naming the settings and what is allowed (exit 2). Each rule below reads only what the roles "
             "declare (`caps`, `resilience/caps.py`); the rules apply in this order, the first refusal wins. "
             "The last column is what each rule refuses among the options in `conf/`, the other roles at their "
             f"defaults ({', '.join(d.set(g) for g in GROUPS if g != 'detector')}, "
             f"world_size={d.world_size}, supervisor.launcher={d.launcher}); some rules refuse only settings "
             "other than the options' own (`-`).", "",
             "| rule | reads | refuses | among the options |", "|---|---|---|---|"]
    for r in RULES:
        lines.append(f"| `{r.name}` | {', '.join(r.reads)} | {r.doc} | {refused(r) or '-'} |")
    lines += ["", "## What each option declares", "",
              "The capabilities that differ from their record's defaults, under the option's settings.", ""]
    for group in GROUPS:
        lines += [f"### {group}", "", "| option | declares |", "|---|---|"]
        for o in options(group).values():
            mine, plain = vars(o.caps), vars(type(o.caps)())
            declared = [f.name if mine[f.name] is True else f"{f.name}={mine[f.name]}" for f in fields(o.caps)
                        if f.compare and mine[f.name] != plain[f.name]]
            lines.append(f"| {o.option} | {', '.join(declared) or '-'} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(render())
