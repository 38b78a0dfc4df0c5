"""The options of each role group in ``conf/``, read without building a role, and how a refusal names them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

from resilience.caps import base_option, Caps

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
GROUPS = ("workload", "parallel", "strategy", "fault", "recovery", "detector")  # the role groups of conf/


@dataclass(frozen=True)
class Option:
    """One option of a group in ``conf/``: its YAML's name, its role's name and what its class declares for it."""

    group: str
    option: str  # dcp_async_process
    name: str  # the role's name, the option it is a variant of: dcp_async
    settings: Mapping[str, Any]
    caps: Caps


def _settings(group: str, option: str) -> dict[str, Any]:
    """An option's settings as written, a variant's over those of the option it names in its defaults list."""
    spec = yaml.safe_load((CONF_DIR / group / f"{option}.yaml").read_text()) or {}
    merged: dict[str, Any] = {}
    for base in [d for d in spec.pop("defaults", []) if isinstance(d, str) and d != "_self_"]:
        merged.update(_settings(group, base))
    return {**merged, **spec}


@cache
def run_settings() -> dict[str, Any]:
    """conf/config.yaml as written: its defaults list (the chosen options) and the top-level settings."""
    return yaml.safe_load((CONF_DIR / "config.yaml").read_text())


def _resolved(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` with their interpolations resolved against the run's defaults (those that cannot be stay)."""
    run = {k: v for k, v in run_settings().items() if k != "defaults"}
    node = OmegaConf.create({**run, "_option": settings})
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
