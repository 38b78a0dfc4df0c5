"""The benchmark matrix: ``conf/matrix/<name>.yaml`` expanded into cells, one experiment each.

A pure function of the YAML (and of the option files in ``conf/``), used by the Snakefile, the aggregation and the
tests alike. A matrix file holds::

    axes:        every axis in AXES, each a non-empty list (fault entries: ``none`` or {name: kill, phase: ...});
                 the OPTIONAL_AXES may be left out (``recovery``: then set it in ``overrides``, or the default
                 applies); ``repeat: [0, 1, 2]`` measures every cell three times (same seed, same overrides)
    exclude:     [{axis or fault.<param>: value or [values]}, ...]   cells matching all keys of one entry are dropped
    blocks:      [{axes: {...}, exclude: [...]}, ...]   optional: the cells are then the union of the blocks, each
                 the product of ``axes`` with the axes it names replaced, minus ``exclude`` and its own exclusions
                 (a block's fault list need not hold ``none``; duplicates across blocks are one cell)
    reference:   {strategy: none}                                    the fault-free run every cell is compared with
    overrides:   {recovery: restart, ...}                            extra Hydra overrides for every cell
    runtime_min: 20                                                  time limit of one cell (minutes)
    searchpath:  [/abs/conf]     optional: config folders of plug-in options the axes may name (docs/own_model.md)

A cell's name encodes all its axis values, so adding a value to an axis adds cells but never renames (and so never
reruns) the existing ones. Every bad entry raises :class:`MatrixError` with one line naming the key.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from reports.matrix_spec import (SAFE, AXES, Fault, MatrixError, hydra_value, matches, parse_axes, parse_blocks,
                                 parse_excludes, parse_overrides, parse_reference, parse_searchpath)
from resilience.config import GROUPS, ConfigError, resolve
from resilience.settings.schema import explain

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
MATRIX_DIR = CONF_DIR / "matrix"
TOP_KEYS = ("description", "axes", "exclude", "blocks", "reference", "overrides", "runtime_min", "searchpath")
CHOICE_GROUPS = ("workload", "strategy", "fault", "recovery")
_MISSING = object()
GROUP_KEY = ("workload", "world_size", "steps", "seed", "parallel")  # cells sharing these share a reference run


@dataclass(frozen=True)
class Cell:
    """One experiment: its safe name, axis values, Hydra overrides, and the name of its reference cell."""

    name: str
    values: dict[str, Any]
    overrides: tuple[str, ...]
    reference: str

    @property
    def is_reference(self) -> bool:
        return self.name == self.reference

    @property
    def world_size(self) -> int:
        return int(self.values["world_size"])

    @property
    def dir(self) -> str:
        """The cell's run directory (and log) name: strategy, fault and a stable 8-digit hash of the full name,
        e.g. ``sync-kill-1f0c2a9e``. Full names grow with every axis (169 characters in the full matrix, past the
        255-byte file-name limit with a long detector list); the full parameters are in the run's params.yaml."""
        digest = hashlib.sha256(self.name.encode()).hexdigest()[:8]
        return f"{self.values['strategy']}-{self.values['fault'].name}-{digest}"

    def job_spec(self) -> str:
        """What the run rule needs, as JSON: stable for a given name, so that it never triggers a rerun by itself."""
        params = {k.removeprefix("cell."): v for k, v in self.columns().items()}
        return json.dumps({"cell": self.name, "overrides": list(self.overrides), "params": params}, sort_keys=True)

    def columns(self) -> dict[str, Any]:
        """The cell's parameters as flat ``cell.*`` columns of the summary table."""
        fault: Fault = self.values["fault"]
        out: dict[str, Any] = {f"cell.{k}": v for k, v in self.values.items() if k not in ("fault", "detectors")
                               and not (k == "parallel" and v is None)}  # earlier matrices' job specs stay as they were
        out["cell.fault"] = fault.name
        out["cell.fault_label"] = fault.label
        # a list (one value per planned fault) as its override's text: one value per column cell
        out.update({f"cell.fault.{k}": hydra_value(v) if isinstance(v, list) else v for k, v in fault.params.items()})
        out["cell.detectors"] = "+".join(self.values["detectors"])
        return out


@dataclass(frozen=True)
class Matrix:
    name: str
    source: str  # the YAML file, as given (relative to the working directory when it was found in conf/)
    description: str
    cells: list[Cell]
    runtime_min: int

    @property
    def by_name(self) -> dict[str, Cell]:
        return {c.name: c for c in self.cells}

    def at(self, directory: str) -> Cell:
        """The cell whose run directory is named ``directory`` (:attr:`Cell.dir`)."""
        found = next((c for c in self.cells if c.dir == directory), None)
        if found is None:
            raise MatrixError(f"run directory {directory}: no cell of matrix {self.name} has it")
        return found

    def cell(self, name: str) -> Cell:
        try:
            return self.by_name[name]
        except KeyError:
            raise MatrixError(f"cell {name}: not in matrix {self.name}") from None


def available(matrix_dir: Path = MATRIX_DIR) -> list[str]:
    return sorted(p.stem for p in matrix_dir.glob("*.yaml"))


def find(name_or_path: str, matrix_dir: Path = MATRIX_DIR) -> Path:
    """``smoke`` -> conf/matrix/smoke.yaml; a path to a YAML file is taken as is."""
    candidate = matrix_dir / f"{name_or_path}.yaml"
    if SAFE.fullmatch(name_or_path) and candidate.is_file():
        return candidate
    if Path(name_or_path).is_file():
        return Path(name_or_path)
    raise MatrixError(f"matrix={name_or_path}: no such matrix; allowed: {', '.join(available(matrix_dir))} "
                      f"or a path to a YAML file")


def load_matrix(name_or_path: str, conf_dir: Path = CONF_DIR, check: bool = False) -> Matrix:
    """Read and expand a matrix by name (conf/matrix/<name>.yaml) or path; with ``check``, also validate every
    cell as ``python -m resilience`` would (``check_cells``)."""
    path = find(name_or_path, conf_dir / "matrix")
    try:
        spec = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise MatrixError(f"matrix {path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    resolved, cwd = path.resolve(), Path.cwd().resolve()
    source = str(resolved.relative_to(cwd)) if resolved.is_relative_to(cwd) else str(resolved)
    matrix = expand(spec, name=path.stem, source=source, conf_dir=conf_dir)
    if check:
        check_cells(matrix, conf_dir)
    return matrix


def check_cells(matrix: Matrix, conf_dir: Path = CONF_DIR) -> None:
    """Every cell's configuration, composed and resolved with the command's own checks, before any cell runs: a
    bad cell (an out-of-range fault rank, an unknown phase) is one ``MatrixError`` line, not a failed cell later.

    Cells that choose the same options share one Hydra composition (the slow part); their other settings are
    applied on a copy, as Hydra applies a value override. A repeat of a cell (``MEASUREMENT_AXES``: the same
    overrides) is the same configuration, checked once: the default matrix's 119 cells are 43 configurations."""
    composed: dict[tuple[str, ...], DictConfig] = {}
    checked: set[tuple[str, ...]] = set()
    parser = OverridesParser.create()
    groups_of_conf = config_groups(conf_dir) | {"hydra.searchpath"}  # a plug-in's options: its searchpath
    with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
        for cell in matrix.cells:
            if cell.overrides in checked:  # its first repeat passed: a bad one ended the loop, naming that cell
                continue
            checked.add(cell.overrides)
            try:
                overrides = parser.parse_overrides(list(cell.overrides))
                groups = tuple(o.input_line for o in overrides if o.key_or_group in groups_of_conf)
                if groups not in composed:
                    composed[groups] = compose(config_name="config", overrides=list(groups))
                cfg = copy.deepcopy(composed[groups])
                for o in overrides:
                    if o.key_or_group not in groups_of_conf:
                        if OmegaConf.select(cfg, o.key_or_group, default=_MISSING) is _MISSING:
                            raise ConfigError(f"{o.key_or_group}={o.value()}: unknown setting")
                        OmegaConf.update(cfg, o.key_or_group, o.value(), merge=True)
                choices = {o.key_or_group: o.value() for o in overrides if o.key_or_group in CHOICE_GROUPS}
                # Nothing is created: the run directory only names where the checkpoints would go.
                resolve(cfg, Path(tempfile.gettempdir()) / "rb-matrix-check" / cell.name, choices)
            except (ConfigError, HydraException, OmegaConfBaseException) as exc:
                # a typed setting's wrong value reads as the command says it (``steps=abc: must be an integer``)
                first = explain(exc) or next((s for s in str(exc).splitlines() if s.strip()), type(exc).__name__)
                raise MatrixError(f"matrix {matrix.name}: cell {cell.name}: {first}") from None


def config_groups(conf_dir: Path = CONF_DIR) -> set[str]:
    """Every option group Hydra composes: the roles' (``GROUPS``) and any other folder of ``conf/`` with option
    files (``train``): an override ``train=real`` picks an option file, it does not set a value."""
    return {*GROUPS, *(p.name for p in conf_dir.iterdir() if p.is_dir() and p.name != "matrix"
                       and any(p.glob("*.yaml")))}


def expand(spec: Any, name: str = "matrix", source: str = "", conf_dir: Path = CONF_DIR) -> Matrix:
    """All cells of a matrix spec (the parsed YAML): the product of the axes, minus exclusions, plus references."""
    where = f"matrix {name}"
    if not isinstance(spec, dict):
        raise MatrixError(f"{where}: must be a mapping with keys {', '.join(TOP_KEYS)}")
    for key in spec:
        if key not in TOP_KEYS:
            raise MatrixError(f"{where}: {key}: unknown key; allowed: {', '.join(TOP_KEYS)}")
    base = Path(source).resolve().parent if source else Path.cwd()  # a relative searchpath: from the matrix file
    searchpath = parse_searchpath(spec["searchpath"], where, base) if "searchpath" in spec else []
    conf_dir = [conf_dir, *searchpath] if searchpath else conf_dir  # the options the axes may name
    axes = parse_axes(spec.get("axes"), where, conf_dir)
    excludes = parse_excludes(spec.get("exclude") or [], axes, where, conf_dir)
    extra = parse_overrides(spec.get("overrides") or {}, where, axes)
    if searchpath:  # every cell composes its plug-in options as the command does
        extra.append(f"hydra.searchpath=[{','.join(repr(f'file://{d}') for d in searchpath)}]")
    ref_strategy = parse_reference(spec.get("reference") or {"strategy": "none"}, where, conf_dir)
    runtime = spec.get("runtime_min", 20)
    if isinstance(runtime, bool) or not isinstance(runtime, int) or runtime < 1:
        raise MatrixError(f"{where}: runtime_min={runtime}: must be an integer >= 1 (minutes)")

    combos = _combos(axes, excludes)
    if "blocks" in spec:  # the union of the blocks, in their order; a cell two blocks name is one cell
        combos = []
        for key, raw, raw_excludes in parse_blocks(spec["blocks"], spec["axes"], where):
            block_axes = parse_axes(raw, key, conf_dir, need_none=False)
            combos += _combos(block_axes, excludes + parse_excludes(raw_excludes, block_axes, key, conf_dir))
        combos = list({_name(v): v for v in combos}.values())
    cells: list[Cell] = []
    for _, group in itertools.groupby(sorted(combos, key=_group), key=_group):
        group = list(group)
        # GROUP_KEY leaves ``repeat`` out: the repeats of a group share one reference, its first repeat; the
        # reference strategy's other fault-free repeats are ordinary cells, compared with it like any other.
        candidates = [v for v in group if v["strategy"] == ref_strategy and v["fault"].name == "none"]
        ref = min(candidates, key=_repeat, default=None)
        if ref is None:  # the fault-free reference is part of every matrix, excluded or not
            ref = {**min(group, key=_repeat), "strategy": ref_strategy,
                   "fault": next(f for f in axes["fault"] if f.name == "none")}
            group.insert(0, ref)
        ref_name = _name(ref)
        ordered = [ref] + [v for v in group if v is not ref]
        cells += [Cell(_name(v), v, tuple(_cell_overrides(v, extra)), ref_name) for v in ordered]
    seen: dict[str, Cell] = {}
    for c in cells:
        if c.name in seen:
            raise MatrixError(f"{where}: cell {c.name}: two cells share this name; give fault entries distinct labels")
        seen[c.name] = c
    dirs = [c.dir for c in cells]
    clash = next((d for d in dirs if dirs.count(d) > 1), None)
    if clash is not None:  # two full names whose 8-digit hashes agree: one in 2**32 per pair
        raise MatrixError(f"{where}: run directory {clash}: two cells share it; rename one with a fault label")
    return Matrix(name, source, str(spec.get("description", "")).strip(), cells, runtime)


def _combos(axes: dict[str, list[Any]], excludes: list[dict[str, list[Any]]]) -> list[dict[str, Any]]:
    combos = [dict(zip(AXES, values)) for values in itertools.product(*(axes[a] for a in AXES))]
    return [v for v in combos if not any(matches(v, ex) for ex in excludes)]


def _group(values: dict[str, Any]) -> tuple:
    return tuple(values[k] for k in GROUP_KEY)


def _repeat(values: dict[str, Any]) -> int:
    """The repeat number: 0 without a ``repeat`` axis."""
    return values["repeat"] or 0


def _name(v: dict[str, Any]) -> str:
    parts = [v["workload"], v["strategy"], v["fault"].label, ".".join(v["detectors"]),
             f"every{v['checkpoint.every']}", f"ws{v['world_size']}", f"steps{v['steps']}", f"seed{v['seed']}"]
    if v["recovery"] is not None:
        parts.append(v["recovery"])
    if v["supervisor.launcher"] not in (None, "local"):  # the default launcher keeps today's names
        parts.append(v["supervisor.launcher"])
    if v["supervisor.spares"]:
        parts.append(f"spares{v['supervisor.spares']}")
    if v["parallel"] is not None:  # sharded training (docs/sharded.md); left out, the names stay as they were
        parts.append(v["parallel"])
    if _repeat(v):  # repeat 0 keeps the name it has without the axis; the name keeps the repeats' runs apart
        parts.append(f"rep{v['repeat']}")
    return "-".join(str(p) for p in parts)


def _cell_overrides(v: dict[str, Any], extra: list[str]) -> list[str]:
    fault: Fault = v["fault"]
    return [f"workload={v['workload']}", f"strategy={v['strategy']}", *fault.overrides(),
            f"detector=[{','.join(v['detectors'])}]", f"checkpoint.every={v['checkpoint.every']}",
            f"world_size={v['world_size']}", f"steps={v['steps']}", f"seed={v['seed']}",
            *([f"recovery={v['recovery']}"] if v["recovery"] is not None else []),
            *([f"parallel={v['parallel']}"] if v["parallel"] is not None else []),
            # as in the names: the defaults (local launcher, no spare) add nothing, so existing cells' jobs stay as they were
            *[f"{k}={v[k]}" for k in ("supervisor.launcher", "supervisor.spares") if v[k] not in (None, "local", 0)],
            *extra]  # nothing from ``repeat``: a repeat is the same run, measured again


if __name__ == "__main__":
    import sys

    try:
        m = load_matrix(sys.argv[1] if len(sys.argv) > 1 else "default")
    except MatrixError as exc:
        sys.exit(f"error: {exc}")
    for c in m.cells:
        print(("* " if c.is_reference else "  ") + f"{c.dir:<32} {c.name}")
    print(f"{len(m.cells)} cells in matrix {m.name} (* = reference run; run directory, then the full name)")
