"""A command line checked before Hydra runs: a bad override is one line, exit 2, and nothing is created.

Hydra's own entry point creates the run directory (``.hydra/``, a log file) before the application sees the
configuration, and reports a misspelled key in several lines. The commands therefore compose the configuration
once with Hydra's compose API (which writes nothing) and validate it; only a valid command line reaches the Hydra
entry point.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any

import yaml
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException


class CommandLineError(ValueError):
    """An override that cannot be applied; the message is one line naming it and what is allowed."""


# Hydra's flags that take a value as the next argument, and those after which it only prints (nothing to check).
_VALUED = ("-cn", "--config-name", "-cp", "--config-path", "-cd", "--config-dir", "--experimental-rerun",
           "--info", "-i")
_PRINTING = ("-h", "--help", "-hh", "--hydra-help", "-c", "--cfg", "--info", "-i", "-sc", "--shell-completion",
             "--version", "-p", "--package", "--resolve", "--experimental-rerun")
MULTIRUN = ("-m", "--multirun")


def overrides_of(argv: list[str]) -> list[str]:
    """The Hydra overrides among the arguments (flags such as ``--multirun`` and their values are Hydra's own)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg.startswith("-"):
            skip = arg in _VALUED
        else:
            out.append(arg)
    return out


def only_prints(argv: list[str]) -> bool:
    """Hydra only prints something (help, the config, shell completion): no run, nothing to check."""
    return any(a.split("=")[0] in _PRINTING for a in argv)


def jobs_of(argv: list[str]) -> list[list[str]]:
    """The override list of each job Hydra will run: one, or with ``--multirun`` one per point of the sweep.
    Without ``--multirun``, a sweep (``strategy=sync,async``) is refused with the flag it needs."""
    overrides = overrides_of(argv)
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as exc:
        raise CommandLineError(f"cannot parse the command line: {_first_line(exc)}") from None
    if any(a in MULTIRUN for a in argv):
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

        try:
            return BasicSweeper.split_arguments(parsed, None)[0]
        except HydraException as exc:
            raise CommandLineError(f"cannot sweep: {_first_line(exc)}") from None
    sweep = next((ov for ov in parsed if ov.is_sweep_override()), None)
    if sweep is not None:
        raise CommandLineError(f"{sweep.input_line}: several values sweep, which needs --multirun (-m); quote a "
                               f"value that holds a comma ({sweep.key_or_group}='a,b')")
    return [overrides]


def compose_checked(conf_dir: Path, config_name: str, argv: list[str]) -> DictConfig:
    """The composed configuration (the ``hydra`` node included) for ``argv``, or a ``CommandLineError``."""
    overrides = overrides_of(argv)
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as exc:
        raise CommandLineError(f"cannot parse the command line: {_first_line(exc)}") from None
    try:
        with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
            return compose(config_name=config_name, overrides=overrides, return_hydra_config=True)
    except (HydraException, OmegaConfBaseException, ValueError, yaml.YAMLError) as exc:
        raise CommandLineError(_explain(exc, parsed, conf_dir, config_name)) from None


def _explain(exc: Exception, parsed: list[Any], conf_dir: Path, config_name: str) -> str:
    """One line for a composition error: an unknown key gets the nearest known keys, anything else its cause."""
    text = _first_line(exc)
    from resilience.settings.schema import explain  # a setting of the wrong type (the structured config's check)

    if typed := explain(exc):
        return typed
    missing = re.search(r"Could not find '([\w-]+)/([^']+)'", str(exc))
    if missing and (conf_dir / missing.group(1)).is_dir():
        group, name = missing.groups()
        allowed = sorted(p.stem for p in (conf_dir / group).glob("*.yaml"))
        return f"{group}={name}: unknown {group}; allowed: {', '.join(allowed)}"
    for ov in parsed:
        key = ov.key_or_group
        if ov.is_add() or key.startswith("hydra.") or f"'{key}'" not in str(exc) and key not in str(exc):
            continue
        known = _known_keys(conf_dir, config_name)
        if key in known:
            break
        near = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
        hint = f"did you mean {' or '.join(near)}?" if near else "see conf/ for the settings"
        return f"{key}={ov.value()}: unknown setting; {hint}"
    return text


def _known_keys(conf_dir: Path, config_name: str) -> list[str]:
    """Every dotted key of the default configuration, and the config groups (``strategy``, ``fault``, ...)."""
    with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
        cfg = compose(config_name=config_name)
    keys: list[str] = []

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                keys.append(f"{prefix}{k}")
                walk(v, f"{prefix}{k}.")

    walk(OmegaConf.to_container(cfg, resolve=False), "")
    groups = [p.name for p in conf_dir.iterdir() if p.is_dir()]
    return sorted(set(keys) | set(groups))


def _first_line(exc: Exception) -> str:
    lines = [s.strip() for s in str(exc).splitlines() if s.strip()]
    return lines[0] if lines else type(exc).__name__
