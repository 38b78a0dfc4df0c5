"""One matrix file, parsed and checked: its axes (fault entries as :class:`Fault`), exclusions, overrides, reference.

Every entry that is not allowed raises :class:`MatrixError` with one line naming the key and what is allowed
(``matrix default: axes.strategy[2]=asyn: unknown option; allowed: none, sync``). Option names (workload,
strategy, fault, detector) are checked against the files in ``conf/<group>/``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

SAFE = re.compile(r"[A-Za-z0-9_.=-]+")
# Axis -> (config group whose option files list the allowed values, or None for an integer axis, its minimum).
AXES: dict[str, tuple[str | None, int]] = {
    "workload": ("workload", 0), "strategy": ("strategy", 0), "fault": ("fault", 0), "detectors": ("detector", 0),
    "checkpoint.every": (None, 1), "seed": (None, 0), "world_size": (None, 1), "steps": (None, 1),
    "recovery": ("recovery", 0), "supervisor.launcher": (None, 0), "supervisor.spares": (None, 0),
    "repeat": (None, 0), "parallel": ("parallel", 0),
}
# Axes a matrix may leave out: then they take one value, None (the run's default or ``overrides``), and stay out
# of the cell names, so that a matrix without them keeps its names.
OPTIONAL_AXES = ("recovery", "supervisor.launcher", "supervisor.spares", "repeat", "parallel")
# Axes that are no run setting: ``repeat`` measures the same run (same seed, same overrides) again.
MEASUREMENT_AXES = ("repeat",)
# Axes whose values are words from a fixed list (not options of a config group, not integers).
CHOICE_AXES = {"supervisor.launcher": ("local", "torchrun", "ft_launcher")}


class MatrixError(ValueError):
    """A matrix file entry that is not allowed; the message names the key and what is allowed, in one line."""


@dataclass(frozen=True)
class Fault:
    """One entry of the fault axis: a ``conf/fault`` option plus ``fault.<param>`` overrides."""

    name: str
    params: dict[str, Any] = field(default_factory=dict)
    label: str = ""

    def overrides(self) -> list[str]:
        return [f"fault={self.name}"] + [f"fault.{k}={hydra_value(v)}" for k, v in self.params.items()]


def parse_axes(raw: Any, where: str, conf_dir: Path, need_none: bool = True) -> dict[str, list[Any]]:
    if not isinstance(raw, dict):
        raise MatrixError(f"{where}: axes: must be a mapping of {', '.join(AXES)}")
    for key in raw:
        if key not in AXES:
            raise MatrixError(f"{where}: axes.{key}: unknown axis; allowed: {', '.join(AXES)}")
    out: dict[str, list[Any]] = {}
    for axis, (group, minimum) in AXES.items():
        values = raw.get(axis)
        if values is None and axis in OPTIONAL_AXES:
            out[axis] = [None]
            continue
        if not isinstance(values, list) or not values:
            raise MatrixError(f"{where}: axes.{axis}: must be a non-empty list")
        key = f"{where}: axes.{axis}"
        if axis == "fault":
            parsed = [_fault(v, f"{key}[{i}]", _options(conf_dir, group), conf_dir) for i, v in enumerate(values)]
        elif axis == "detectors":
            parsed = [_detectors(v, f"{key}[{i}]", _options(conf_dir, group)) for i, v in enumerate(values)]
        elif group:
            parsed = [_option(v, f"{key}[{i}]", _options(conf_dir, group)) for i, v in enumerate(values)]
        elif axis in CHOICE_AXES:
            parsed = [_option(v, f"{key}[{i}]", list(CHOICE_AXES[axis])) for i, v in enumerate(values)]
        elif axis == "checkpoint.every":  # an interval, or auto (chosen as the run goes: checkpoint.auto.*)
            parsed = [v if v == "auto" else _int(v, f"{key}[{i}]", minimum) for i, v in enumerate(values)]
        else:
            parsed = [_int(v, f"{key}[{i}]", minimum) for i, v in enumerate(values)]
        ids = [f.label if isinstance(f, Fault) else f for f in parsed]
        dup = next((v for v in ids if ids.count(v) > 1), None)
        if dup is not None:
            raise MatrixError(f"{key}: {dup} is listed twice")
        out[axis] = parsed
    if need_none and not any(f.name == "none" for f in out["fault"]):
        raise MatrixError(f"{where}: axes.fault: must include none (the fault-free reference run)")
    return out


def _dirs(conf_dir: Path | list[Path]) -> list[Path]:
    """The config folders: conf/ and a matrix's ``searchpath`` (plug-in options), in Hydra's order."""
    return list(conf_dir) if isinstance(conf_dir, (list, tuple)) else [conf_dir]


def _options(conf_dir: Path | list[Path], group: str) -> list[str]:
    return sorted({p.stem for d in _dirs(conf_dir) for p in (d / group).glob("*.yaml")})


def _safe(value: Any, key: str) -> str:
    text = str(value)
    if not SAFE.fullmatch(text):
        raise MatrixError(f"{key}={text!r}: may only use the characters A-Z a-z 0-9 _ . = -")
    return text


def _option(value: Any, key: str, allowed: list[str]) -> str:
    text = _safe(value, key)
    if text not in allowed:
        raise MatrixError(f"{key}={text}: unknown option; allowed: {', '.join(allowed)}")
    return text


def _int(value: Any, key: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise MatrixError(f"{key}={value}: must be an integer >= {minimum}")
    return value


def _detectors(value: Any, key: str, allowed: list[str]) -> tuple[str, ...]:
    names = value if isinstance(value, list) else [value]
    if not names:
        raise MatrixError(f"{key}: must name at least one detector; allowed: {', '.join(allowed)}")
    return tuple(_option(n, key, allowed) for n in names)


def _fault_keys(conf_dir: Path | list[Path], name: str) -> list[str]:
    """The parameters a fault option defines (top-level keys of conf/fault/<name>.yaml but ``_target_``)."""
    path = next(p for d in _dirs(conf_dir) if (p := d / "fault" / f"{name}.yaml").is_file())
    spec = yaml.safe_load(path.read_text()) or {}
    return sorted(k for k in spec if not str(k).startswith("_"))


def _fault(value: Any, key: str, allowed: list[str], conf_dir: Path) -> Fault:
    if not isinstance(value, dict):
        value = {"name": value}
    entry = dict(value)
    name = _option(entry.pop("name", None), f"{key}.name", allowed)
    label = entry.pop("label", None)
    params: dict[str, Any] = {}
    known = _fault_keys(conf_dir, name)
    for k, v in entry.items():
        if k not in known:
            raise MatrixError(f"{key}.{k}: not a parameter of fault {name}; allowed: {', '.join(known)}")
        scalars = v if isinstance(v, list) else [v]
        # a list: one value per planned fault (fault.at_step=[6,10,13], docs/faults.md)
        if not scalars or not all(isinstance(x, (str, int, float, bool)) for x in scalars):
            raise MatrixError(f"{key}.{k}={v}: must be a string, number or boolean, or a non-empty list of them")
        params[k] = v
    # a list's values joined by '-' in the label (its brackets and commas are no file-name characters)
    default = ".".join([name] + [f"{k}={_safe(_label_value(v), f'{key}.{k}')}" for k, v in params.items()])
    return Fault(name, params, _safe(label, f"{key}.label") if label is not None else default)


def _label_value(value: Any) -> str:
    return "-".join(map(str, value)) if isinstance(value, list) else str(value)


def parse_excludes(raw: Any, axes: dict[str, list[Any]], where: str,
                   conf_dir: Path) -> list[dict[str, list[Any]]]:
    if not isinstance(raw, list):
        raise MatrixError(f"{where}: exclude: must be a list of mappings, e.g. - {{strategy: none, fault.phase: "
                          f"during_checkpoint}}")
    fault_params = {f"fault.{k}" for name in _options(conf_dir, "fault") for k in _fault_keys(conf_dir, name)}
    out = []
    for i, entry in enumerate(raw):
        key = f"{where}: exclude[{i}]"
        if not isinstance(entry, dict) or not entry:
            raise MatrixError(f"{key}: must be a non-empty mapping of axis (or fault.<param>) to value(s)")
        rule: dict[str, list[Any]] = {}
        for k, v in entry.items():
            values = v if isinstance(v, list) else [v]
            if k not in AXES and k not in fault_params:
                allowed = ", ".join([*AXES, *sorted(fault_params)])
                raise MatrixError(f"{key}.{k}: unknown key; allowed: {allowed}")
            # Values are checked against what could exist (conf/ options), not against the axes: removing a value
            # from an axis must not turn an exclusion into an error, but a typo must be one.
            group, minimum = AXES.get(k, (None, None))
            for j, x in enumerate(values):
                where_x = f"{key}.{k}" + (f"[{j}]" if isinstance(v, list) else "")
                if k == "fault" and x in {f.label for f in axes["fault"]}:
                    continue
                if group:
                    _option(x, where_x, _options(conf_dir, group))
                elif k in CHOICE_AXES:
                    _option(x, where_x, list(CHOICE_AXES[k]))
                elif minimum is not None:
                    _int(x, where_x, minimum)
                elif not isinstance(x, (str, int, float, bool)):
                    raise MatrixError(f"{where_x}={x}: must be a string, number or boolean")
            rule[k] = values
        out.append(rule)
    return out


def matches(values: dict[str, Any], rule: dict[str, list[Any]]) -> bool:
    fault: Fault = values["fault"]
    for key, allowed in rule.items():
        if key == "fault":
            ok = fault.name in allowed or fault.label in allowed
        elif key.startswith("fault."):
            param = key[len("fault."):]
            ok = param in fault.params and fault.params[param] in allowed
        elif key == "detectors":
            ok = any(d in allowed for d in values["detectors"])
        else:
            ok = values[key] in allowed
        if not ok:
            return False
    return True


def parse_overrides(raw: Any, where: str, axes: dict[str, list[Any]]) -> list[str]:
    if not isinstance(raw, dict):
        raise MatrixError(f"{where}: overrides: must be a mapping of Hydra key to value, e.g. {{recovery: restart}}")
    out = []
    for k, v in raw.items():
        axis_set = k in AXES and axes.get(k) != [None]  # an optional axis left out may be set here
        if k in MEASUREMENT_AXES:
            raise MatrixError(f"{where}: overrides.{k}: not a run setting; list it under axes (e.g. {k}: [0, 1, 2])")
        if axis_set or k in ("fault", "detector") or str(k).startswith(("fault.", "hydra.")):
            raise MatrixError(f"{where}: overrides.{k}: set by the axes (or the pipeline); not allowed here")
        out.append(f"{k}={hydra_value(v)}")
    return out


def parse_searchpath(raw: Any, where: str, base: Path) -> list[Path]:
    """``searchpath``: config folders holding plug-in options (docs/own_model.md); relative to the matrix file."""
    entries = raw if isinstance(raw, list) else [raw]
    out = []
    for i, entry in enumerate(entries):
        folder = base / str(entry)
        if not isinstance(entry, str) or not folder.is_dir():
            raise MatrixError(f"{where}: searchpath[{i}]={entry}: must be a config folder (absolute, or relative "
                              f"to the matrix file)")
        out.append(folder.resolve())
    return out


def parse_reference(raw: Any, where: str, conf_dir: Path) -> str:
    if not isinstance(raw, dict) or set(raw) != {"strategy"}:
        raise MatrixError(f"{where}: reference: must be a mapping with one key, strategy (e.g. {{strategy: none}})")
    return _option(raw["strategy"], f"{where}: reference.strategy", _options(conf_dir, "strategy"))


def hydra_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, list):
        return "[" + ",".join(hydra_value(x) for x in value) + "]"
    return str(value)


def parse_blocks(raw: Any, base: dict[str, Any], where: str) -> list[tuple[str, dict[str, Any], list[Any]]]:
    """``blocks``: a list of {axes: {...}, exclude: [...]}; each block's axes are the matrix's ``axes`` with the ones
    it names replaced. Returns (where, raw axes, raw excludes) per block, for :func:`parse_axes` and
    :func:`parse_excludes`."""
    if not isinstance(raw, list) or not raw:
        raise MatrixError(f"{where}: blocks: must be a non-empty list of mappings with keys axes, exclude")
    out = []
    for i, block in enumerate(raw):
        key = f"{where}: blocks[{i}]"
        if not isinstance(block, dict) or not isinstance(block.get("axes", {}), dict):
            raise MatrixError(f"{key}: must be a mapping with keys axes (a mapping), exclude (a list)")
        unknown = sorted(set(block) - {"axes", "exclude"})
        if unknown:
            raise MatrixError(f"{key}: {unknown[0]}: unknown key; allowed: axes, exclude")
        out.append((key, {**base, **block.get("axes", {})}, block.get("exclude") or []))
    return out
