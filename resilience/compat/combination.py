"""One run's roles as the rules see them (``Combination``), the defaults' combination, and every combination of
the options in conf/ that a rule reads."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any

from resilience.caps import Caps, DetectorCaps, InjectorCaps, ParallelCaps, PolicyCaps, StrategyCaps, WorkloadCaps
from resilience.compat.options import GROUPS, listing, Option, options, run_settings
from resilience.settings.choices import Data, Launcher, LrSchedule, Precision, Rng

# The run's settings that rules read, and the values the table is rendered and tested over.
RUN = {"world_size": (1, 2, 3, 4), "supervisor.launcher": tuple(launcher.value for launcher in Launcher),
       "supervisor.spares": (0, 1), "train.rng": tuple(m.value for m in Rng),
       "train.precision": tuple(m.value for m in Precision), "train.data": tuple(m.value for m in Data),
       "train.lr_schedule": tuple(m.value for m in LrSchedule), "checkpoint.on_notice": (False, True),
       "train.clip_norm": (None, 1.0), "train.grad_accum": (1, 2)}
_FIELD = {"world_size": "world_size", "supervisor.launcher": "launcher", "supervisor.spares": "spares",
          "train.rng": "rng", "train.precision": "precision", "train.data": "data", "train.lr_schedule": "lr_schedule",
          "checkpoint.on_notice": "on_notice", "train.clip_norm": "clip_norm", "train.grad_accum": "grad_accum"}

Judge = Callable[["Combination"], "str | None"]
# Who judges an alternative for a hint: the table's ``refusal`` (resilience.compat), over its rows as they are when
# it is asked, a plug-in's too. The package hands it over (``judged_by``): the rows speak of combinations, so this
# module, beneath them, cannot import the table.
_judge: Judge | None = None


def judged_by(refusal: Judge) -> None:
    global _judge
    _judge = refusal


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
    rng: str = Rng.reseed.value  # the training loop's (train.*): its RNG streams, precision and data
    precision: str = Precision.fp32.value
    data: str = Data.synthetic.value
    lr_schedule: str = LrSchedule.constant.value
    on_notice: bool = False  # checkpoint.on_notice: save on a preemption's SIGTERM
    clip_norm: float | None = None  # train.clip_norm: the gradients' global norm clipped to it (None: no clipping)
    grad_accum: int = 1  # train.grad_accum: micro-batches per optimizer step
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
        assert _judge is not None, "resilience.compat hands its refusal over when it is imported"
        alone = replace(self, hinted=False)
        fine = [o for o in options(group).values() if keep(o.caps) and _judge(alone.choosing(o)) is None]
        return listing(group, fine, options(group).values()) or f"another {group}"


@cache
def defaults() -> Combination:
    """The combination of conf/config.yaml's defaults (the other roles of a documented refusal)."""
    spec = run_settings()
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
    for picked in itertools.product(*choices):
        c = defaults()
        for key, value in zip(keys, picked):
            c = c.choosing(value) if key in GROUPS else replace(c, **{_FIELD[key]: value})
        yield dict(zip(keys, picked)), c
