"""The event log's contract: every kind emitted or read in the project is catalogued, every emit site passes its
kind's required fields, ``emit`` refuses the rest, and the shared readers compute each quantity by hand."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from resilience.record import catalogue
from resilience.record.events import EventLog, read_events
from resilience.record.query import (durable_times, load_window, loads, productive_step_times, recovery_window,
                                     stalls, step_start, step_times)

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("resilience", "injectors", "reports")
# A kind compared with (``e["kind"] == "x"``, ``kind in ("x", "y")``) or looked up (``first(events, "x")``,
# ``spans(events, "x", "y")``).
READ = re.compile(r'(?:\["kind"\]|\bkind)\s*(?:==|!=)\s*("\w+")|\bkind"?\]?\s+in\s+\(([^)]*)\)'
                  r'|\bfirst\([^,()]+,\s*("\w+")|\bspans\([^,()]+,\s*("\w+",\s*"\w+")')


def sources() -> list[Path]:
    return [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]


def module_of(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def emit_sites() -> list[tuple[str, str, set[str], bool]]:
    """(where, kind, keywords, has **splat) of every ``.emit(kind, ...)`` call; a kind held in a module-level
    constant is resolved, and its module imported (where a kind of its own registers)."""
    sites = []
    for path in sources():
        tree = ast.parse(path.read_text())
        constants = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                     and isinstance(n.value, ast.Constant) for t in n.targets if isinstance(t, ast.Name)}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "emit"):
                continue
            where, arg = f"{path.relative_to(ROOT)}:{node.lineno}", node.args[0] if node.args else None
            if isinstance(arg, ast.Name) and arg.id in constants:
                importlib.import_module(module_of(path))
                kind = constants[arg.id]
            else:
                assert isinstance(arg, ast.Constant), f"{where}: emit's kind is neither a literal nor a constant"
                kind = arg.value
            keywords = {k.arg for k in node.keywords if k.arg is not None}
            sites.append((where, kind, keywords, any(k.arg is None for k in node.keywords)))
    return sites


def test_every_emitted_kind_is_catalogued_and_every_site_passes_its_required_fields():
    sites = emit_sites()
    assert len(sites) > 60
    for where, kind, keywords, splat in sites:
        required = catalogue.lookup(kind).fields  # ValueError naming the kind if it is not catalogued
        missing = set(required) - keywords
        assert not missing or splat, f"{where}: {kind} without its required field(s) {sorted(missing)}"


def test_every_kind_a_reader_asks_for_is_catalogued():
    read = set()
    for path in sources():
        for found in READ.findall(path.read_text()):
            read |= set(re.findall(r'"(\w+)"', " ".join(found)))
    assert {"step_end", "ckpt_begin", "ckpt_stall_end", "fault_injected"} <= read
    assert not read - {k.name for k in catalogue.kinds()}


def test_only_the_base_save_ends_a_stall():
    """The base ``save`` emits ``ckpt_stall_end``; a strategy whose stall ends earlier calls ``end_stall``."""
    emitting = {where.split(":")[0] for where, kind, _, _ in emit_sites() if kind == "ckpt_stall_end"}
    assert emitting == {"resilience/strategies/base.py"}


def test_emit_refuses_an_uncatalogued_kind_and_a_missing_field(tmp_path):
    log = EventLog(tmp_path, 0, 0)
    with pytest.raises(ValueError, match="'no_such_kind' is not in the event catalogue"):
        log.emit("no_such_kind", step=1)
    with pytest.raises(ValueError, match="'ckpt_loaded' lacks its required field.* bytes, duration_s"):
        log.emit("ckpt_loaded", step=1, source="disk")
    log.emit("ckpt_begin", step=1)
    log.close()
    assert [e["kind"] for e in read_events(tmp_path)] == ["ckpt_begin"]


def test_a_plug_in_registers_a_kind_of_its_own(tmp_path, monkeypatch):
    monkeypatch.setattr(catalogue, "_KINDS", dict(catalogue._KINDS))
    kind = catalogue.register("throwaway_saved", ("strategy",), ("bytes",), "a throw-away plug-in's record")
    assert catalogue.register("throwaway_saved", ("strategy",), ("bytes",), "a throw-away plug-in's record") == kind
    with pytest.raises(ValueError, match="already catalogued differently"):
        catalogue.register("throwaway_saved", ("strategy",), (), "another meaning")
    with pytest.raises(ValueError, match="emitters"):
        catalogue.register("throwaway_other", ("someone",), (), "an emitter the catalogue does not know")
    log = EventLog(tmp_path, 0, 0)
    log.emit("throwaway_saved", step=2, bytes=10)
    log.close()
    assert read_events(tmp_path)[0]["bytes"] == 10


def test_the_architecture_map_lists_every_catalogued_kind():
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("## The event catalogue"):]
    assert not [k.name for k in catalogue.kinds() if f"`{k.name}`" not in section]


# --- the shared readers, on a hand-made log -------------------------------------------------------------------

def ev(t, kind, rank=0, attempt=0, step=0, **kw):
    return {"t_mono": t, "t_wall": t + 100, "kind": kind, "rank": rank, "attempt": attempt, "step": step, **kw}


LOG = [
    ev(0.0, "launch", rank=None),
    ev(1.0, "run_start"), ev(1.0, "run_start", rank=1),
    ev(1.5, "step_end", step=1, duration_s=0.5),
    ev(1.6, "ckpt_begin", step=1), ev(1.6, "ckpt_begin", rank=1, step=1),
    ev(1.8, "ckpt_stall_end", step=1), ev(1.9, "ckpt_stall_end", rank=1, step=1),
    ev(2.4, "step_end", step=2, duration_s=0.5),
    ev(2.5, "ckpt_durable", step=1, bytes=10),  # asynchronous: durable after the next step
    ev(2.6, "ckpt_begin", step=2),  # skipped (when_busy=skip): no end, no stall
    ev(3.0, "step_end", step=3, duration_s=0.4),
    ev(3.1, "ckpt_begin", rank=1, step=3),  # rank 1 dies in this save: no end either
    ev(3.2, "fault_injected", rank=1, step=3),
    ev(3.3, "fault_detected", rank=None, detector="process_exit", blamed_rank=1),
    ev(3.4, "restart", rank=None, attempt=1, ranks=[1]),
    ev(4.0, "run_start", rank=1, attempt=1),
    ev(4.5, "ckpt_loaded", rank=1, attempt=1, step=1, source="disk", bytes=10, duration_s=0.4),
    ev(4.6, "ckpt_loaded", attempt=1, step=1, source="disk", bytes=10, duration_s=0.2),
    ev(5.0, "step_end", rank=1, attempt=1, step=2, duration_s=0.3),
    ev(5.4, "step_end", attempt=1, step=2, duration_s=0.3),
    ev(5.6, "step_end", rank=1, attempt=1, step=3, duration_s=0.5),
    ev(5.6, "resumed", rank=1, attempt=1, step=3),
]


def test_a_stall_and_a_durable_time_are_per_save_from_its_begin():
    assert [(s.rank, s.step, round(s.seconds, 6)) for s in stalls(LOG)] == [(0, 1, 0.2), (1, 1, 0.3)]
    assert [(s.rank, round(s.seconds, 6), s.closing["bytes"]) for s in durable_times(LOG)] == [(0, 0.9, 10)]
    assert [round(s.seconds, 6) for s in stalls(LOG, clock="t_wall")] == [0.2, 0.3]


def test_step_times_and_each_step_once():
    rank0 = [e for e in LOG if e["rank"] == 0]
    assert step_times(rank0) == [0.5, 0.5, 0.4, 0.3]
    assert productive_step_times(rank0) == {1: 0.5, 2: 0.3, 3: 0.4}  # step 2 replayed: the later attempt's time
    assert step_start(LOG[3]) == 1.0


def test_a_load_is_its_critical_path_over_the_ranks():
    got = loads(LOG, attempt=1, since=3.2)
    assert len(got) == 2 and loads(LOG, attempt=0) == []
    start, end = load_window(got)
    assert (round(start, 6), end) == (4.4, 4.6)  # the later starter (rank 0) to the last one done
    assert load_window([]) is None


def test_a_recovery_window_follows_the_replaced_rank():
    fault = next(e for e in LOG if e["kind"] == "fault_injected")
    w = recovery_window(LOG, fault)
    assert w.detection["t_mono"] == 3.3 and w.restart["t_mono"] == 3.4 and w.start["rank"] == 1
    assert (w.loaded["t_mono"], w.ready["t_mono"], w.first_step["t_mono"], w.resumed["t_mono"]) == (4.5, 4.5, 5.0, 5.6)
    assert w.lost_steps == 2
    assert recovery_window(LOG[:-8], fault) is None  # nobody started again


def test_the_catalogue_in_the_docs_is_the_catalogue():
    import resilience.record.torch_workarounds  # noqa: F401 - registers its kind, as a run's import does

    assert catalogue.markdown().strip() in (ROOT / "docs" / "architecture.md").read_text()
