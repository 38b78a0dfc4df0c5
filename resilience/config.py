"""Validation of an experiment's configuration, before any process starts.

Every error names the setting and what is allowed, in one line; ``ConfigError`` is what the command line turns
into that line (exit status 2, no traceback).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from resilience.settings.checks import require_int
# a rank resolves its node's settings without this module's Hydra (resilience.settings.node)
from resilience.settings.node import ConfigError, cuda_available, on_this_node  # noqa: F401
from resilience.settings.schema import check_ranges, explain

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
GROUPS = ("workload", "strategy", "fault", "recovery", "detector", "parallel")


def search_path(overrides: list) -> list[Path]:
    """The extra config folders of ``hydra.searchpath=[file:///...]``: where a plug-in's options live."""
    for ov in overrides:
        if ov.key_or_group == "hydra.searchpath":
            value = ov.value()
            entries = value if isinstance(value, list) else [value]
            return [Path(str(e).removeprefix("file://")) for e in entries if str(e).startswith("file://")]
    return []


def check_group_choices(argv: list[str], conf_dir: Path = CONF_DIR) -> None:
    """Reject ``strategy=nope`` with the list of options, before Hydra prints a multi-line error."""
    try:
        overrides = OverridesParser.create().parse_overrides([a for a in argv if not a.startswith("-")])
    except Exception:
        return  # a malformed override: Hydra reports it in its own words
    conf_dirs = [conf_dir, *search_path(overrides)]
    for ov in overrides:
        _check_added(ov)
        group = ov.key_or_group
        if group not in GROUPS or ov.is_delete() or ov.package:
            continue
        allowed = sorted({p.stem for d in conf_dirs for p in (d / group).glob("*.yaml")})
        value = ov.value()
        if ov.is_sweep_override():  # strategy=sync,async: every value of the sweep must be an option
            chosen = list(ov.sweep_string_iterator())
        else:
            chosen = value if isinstance(value, list) else [value]
        for name in chosen:
            if str(name) not in allowed:
                raise ConfigError(f"{group}={name}: unknown {group}; allowed: {', '.join(allowed)}")
        twice = sorted({str(n) for n in chosen if chosen.count(n) > 1}) if not ov.is_sweep_override() else []
        if twice:  # it would run twice and be counted twice
            raise ConfigError(f"{group}=[{','.join(map(str, chosen))}]: {', '.join(twice)} listed more than once; "
                              f"each {group} at most once")


# A key added with ``+`` reaches a role's constructor (which refuses what it does not take) or Hydra's own settings;
# anywhere else nothing reads it, and a run that silently ignores a setting is a wrong result.
ADDABLE = (*GROUPS, "detectors", "hydra")


def _check_added(ov: Any) -> None:
    key = ov.key_or_group
    if ov.is_add() and key.split(".", 1)[0] not in ADDABLE:
        raise ConfigError(f"+{key}={ov.value()}: unknown setting, which nothing would read (a key added with + is "
                          f"taken only by a role's options: {', '.join(f'+{g}.KEY' for g in GROUPS if g != 'detector')}, "
                          f"+detectors.NAME.KEY); see "
                          f"resilience-bench --help")


def _integer(cfg: DictConfig, key: str, minimum: int) -> int:
    return require_int(key, OmegaConf.select(cfg, key), minimum)


def _check_local_ranks(cfg: DictConfig, world: int) -> None:
    """The local supervisor starts every rank on this machine: refuse more than it can run (``auto``: 8 per core)."""
    if cfg.supervisor.launcher == "external":
        return  # torchrun spreads the ranks over the cluster's nodes
    limit = cfg.supervisor.max_local_ranks
    if limit == "auto":
        limit = 8 * (os.cpu_count() or 1)
    limit = require_int("supervisor.max_local_ranks", limit, 1)
    if world > limit:
        raise ConfigError(f"world_size={world}: more ranks than this machine runs (supervisor.max_local_ranks="
                          f"{limit}); raise supervisor.max_local_ranks, or use supervisor.launcher=external to "
                          f"launch across nodes with torchrun")


def _check_checkpoint_dir(path: Path) -> None:
    """A directory this process can create files in (it need not exist yet); nothing is created here."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"checkpoint.dir={path}: is a file, not a directory")
    ancestor = path
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ConfigError(f"checkpoint.dir={path}: {ancestor} is a file, so the directory cannot be created")
    if not os.access(ancestor, os.W_OK | os.X_OK) or _read_only(ancestor):
        raise ConfigError(f"checkpoint.dir={path}: {ancestor} is not writable; choose a writable directory")


def _read_only(path: Path) -> bool:
    """A file system that refuses writes even to root (read-only mount, /proc, /sys)."""
    st = os.statvfs(path)
    return bool(st.f_flag & os.ST_RDONLY) or str(path.resolve()).startswith(("/proc", "/sys"))


def resolve(cfg: DictConfig, run_dir: Path, choices: dict[str, Any]) -> DictConfig:
    """The fully resolved, validated configuration that the rank processes receive (``auto`` values filled in)."""
    try:
        return _resolve(cfg, run_dir, choices)
    except ConfigError:
        raise
    except ValueError as exc:  # a check of one setting (resilience.settings.checks) or a role's constructor
        raise ConfigError(str(exc)) from None


def _resolved(cfg: DictConfig) -> DictConfig:
    """Every interpolation resolved; one that cannot be is one line naming the key and its value as written."""
    try:  # the schema's enums (resilience.settings.schema) as the strings they were written as
        return OmegaConf.create(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))
    except OmegaConfBaseException as exc:
        if line := explain(exc):  # an interpolation whose value has the wrong type for its setting
            raise ConfigError(line) from None
        key = str(getattr(exc, "full_key", "") or "")
        shown: Any = OmegaConf.to_container(cfg, resolve=False)
        for part in key.split(".") if key else ():
            shown = shown.get(part) if isinstance(shown, dict) else None  # the value as written: ${...}
        reason = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise ConfigError(f"{key}={shown}: {reason}" if key else reason) from None


def auto_fault_step(cfg: DictConfig) -> int:
    """``fault.at_step=auto``: three steps after the second checkpoint (13 with every=5: work is lost, and an
    older checkpoint exists), or the middle of a run too short for that; at a checkpoint step when the fault
    strikes during one. A shorter ``steps=`` on the command line then needs no matching ``fault.at_step=``."""
    steps = _integer(cfg, "steps", 1)
    # checkpoint.every=auto: its first checkpoints come at checkpoint.auto.first
    every = _integer(cfg, "checkpoint.auto.first" if cfg.checkpoint.every == "auto" else "checkpoint.every", 1)
    if cfg.fault.get("phase") == "during_checkpoint":
        candidates = (2 * every, every)
    else:
        candidates = (2 * every + 3, steps // 2)
    return next((step for step in candidates if 0 < step < steps), 0)


def ranks_per_node_from_fault(cfg: DictConfig) -> DictConfig:
    """``fault.ranks_per_node=N``, the setting's name when the fault owned it, sets the run's ``ranks_per_node``
    (which the fault, the strategy and the recovery all read), so command lines and matrices that name it run as
    before; given with a different ``ranks_per_node``, it is refused in one line. Before interpolations resolve."""
    fault = cfg.get("fault")
    if not isinstance(fault, DictConfig) or "ranks_per_node" not in fault:
        return cfg
    if OmegaConf.to_container(fault, resolve=False).get("ranks_per_node") == "${ranks_per_node}":
        return cfg  # the run's, as conf/fault/node_loss.yaml has it
    try:
        value, run = fault.ranks_per_node, cfg.get("ranks_per_node", 1)
    except OmegaConfBaseException:
        return cfg  # an interpolation that cannot be resolved: _resolved names it
    value = require_int("fault.ranks_per_node", value, 1)
    if run not in (1, value):
        raise ConfigError(f"fault.ranks_per_node={value}: differs from ranks_per_node={run} (the run's ranks per "
                          f"node, of which fault.ranks_per_node is the old name); give ranks_per_node alone")
    cfg = copy.deepcopy(cfg)  # the caller's composition stays as it was composed
    with open_dict(cfg):
        cfg.ranks_per_node = value
    return cfg


def _resolve(cfg: DictConfig, run_dir: Path, choices: dict[str, Any]) -> DictConfig:
    cfg = _resolved(ranks_per_node_from_fault(cfg))
    check_ranges(cfg)  # types were checked while Hydra composed (the schema); bounds need resolved values
    world = int(cfg.world_size)
    if world % int(cfg.get("ranks_per_node", 1)):
        raise ConfigError(f"ranks_per_node={cfg.ranks_per_node}: must divide world_size={world} (nodes of equal size)")
    if OmegaConf.select(cfg, "fault.at_step") == "auto":
        with open_dict(cfg):
            cfg.fault.at_step = auto_fault_step(cfg)
    keep = OmegaConf.select(cfg, "checkpoint.keep_after_run")
    if keep not in ("auto", True, False):
        raise ConfigError(f"checkpoint.keep_after_run={keep}: allowed: auto, true, false")
    if cfg.supervisor.launcher != "external":  # across nodes, each rank's node decides at start (on_this_node)
        cfg = on_this_node(cfg, local_ranks=world)
    with open_dict(cfg):
        cfg.run_dir = str(run_dir)
        cfg.checkpoint.dir = str(Path(cfg.checkpoint.dir or run_dir / "ckpt").resolve())
        cfg.choices = choices
    if cfg.threads_per_rank != "auto":
        _integer(cfg, "threads_per_rank", 1)
    _check_local_ranks(cfg, world)
    _check_checkpoint_dir(Path(cfg.checkpoint.dir))
    from resilience.roles import build_roles  # the roles' modules import torch: not for --help or a bad choice

    roles = build_roles(cfg)  # every role validates its own settings where it is built
    roles.strategy.check_host(roles.workload, int(cfg.world_size), roles.parallel.shards(int(cfg.world_size)))
    return cfg
