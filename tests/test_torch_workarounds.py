"""Every use of private torch internals is a declared workaround: listed, refused on an unchecked torch, declared
in the event log when it acts (``resilience.record.torch_workarounds``). A real run's ``result.json`` declaring
them is checked in ``tests/test_sharded.py`` (``torch_workarounds``)."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest
import torch

from resilience.record import torch_workarounds as tw
from resilience.record.events import EventLog, read_events
from resilience.record.metrics import _torch_workarounds

ROOT = Path(__file__).resolve().parent.parent
DECLARED = {"elastic_agent_hooks": "resilience.supervise.elastic", "cuda_sleep_kernel": "injectors.hang",
            "fsdp_custom_reduce_scatter": "resilience.parallel.ordered",
            "pipeline_stage_local_warmup": "resilience.parallel.logged_stage",
            "forget_broken_groups": "resilience.ckpt.replica_shards",
            "dtensor_from_spec": "resilience.ckpt.snapshot",
            "dlrover_engine_internals": "resilience.strategies.dlrover_flash",
            "dcp_daemon_target": "resilience.strategies.dcp_async",
            "nvrx_worker_target": "resilience.strategies.nvrx_async",
            "torch_checkpointing_metadata_gather": "resilience.strategies.torch_checkpointing_ckpt",
            "dlrover_saver_target": "resilience.strategies.dlrover_flash",
            "loader_fork_server": "resilience.data.fork_server"}
# Modules that name a private torch module without relying on anything in it: no workaround to declare.
NOT_WORKAROUNDS = {
    "resilience.bench.cell": "names torch._dynamo and torch._inductor.config only to time their import",
    "resilience.rank.spare": "imports torch._dynamo by name to pay early for the import DDP's constructor makes",
    "resilience.proc.zygote": "names torch._dynamo and torch._inductor.config only to import what a rank imports, "
                              "before its ranks are forked",
    "resilience.proc.pool": "names them too, for the same reason: the pipeline's pool imports what a supervisor "
                            "and its ranks import",
}
PRIVATE_NAME = re.compile(r"\btorch(?:\.\w+)*\._[a-zA-Z]")
PRIVATE_ATTRIBUTES = {"_spec", "_local_tensor", "_pg_registry"}  # private attributes of torch objects met so far


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _docstrings(tree: ast.AST) -> set[int]:
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))]
    return {id(n.body[0].value) for n in nodes if n.body and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant) and isinstance(n.body[0].value.value, str)}


def _overrides_torch_private(cls: ast.ClassDef, imported: dict[str, str]) -> bool:
    """A subclass of a torch class that overrides or calls (``super()._x``) one of its private methods."""
    bases = [imported[b.id] for b in cls.bases
             if isinstance(b, ast.Name) and imported.get(b.id, "").startswith("torch")]
    names = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    names |= {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Call)
              and isinstance(n.value.func, ast.Name) and n.value.func.id == "super"}
    private = {n for n in names if n.startswith("_") and not n.startswith("__")}
    for base in bases:
        module, _, name = base.rpartition(".")
        cls_obj = getattr(importlib.import_module(module), name)
        if any(hasattr(cls_obj, n) for n in private):
            return True
    return False


def touches_torch_internals(path: Path) -> bool:
    """Whether the module's code (docstrings and comments aside) reaches into private torch internals."""
    tree = ast.parse(path.read_text())
    docs, imported = _docstrings(tree), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
            if PRIVATE_NAME.search(node.module + "."):
                return True
        elif isinstance(node, ast.Import) and any(PRIVATE_NAME.search(a.name) for a in node.names):
            return True
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if PRIVATE_NAME.search(node.value):
                return True
        elif isinstance(node, ast.Attribute):
            if node.attr in PRIVATE_ATTRIBUTES or (node.attr == "get_objects" and isinstance(node.value, ast.Name)
                                                   and node.value.id == "gc"):
                return True
            if PRIVATE_NAME.search(ast.unparse(node)):
                return True
    return any(_overrides_torch_private(c, imported) for c in ast.walk(tree) if isinstance(c, ast.ClassDef))


def touching_modules() -> list[str]:
    paths = [p for pkg in ("resilience", "injectors") for p in sorted((ROOT / pkg).rglob("*.py"))]
    return [module_name(p) for p in paths if touches_torch_internals(p)]


def test_the_registry_lists_every_workaround_with_its_reason_and_versions():
    for module in set(DECLARED.values()):
        importlib.import_module(module)
    records = {r.name: r for r in tw.registered()}
    assert {name: r.where for name, r in records.items()} == DECLARED
    for r in records.values():
        assert r.why and r.checked_on and all(re.fullmatch(r"\d+\.\d+\.\d+", v) for v in r.checked_on), r
    assert records["dlrover_engine_internals"].package == "dlrover"


def test_every_module_that_touches_torch_internals_declares_a_workaround():
    found = touching_modules()
    libraries = ("dlrover_engine_internals", "nvrx_worker_target", "dlrover_saver_target",  # not torch's
                 "loader_fork_server", "torch_checkpointing_metadata_gather")
    of_torch = {m for name, m in DECLARED.items() if name not in libraries}
    assert of_torch <= set(found), "the check no longer sees a known use"
    undeclared = sorted(set(found) - set(DECLARED.values()) - set(NOT_WORKAROUNDS))
    assert undeclared == [], "declare a TorchWorkaround in each (resilience/record/torch_workarounds.py)"


def test_the_check_sees_each_kind_of_use(tmp_path):
    uses = ["import torch\ntorch.cuda._sleep(1)\n", "from torch.distributed.fsdp._fully_shard import x\n",
            "import gc\ngc.get_objects()\n", "def f(t):\n    return t._spec\n",
            "from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent\n"
            "class A(LocalElasticAgent):\n    def _monitor_workers(self, g):\n        return None\n"]
    clean = ['"""About torch._dynamo."""\nimport torch\n', "from torch import nn\nclass M(nn.Module):\n"
             "    def _mine(self):\n        return None\n"]
    for i, code in enumerate(uses + clean):
        path = tmp_path / f"m{i}.py"
        path.write_text(code)
        assert touches_torch_internals(path) == (i < len(uses)), code


def test_an_unchecked_torch_is_refused_in_one_line(monkeypatch):
    record = tw.TorchWorkaround("probe", "why", ("2.13.0",), "tests")
    monkeypatch.setattr(torch, "__version__", "2.13.0+cu124")
    record.check()  # a local label is the same release
    monkeypatch.setattr(torch, "__version__", "2.14.0+cpu")
    with pytest.raises(ValueError) as refused:
        record.acted()
    message = str(refused.value)
    assert "\n" not in message and "probe" in message and "2.13.0" in message and "2.14.0+cpu" in message


def test_a_parallel_that_will_reduce_in_rank_order_refuses_an_unchecked_torch_before_launch(monkeypatch):
    from resilience.parallel.fsdp import FullyShardedParallel

    monkeypatch.setattr(torch, "__version__", "2.99.0")
    with pytest.raises(ValueError, match="fsdp_custom_reduce_scatter"):
        FullyShardedParallel(reduce="ordered")
    FullyShardedParallel(reduce="library")  # FSDP's own reduce-scatter: nothing private


def test_an_act_is_declared_once_per_log_and_read_into_the_result(tmp_path, monkeypatch):
    monkeypatch.setattr(tw, "_ACTED", {})
    monkeypatch.setattr(tw, "_DECLARED", set())
    record = tw.TorchWorkaround("probe", "why", (torch.__version__.split("+")[0],), "tests")
    events = EventLog(tmp_path, rank=0, attempt=0)
    record.acted()  # without its log: declared when the rank's log closes
    record.acted()
    tw.declare_acted(events)
    record.acted(events)
    events.close()
    declared = [e for e in read_events(tmp_path) if e["kind"] == tw.EVENT]
    assert [(e["name"], e["version"]) for e in declared] == [("probe", torch.__version__)]
    assert _torch_workarounds(read_events(tmp_path)) == ["probe"]


def test_the_architecture_map_lists_every_workaround():
    for module in set(DECLARED.values()):
        importlib.import_module(module)
    table = tw.markdown(sorted(tw.registered(), key=lambda r: r.name))
    assert table in (ROOT / "docs" / "architecture.md").read_text(), "paste tw.markdown(...) into the section"
