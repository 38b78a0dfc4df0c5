"""The schema of an experiment's top-level settings: a Hydra structured config, ``base_config`` in the ConfigStore.

``conf/config.yaml`` names it first in its defaults list (Hydra's "Structured Config schema" pattern), so every
composition is checked against it: a setting's type (``steps=abc``, ``timeouts.collective_s=true``) and a choice
(``device``, ``backend``, ``supervisor.launcher`` are enums) fail while Hydra composes, before anything is created.
OmegaConf has no ranges, so each field's bound lives beside its type (``metadata``) and ``check_ranges`` applies it
once interpolations are resolved. ``explain`` turns OmegaConf's multi-line ValidationError into the project's one
line naming the setting and what is allowed. The option groups (workload, strategy, ...) stay ``Any``: each role
validates its own settings where it is built.
"""

import re
from dataclasses import dataclass, field, fields, is_dataclass
from enum import Enum
from typing import Any, Iterator, Optional, Union

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import ValidationError

from resilience.settings.checks import require_choice, require_int, require_number
from resilience.settings.choices import Data, Launcher, LrSchedule, Precision, Rng  # noqa: F401 - the schema's too

SCHEMA_NAME = "base_config"  # what conf/config.yaml's defaults list names
Number = Union[int, float]  # not float: an int stays an int, so the resolved config reads as written


def at_least(bound: int | float, default: Any) -> Any:
    return field(default=default, metadata={"at_least": bound})


def above(bound: float, default: Any) -> Any:
    return field(default=default, metadata={"above": bound})


class Device(str, Enum):  # str: a value compares equal to its name, as the YAML's string did
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class Backend(str, Enum):
    auto = "auto"
    gloo = "gloo"
    nccl = "nccl"


class ProcessStart(str, Enum):  # how a rank process starts: forked from the zygote, or a fresh interpreter
    preloaded = "preloaded"
    cold = "cold"


@dataclass
class AutoInterval:  # checkpoint.every=auto's settings (resilience.strategies.interval checks the rule and M)
    rule: str = "optimal"
    mtbf_s: Optional[float] = above(0, None)
    mtbf_steps: Optional[float] = above(0, None)
    budget: Optional[float] = above(0, None)
    first: int = at_least(1, 5)
    calibration: int = at_least(1, 2)
    max_every: int = at_least(1, 10000)


@dataclass
class Checkpoint:
    every: Any = 5  # an integer >= 1 | auto (checked where the interval is built: resilience.strategies.interval)
    auto: AutoInterval = field(default_factory=AutoInterval)
    keep: int = at_least(1, 2)
    dir: Optional[str] = None
    keep_after_run: Any = "auto"  # auto | true | false: OmegaConf has no Literal type (checked in config.resolve)
    on_notice: bool = False  # save on a preemption's SIGTERM (resilience.rank.notice)


@dataclass
class Timeouts:
    collective_s: Number = above(0, 60)
    heartbeat_s: Number = above(0, 30)
    ckpt_io_s: Number = above(0, 600)
    shutdown_s: Number = above(0, 5)


@dataclass
class Supervisor:
    launcher: Launcher = Launcher.local
    first_start: ProcessStart = ProcessStart.preloaded
    restarts: ProcessStart = ProcessStart.cold
    monitor_interval_s: Number = above(0, 0.1)
    spares: int = at_least(0, 0)
    max_local_ranks: Any = "auto"  # auto | an integer >= 1 (checked where the local launcher's limit is applied)
    memory_sample_s: Number = above(0, 0.5)


@dataclass
class Validity:
    max_other_cpu: Number = at_least(0, 0.10)
    max_steal: Number = at_least(0, 0.05)
    max_memory_pressure: Number = at_least(0, 10)
    sample_s: Number = above(0, 1.0)


class ReferenceCheck(str, Enum):
    auto = "auto"
    run = "run"
    none = "none"


@dataclass
class Reference:
    check: ReferenceCheck = ReferenceCheck.auto
    index: str = "results/references"


@dataclass
class Loader:
    samples: int = at_least(1, 256)
    workers: int = at_least(0, 2)
    shuffle: bool = True
    dir: str = "data"


@dataclass
class Train:
    """The training loop (conf/train/*.yaml): resilience.rank.loop builds the job's parts from it."""

    rng: Rng = Rng.reseed
    lr_schedule: LrSchedule = LrSchedule.constant
    warmup_steps: int = at_least(0, 0)
    min_lr_ratio: Number = at_least(0, 0.1)
    grad_accum: int = at_least(1, 1)
    clip_norm: Optional[float] = field(default=None, metadata={"above": 0})  # null: no clipping
    precision: Precision = Precision.fp32
    fp16_init_scale: Number = above(0, 65536.0)
    data: Data = Data.synthetic
    loader: Loader = field(default_factory=Loader)


@dataclass
class Experiment:
    """Defaults here only fill what config.yaml leaves out; config.yaml's values are the ones that count."""

    workload: Any = MISSING
    parallel: Any = MISSING
    strategy: Any = MISSING
    fault: Any = MISSING
    recovery: Any = MISSING
    detectors: Any = MISSING
    seed: int = at_least(0, 0)
    steps: int = at_least(1, 30)
    world_size: int = at_least(1, 2)
    ranks_per_node: int = at_least(1, 1)  # a run-wide fact: the fault, strategy and recovery all read it
    device: Device = Device.auto
    backend: Backend = Backend.auto
    threads_per_rank: Any = "auto"  # auto | an integer >= 1 (checked once auto is resolved on the rank's node)
    log_every: int = at_least(1, 5)
    resume: Optional[str] = None  # a run directory, or auto (resilience.supervise.resume)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    train: Train = field(default_factory=Train)
    timeouts: Timeouts = field(default_factory=Timeouts)
    supervisor: Supervisor = field(default_factory=Supervisor)
    validity: Validity = field(default_factory=Validity)
    reference: Reference = field(default_factory=Reference)


ConfigStore.instance().store(name=SCHEMA_NAME, node=Experiment)


def _leaves(schema: type, prefix: str = "") -> Iterator[tuple[str, Any, dict]]:
    """(dotted key, type, metadata) of every setting the schema types."""
    for f in fields(schema):
        if is_dataclass(f.type):
            yield from _leaves(f.type, f"{prefix}{f.name}.")
        elif f.type is not Any:
            yield f"{prefix}{f.name}", f.type, dict(f.metadata)


SETTINGS = {key: (kind, meta) for key, kind, meta in _leaves(Experiment)}


def allowed(key: str) -> str:
    """What ``key`` accepts, in the words of resilience.settings.checks (``must be an integer >= 1``)."""
    kind, meta = SETTINGS[key]
    bound = next((f"{'>=' if name == 'at_least' else '>'} {meta[name]}" for name in ("at_least", "above")
                  if name in meta), "")
    if isinstance(kind, type) and issubclass(kind, Enum):
        return f"must be one of {', '.join(m.value for m in kind)}"
    if kind is int:
        return f"must be an integer {bound}".rstrip()
    if kind is bool:
        return "must be true or false"
    if kind == Optional[float]:  # ==, not is: typing caches these objects only so long
        return f"must be a number {bound}, or null".replace("  ", " ")
    if kind == Optional[str]:
        return "must be a path, or null for the default"
    return f"must be a number {bound}".rstrip()


def check_ranges(cfg: Any) -> None:
    """Every typed setting of the resolved ``cfg`` within its bound; a ValueError names the first one that is not.
    Types are checked again (``require_*``): a config written by hand and loaded without Hydra has no schema."""
    for key, (kind, meta) in SETTINGS.items():
        value = OmegaConf.select(cfg, key)
        if isinstance(kind, type) and issubclass(kind, Enum):
            require_choice(key, value.value if isinstance(value, Enum) else value, [m.value for m in kind])
        elif kind is int:
            require_int(key, value, meta.get("at_least", 0))
        elif kind is Number:
            require_number(key, value, above=meta.get("above"), at_least=meta.get("at_least"))
        elif kind == Optional[float] and value is not None:
            require_number(key, value, above=meta.get("above"), at_least=meta.get("at_least"))


def explain(exc: BaseException) -> str | None:
    """One line for a ValidationError of a setting this schema types (``steps=abc: must be an integer >= 1``),
    found in ``exc`` or its causes (Hydra wraps it); None for any other error."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:  # a chain of contexts can loop (an error raised while handling
        seen.add(id(exc))                             # another that holds it): each exception is looked at once
        if isinstance(exc, ValidationError):
            key = str(getattr(exc, "full_key", "") or "")
            if key in SETTINGS:
                found = re.search(r"(?:Value|value) '(.*?)'", str(exc))
                value = found.group(1) if found else "?"
                return f"{key}={ {'True': 'true', 'False': 'false'}.get(value, value)}: {allowed(key)}"
            return None
        exc = exc.__cause__ or exc.__context__
    return None
