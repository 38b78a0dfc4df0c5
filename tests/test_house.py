"""The house plan holds: rooms import only downward and in no circle, and every option in conf/ builds its role."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from injectors.base import Injector
from resilience import compat
from resilience.config import auto_fault_step
from resilience.config import CONF_DIR
from resilience.detectors.base import Detector
from resilience.caps import base_option
from resilience.parallel.base import Parallelism
from resilience.recovery.base import RecoveryPolicy
from resilience.strategies.base import CheckpointStrategy
from resilience.workloads.base import Workload

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("resilience", "injectors", "reports")

# The floors, from the ground up: a module may import from its own floor or below, never from above. Commands
# (what a user runs) are the top floor; nothing beneath imports them.
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("ground", ("resilience.settings", "resilience.caps", "resilience.compat", "resilience.proc", "resilience.state",
                "resilience.record", "resilience.workloads", "resilience.data",
                # the interval formulas, numpy alone: the projection's and checkpoint.every=auto's (one place)
                "resilience.projection.intervals")),
    ("services", ("resilience.runtime", "resilience.ckpt")),
    ("roles", ("resilience.strategies", "resilience.detectors", "resilience.recovery", "resilience.parallel",
               "resilience.libs", "injectors")),
    ("assembly", ("resilience.roles", "resilience.config")),
    ("processes", ("resilience.rank", "resilience.supervise")),
    ("commands", ("resilience.__main__", "resilience.result", "resilience.trace", "resilience.bench",
                  "resilience.projection", "reports")),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``path`` imports, anywhere in the file (function-level imports count too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        for name in import_names(node):
            if owner := project_owner(name, modules):
                found.add(owner)
                break
    return found


def import_names(node: ast.AST) -> list[str]:
    """The dotted names an import statement imports, the most specific first (``a.b.c`` before ``a.b``)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        return [f"{node.module}.{a.name}" for a in node.names] + [node.module]
    return []


def project_owner(name: str, modules: dict[str, Path]) -> str:
    """The project module ``name`` lies in (itself or its nearest package), or '' for a name from outside."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name


def floor_of(module: str) -> int:
    for level, (_, prefixes) in enumerate(FLOORS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return level
    raise AssertionError(f"{module}: on no floor of the plan; add its room to FLOORS")


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {m: imports_of(p, modules) - {m} for m, p in modules.items()}


def test_every_module_is_on_a_floor_and_imports_only_downward(graph):
    upward = [f"{m} ({FLOORS[floor_of(m)][0]}) imports {d} ({FLOORS[floor_of(d)][0]})"
              for m, deps in graph.items() for d in deps if floor_of(d) > floor_of(m)]
    assert upward == []


def test_no_import_circle(graph):
    # Tarjan's strongly connected components: a component of more than one module is a circle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        for d in graph.get(m, ()):
            if d not in index:
                visit(d)
                low[m] = min(low[m], low[d])
            elif d in stack:
                low[m] = min(low[m], index[d])
        if low[m] == index[m]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == m:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    assert circles == []


def test_the_check_sees_an_upward_import(tmp_path):
    """The layering check is not vacuous: a role importing the supervisor is found."""
    bad = tmp_path / "bad.py"
    bad.write_text("from resilience.supervise.supervisor import Supervisor\n")
    deps = imports_of(bad, project_modules())
    assert deps == {"resilience.supervise.supervisor"} and floor_of("resilience.supervise.supervisor") > \
        floor_of("resilience.strategies.sync")


BASES = {"strategy": CheckpointStrategy, "fault": Injector, "detector": Detector, "recovery": RecoveryPolicy,
         "workload": Workload, "parallel": Parallelism}


def options() -> list[tuple[str, str]]:
    return [(group, p.stem) for group in BASES for p in sorted((CONF_DIR / group).glob("*.yaml"))]


# Options that refuse to build without a setting of another group (their one-line error says which).
NEEDS = {("recovery", "grow"): ["fault=node_loss", "fault.return_after_s=5"]}


@pytest.mark.parametrize(("group", "option"), options())
def test_every_option_builds_its_role_under_its_own_name(group, option):
    """A new YAML in conf/<group>/ is checked here without touching any test."""
    key = "detector" if group == "detector" else group
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        overrides = [f"detector=[{option}]"] if group == "detector" else [f"{key}={option}"]
        overrides += NEEDS.get((group, option), [])
        cfg = compose(config_name="config", overrides=overrides)
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    if group == "fault" and cfg.fault.at_step == "auto":  # resolved by the command (resilience.config)
        cfg.fault.at_step = auto_fault_step(cfg)
    node = cfg.detectors[option] if group == "detector" else cfg[group]
    extra = {"strategy": {"every": cfg.checkpoint.every, "keep": cfg.checkpoint.keep},
             "workload": {"seed": cfg.seed}}.get(group, {})
    role = instantiate(node, **extra)
    assert isinstance(role, BASES[group])
    if group == "fault":
        role.validate(int(cfg.world_size), int(cfg.steps), cfg.checkpoint.every)
    if group != "workload":  # a workload is named by its YAML alone (two options share the GPT class)
        assert role.name == variant_of(group, option)
    # what the table of rules reads of the option without building it is what the built role declares
    assert role.caps == compat.options(group)[option].caps


def variant_of(group: str, option: str) -> str:
    """The option that ``option`` is a variant of (``dcp_async_staged`` is ``dcp_async`` with other settings)."""
    return base_option(CONF_DIR / group, option)


# The bases that option modules share; every other module of resilience/strategies/ is an option's.
STRATEGY_BASES = {"base", "background", "interval"}  # interval: when every option saves


def test_the_strategies_room_holds_the_options_and_their_bases_alone():
    """Library adapters live in resilience/libs/, replica mechanics in resilience/ckpt/: ``ls`` reads as the menu."""
    targets = {OmegaConf.load(p).get("_target_") for p in (CONF_DIR / "strategy").glob("*.yaml")} - {None}
    option_modules = {t.rsplit(".", 1)[0].rpartition(".")[2] for t in targets}
    modules = {p.stem for p in (ROOT / "resilience" / "strategies").glob("*.py")} - {"__init__"}
    assert modules - STRATEGY_BASES == option_modules


# What a supervisor imports to validate a run and start its ranks: the command, the roles, the supervisors.
SUPERVISOR = ("resilience.__main__", "resilience.roles", "resilience.supervise.elastic",
              "resilience.supervise.replacing", "resilience.supervise.torchrun", "resilience.supervise.ft_launcher")
DCP = "torch.distributed.checkpoint"
# dcp_async's library is DCP itself: its supervisor imports it to check it is installed (PeerStrategy.check_host)
DCP_IN_SUPERVISOR = {"resilience.strategies.dcp_async"}


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


@functools.cache
def imports_on_import(path: Path) -> tuple[str, ...]:
    """The names a module imports as it is imported: its top-level statements' (within their ``if``/``try``
    blocks too), not its functions' nor an ``if TYPE_CHECKING`` block's."""
    names: list[str] = []

    def walk(body: list[ast.stmt]) -> None:
        for node in body:
            names.extend(import_names(node))
            if isinstance(node, ast.If) and not _type_checking(node.test):
                walk(node.body)
                walk(node.orelse)
            elif isinstance(node, ast.Try):
                for block in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                    walk(block)

    walk(ast.parse(path.read_text()).body)
    return tuple(names)


def outside_imports(roots: list[str], modules: dict[str, Path]) -> set[str]:
    """The names outside the project that importing ``roots`` imports through the project's own modules (what
    those outside packages import in turn is not followed)."""
    seen: set[str] = set()
    todo, outside = list(roots), set()
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        parts = module.split(".")
        todo.extend(p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in modules)  # its packages
        for name in imports_on_import(modules[module]):
            if found := project_owner(name, modules):
                todo.append(found)
            else:
                outside.add(name)
    return outside


def role_modules() -> list[str]:
    """The modules of our classes that options in conf/ name (``_target_``)."""
    targets = {m.group(1) for p in CONF_DIR.rglob("*.yaml")
               for m in re.finditer(r"^\s*_target_:\s*(\S+)", p.read_text(), re.MULTILINE)}
    return sorted({t.rpartition(".")[0] for t in targets if t.startswith(("resilience.", "injectors."))})


def test_the_supervisor_validates_every_role_without_importing_dcp():
    """The supervisor builds a run's roles to validate it: DCP (~0.4 s of its start) is the ranks', imported where
    they use it (``resilience.ckpt.dcp_files``, ``injectors.faulty_fs``), never at the top of a module that building
    a role imports. Static: our modules' top-level imports (torch's own are not followed)."""
    modules = project_modules()
    with_dcp = {m for m in role_modules()
                if any(n == DCP or n.startswith(DCP + ".") for n in outside_imports([*SUPERVISOR, m], modules))}
    assert with_dcp == DCP_IN_SUPERVISOR
