"""Aggregation and the HTML report from fixture runs (tests/fixtures: four real smoke runs, one failed, one invalid)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pandas as pd
import pytest

from reports import registry
from reports.aggregate import main as aggregate_main
from reports.aggregate import summarize
from reports.matrix import load_matrix
from reports.project import project
from reports.render import render

FIXTURES = Path(__file__).resolve().parent / "fixtures"
SECTIONS = ("headline", "recovery_breakdown", "ckpt_overhead", "detection", "timeline", "environment", "methods",
            "projection")
LIMITS = {"probed": True, "write_GBps": 0.5, "read_GBps": 1.0, "memcpy_GBps": 10.0, "rank_start_s": 2.0}


@pytest.fixture
def runs(tmp_path) -> Path:
    """A writable copy of the fixture runs."""
    shutil.copytree(FIXTURES / "runs", tmp_path / "runs")
    return tmp_path / "runs"


@pytest.fixture
def summary(runs) -> pd.DataFrame:
    return summarize(load_matrix(str(FIXTURES / "matrix.yaml")), sorted(runs.glob("*/done.json")))


@pytest.mark.timeout(60)
def test_summary_has_one_row_per_cell_in_matrix_order_with_flattened_results(summary):
    matrix = load_matrix(str(FIXTURES / "matrix.yaml"))
    assert list(summary["cell"]) == [c.name for c in matrix.cells]
    assert summary["state"].value_counts().to_dict() == {"ok": 4, "failed": 1, "invalid": 1}
    for column in ("recovery_breakdown_s.load", "recovery_breakdown_s.detect", "final_state_sha256", "goodput",
                   "cell.strategy", "cell.fault_label", "cell.fault.phase", "cell.checkpoint.every", "run_dir",
                   "exit_code", "error", "is_reference", "reference_cell", "matches_reference"):
        assert column in summary, column
    ok = summary[summary["state"] == "ok"]
    assert ok["matches_reference"].tolist() == [True] * 4
    bad = summary[summary["state"] != "ok"]
    assert bad["matches_reference"].isna().all()
    assert set(bad["exit_code"]) == {1, 2}
    assert summary.loc[summary["state"] == "invalid", "error"].item().endswith("must be in [0, 11] for steps=12")


@pytest.mark.timeout(60)
def test_matches_reference_is_false_when_the_final_state_differs(runs):
    hit = next(runs.glob("gpt_tiny-sync-kill.phase=before_forward.at_step=7*/result.json"))
    result = json.loads(hit.read_text())
    result["final_state_sha256"] = "0" * 64
    hit.write_text(json.dumps(result))
    frame = summarize(load_matrix(str(FIXTURES / "matrix.yaml")), sorted(runs.glob("*/done.json")))
    verdict = dict(zip(frame["cell"], frame["matches_reference"]))
    assert verdict[hit.parent.name] is False
    assert sum(v is True for v in verdict.values()) == 3


@pytest.mark.timeout(60)
def test_aggregate_command_writes_the_csv(runs, tmp_path):
    out = tmp_path / "summary.csv"
    assert aggregate_main([str(FIXTURES / "matrix.yaml"), str(out), *map(str, runs.glob("*/done.json"))]) == 0
    assert len(pd.read_csv(out)) == 6
    assert not list(tmp_path.glob(".summary.csv.tmp*"))  # written atomically: no temp file left


def _render(summary: pd.DataFrame, out: Path, limits: dict, projection: Path | None = None,
            chaos: Path | None = None) -> str:
    info = {"name": "fixture", "source": "tests/fixtures/matrix.yaml", "description": "fixture runs"}
    env = {"cpu_model": "test CPU", "torch_version": "2.13.0+cpu"}
    return render(summary, out / "index.html", info, limits, env, projection, chaos).read_text()


def _rendered_once(root: Path, limits: dict, chaos: Path, probe: list[str] | None = None) -> tuple[str, Path]:
    """The fixture runs' report in ``root/report``; ``probe``: the snapshot each cell ran under, in summary order."""
    shutil.copytree(FIXTURES / "runs", root / "runs")
    summary = summarize(load_matrix(str(FIXTURES / "matrix.yaml")), sorted((root / "runs").glob("*/done.json")))
    if probe is not None:
        summary = summary.assign(probe=probe)
    return _render(summary, root / "report", limits, chaos=chaos), root / "report"


CHAOS_TABLE = "| strategy | crash points | PASS | HARD_FAIL |\n|---|---|---|---|\n| sync | 8 | 8 | 0 |\n"


# Where and when ``LIMITS`` were measured, as a pipeline's limits.json says (reports/limits.py), and the snapshot
# each of the 6 fixture cells ran under: the first under another one.
WHERE = {"host": "node7", "dir": "/scratch/rb/probe/S1", "measured_at": 1.7e9, "snapshot": "S1"}
PROBES = ["S0"] + ["S1"] * 5


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> tuple[str, Path]:
    """The fixture runs' report with ``LIMITS`` (and where and when they were measured: ``WHERE``, ``PROBES``) and no
    projection, rendered once (1-2 s a rendering) for the tests that only read it: its HTML and its folder. Its
    ckpt-chaos table is named, as the pipeline names it, where the bench has not written one."""
    root = tmp_path_factory.mktemp("report")
    return _rendered_once(root, {**LIMITS, **WHERE}, root / "missing.md", PROBES)


@pytest.fixture(scope="module")
def unprobed(tmp_path_factory) -> str:
    """The fixture runs' report with no limits probed and no projection, beside a ckpt-chaos table the bench wrote,
    rendered once for the tests that read it (each reads its own sections): its HTML."""
    root = tmp_path_factory.mktemp("unprobed")
    (root / "chaos.md").write_text(CHAOS_TABLE)
    return _rendered_once(root, {"probed": False, "reason": "no probe"}, root / "chaos.md")[0]


@pytest.mark.timeout(120)
def test_report_renders_every_section_self_contained(report):
    html, folder = report
    for anchor in SECTIONS:
        assert f'id="{anchor}"' in html, anchor
    images = re.findall(r'<img [^>]*src="([^"]*)"', html)
    assert len(images) >= 4 and all(src.startswith("data:image/png;base64,") for src in images)
    assert not re.search(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", html, re.IGNORECASE)
    assert "<link" not in html and "<script" not in html
    for name in ("recovery_breakdown", "ckpt_overhead", "detection", "timeline"):
        assert (folder / f"fig_{name}.png").stat().st_size > 1000
        assert len(pd.read_csv(folder / f"{name}.csv")) > 0, name
    for name in ("headline_strategies", "headline_faults", "environment", "inventory"):
        assert (folder / f"{name}.csv").exists()
    breakdown = pd.read_csv(folder / "recovery_breakdown.csv")  # every median with its n and interval
    assert breakdown["recovery_time_s_n"].min() >= 1 and breakdown["recovery_time_s_low"].notna().all()
    assert breakdown["restart_n"].min() >= 1 and breakdown["restart_low"].notna().all()  # each phase too
    assert "n=" in pd.read_csv(folder / "ckpt_overhead.csv")["runs"].iloc[0]
    detection = pd.read_csv(folder / "detection.csv")  # coverage and latency each with n and CI
    hit = detection[detection["detected"] > 0]
    assert len(hit) and (hit["latency_s_n"] == hit["detected"]).all() and hit["latency_s_level"].notna().all()
    assert detection["coverage_low"].notna().all() and (detection["coverage_high"] <= 1).all()


@pytest.mark.timeout(120)
def test_report_shows_failures_limits_ratios_and_methods(report):
    html, folder = report
    assert "2 cell(s) did not produce a usable result" in html
    assert "fault.at_step=20: must be in [0, 11] for steps=12" in html
    assert "mismatched input" in html  # the failed cell's log tail
    strategies = pd.read_csv(folder / "headline_strategies.csv").set_index("strategy")
    sync = strategies.loc["sync"]
    assert sync["write_pct_of_disk"] == pytest.approx(100 * sync["write_MBps"] / 500)
    faults = pd.read_csv(folder / "headline_faults.csv")
    none_kill = faults[(faults["strategy"] == "none")].iloc[0]
    assert none_kill["lost_steps"] == 7 and none_kill["lost_steps_vs_sync"] == pytest.approx(7 / 3)
    assert "vs sync" in html
    assert "goodput" in html and "Productive step time over wall time" in html
    assert "Model output, not a measurement" in html


@pytest.mark.timeout(120)
def test_report_without_limits_or_projection_says_so(unprobed):
    html = unprobed
    assert html.count("not probed") >= 4
    assert "disk bandwidth not probed" in html
    assert "Not run." in html


@pytest.mark.timeout(120)
def test_projection_that_cannot_run_leaves_labelled_placeholders(tmp_path):
    bad = tmp_path / "summary.csv"
    bad.write_text("strategy,ckpt_bytes\nsync,100\n")  # no ckpt_stall_s: the projection rejects it (exit 2)
    status = project(bad, tmp_path / "projection" / "projection_status.json")
    assert not status["ok"] and "ckpt_stall_s" in status["error"]
    for name in ("goodput_vs_interval", "goodput_vs_cluster", "winner_heatmap"):
        assert (tmp_path / "projection" / f"projection_{name}.png").stat().st_size > 1000
    frame = pd.DataFrame({"cell": [], "state": []})
    html = _render(frame, tmp_path / "report", LIMITS, tmp_path / "projection" / "projection_status.json")
    assert "The projection could not run" in html and "ckpt_stall_s" in html


def test_a_figure_registered_from_outside_is_drawn_listed_and_declared(summary, tmp_path, monkeypatch):
    """Adding a report figure takes one function and one registry entry, nothing else."""
    import matplotlib.pyplot as plt

    def steps_per_cell(frame: pd.DataFrame):
        data = pd.DataFrame({"cell": frame["cell"], "steps": frame["steps_completed"]})
        fig, ax = plt.subplots()
        ax.bar(range(len(data)), data["steps"])
        return fig, data

    monkeypatch.setattr(registry, "MEASURED", dict(registry.MEASURED))  # the registration ends with the test
    registry.register(registry.Measured("steps_per_cell", "Steps per cell", steps_per_cell,
                                        caption="Throw-away: completed steps of each cell."))
    html = _render(summary, tmp_path / "report", LIMITS)
    assert 'id="steps_per_cell"' in html and 'href="#steps_per_cell"' in html
    assert "Throw-away: completed steps of each cell." in html
    assert (tmp_path / "report" / "fig_steps_per_cell.png").exists()
    assert len(pd.read_csv(tmp_path / "report" / "steps_per_cell.csv")) == len(summary)
    assert "steps_per_cell" in registry.report_tables()  # what the Snakefile declares as the report's outputs


@pytest.mark.parametrize("name, caption, refused", [
    ("inventory", "text", "taken by the report's own"), ("Bad Name", "text", "lower-case"),
    ("uncaptioned", None, "no caption")])
def test_a_figure_that_would_break_the_report_is_refused_at_registration(monkeypatch, name, caption, refused):
    monkeypatch.setattr(registry, "MEASURED", dict(registry.MEASURED))
    with pytest.raises(ValueError, match=refused):
        registry.register(registry.Measured(name, "title", "reports.figures:detection", caption=caption))


@pytest.mark.timeout(120)
def test_counts_are_of_what_the_matrix_asked_for_and_unmeasured_rows_stay(runs, tmp_path):
    """Cells without a done.json are "not run"; a strategy or fault with no ok cell keeps its row and says why."""
    matrix = load_matrix(str(FIXTURES / "matrix.yaml"))
    partial = summarize(matrix, sorted(runs.glob("gpt_tiny-none-*/done.json")))  # sync's cells never ran
    assert len(partial) == 6 and (partial["state"] == "not run").sum() == 3
    html = _render(partial, tmp_path / "report", LIMITS)
    assert "3 of 6 cells finished (" in html and "2 ok" in html and "1 failed" in html and "3 not run" in html
    assert "3 cell(s) of the matrix have not run" in html and "Every cell produced a result" not in html
    strategies = pd.read_csv(tmp_path / "report" / "headline_strategies.csv").set_index("strategy")
    assert strategies.loc["sync", "note"] == "not measured (not run)" and strategies.loc["sync", "cells"] == 3
    assert strategies.loc["sync", "runs"] == 0 and pd.isna(strategies.loc["none", "note"])
    faults = pd.read_csv(tmp_path / "report" / "headline_faults.csv")
    notes = dict(zip(faults["strategy"] + " " + faults["fault"], faults["note"]))
    assert notes["none kill.phase=before_optimizer_step.at_step=5.rank=0"] == "not measured (failed)"
    assert notes["sync kill.phase=before_forward.at_step=20.rank=1"] == "not measured (not run)"
    inventory = pd.read_csv(tmp_path / "report" / "inventory.csv")
    assert list(inventory["state"][:4]) == ["failed", "not run", "not run", "not run"]


@pytest.mark.timeout(120)
def test_an_invalid_cell_is_not_measured_for_an_error(report):
    faults = pd.read_csv(report[1] / "headline_faults.csv")
    row = faults[(faults["strategy"] == "sync") & faults["fault"].str.contains("at_step=20")].iloc[0]
    assert row["note"] == "not measured (error)" and row["cells"] == 1 and row["runs"] == 1


@pytest.mark.timeout(120)
def test_report_command_counts_cells_the_summary_lacks(runs, tmp_path):
    """A summary older than its matrix: the report counts the matrix's cells, the missing ones as not run."""
    from reports.__main__ import main as report_main

    matrix = load_matrix(str(FIXTURES / "matrix.yaml"))
    done = sorted(runs.glob("gpt_tiny-none-*/done.json"))
    old = summarize(matrix, done)
    old = old[old["state"] != "not run"]
    old.to_csv(tmp_path / "summary.csv", index=False)
    out = tmp_path / "report" / "index.html"
    assert report_main([str(tmp_path / "summary.csv"), "--matrix", str(FIXTURES / "matrix.yaml"),
                        "--out", str(out)]) == 0
    assert "3 of 6 cells finished" in out.read_text()


def test_the_pipeline_takes_a_new_limits_snapshot_only_when_cells_are_about_to_run(tmp_path):
    from reports.limits import snapshot_dir

    first = snapshot_dir(tmp_path, cells_to_run=False, max_age_s=0, now=1e9)
    assert first.parent == tmp_path / "probe" and first.name == "20010909T014640Z"
    first.mkdir(parents=True)
    (first / "limits.json").write_text("{}")
    assert snapshot_dir(tmp_path, cells_to_run=False, max_age_s=0) == first  # nothing to measure: keep it
    assert snapshot_dir(tmp_path, cells_to_run=True, max_age_s=3600) == first  # young enough
    assert snapshot_dir(tmp_path, cells_to_run=True, max_age_s=0, now=2e9) != first  # cells to run: probe anew


def test_a_cell_records_the_snapshot_of_its_pipeline_run(monkeypatch):
    from reports.cell import probe_snapshot

    monkeypatch.delenv("RB_PROBE", raising=False)
    assert probe_snapshot() is None
    monkeypatch.setenv("RB_PROBE", "results/probe/20250101T000000Z")
    assert probe_snapshot() == "20250101T000000Z"


@pytest.mark.timeout(120)
def test_report_says_where_and_when_the_limits_were_measured(report):
    html, folder = report  # limits of host node7's snapshot S1; the first cell ran under S0
    assert "Limits measured on node7 in /scratch/rb/probe/S1 at " in html and "(probe snapshot S1)" in html
    assert "1 of 6 finished cells ran under another snapshot (S0)" in html
    env = pd.read_csv(folder / "environment.csv")
    assert "snapshot" in set(env["key"]) and "(median of the runs" not in html


def test_torchruns_and_nvrxs_restarts_are_rows_of_their_own_compared_with_our_restart():
    from reports.tables import headline_faults, way

    kill = "kill.phase=before_forward"
    rows = [{"cell": f"c{i}", "cell.strategy": "sync", "cell.fault": "kill", "cell.fault_label": kill,
             "cell.recovery": rec, "cell.supervisor.launcher": launcher, "state": "ok", "status": "ok",
             "recovered": True, "recovery_time_s": t, "lost_steps": 3, "goodput": 0.2, "matches_reference": True}
            for i, (rec, launcher, t) in enumerate([("restart", "local", 2.0), ("restart", "local", 2.2),
                                                    ("restart", "torchrun", 3.0), ("nvrx_inprocess", "local", 1.0)])]
    frame = pd.DataFrame(rows)
    assert list(way(frame)) == ["sync", "sync", "sync (torchrun)", "sync (nvrx_inprocess)"]
    table = headline_faults(frame).set_index("strategy")
    assert table.loc["sync", "recovery_time_s"] == pytest.approx(2.1)  # ours alone, not torchrun's mixed in
    assert table.loc["sync (torchrun)", "recovery_time_s_vs_sync"] == pytest.approx(3.0 / 2.1)


def test_a_run_that_cannot_match_by_design_is_counted_apart_not_as_a_no():
    """A shrunk run trained at another world size and a torchft run at reduced width cannot end on the reference's
    state: the bit-exact column says so instead of "no" (the sharded matrix's shrink cells read "no (2 of 6)")."""
    from reports.tables import bit_exact

    shrunk = '[{"direction": "down", "world_size": 2, "previous": 4, "step": 10}]'
    rows = pd.DataFrame({"matches_reference": [True, True, False, False],
                         "world_resizes": [None, None, shrunk, None],
                         "bit_exact": [None, None, None, "not by design"]})
    assert bit_exact(rows) == "yes; 2 not by design (world size or width changed)"
    assert bit_exact(rows.iloc[2:]) == "2 not by design (world size or width changed)"
    rows.loc[1, "matches_reference"] = False
    assert bit_exact(rows).startswith("no (1 of 2)")
    assert bit_exact(pd.DataFrame({"matches_reference": [True]})) == "yes"


def test_an_unrecovered_run_is_counted_apart_with_its_reason_not_as_not_bit_exact():
    """replica under NVRx's hang detection loses both ranks (docs/recovery_peers.md): the row says unrecovered, and
    why, instead of "NOT bit-exact"; its lost steps and final loss stay out of the medians; the inventory shows why."""
    from reports.recovery_peers import recovery_peers_table
    from reports.tables import inventory
    from resilience.supervise.replacing import NOTHING_TO_RECOVER as why  # what result.json's unrecoverable says

    base = {"cell.fault": "hang", "cell.fault_label": "hang.stall", "cell.detectors": "nvrx_heartbeat",
            "is_reference": False, "detector": "nvrx_heartbeat", "detection_latency_s": 3.0}
    runs = [{**base, "cell": "r0", "cell.strategy": "replica", "state": "unrecovered", "status": "unrecovered",
             "unrecoverable": why, "lost_steps": 13, "final_loss": 9.0},
            {**base, "cell": "r1", "cell.strategy": "replica", "state": "unrecovered", "status": "unrecovered",
             "unrecoverable": why, "lost_steps": 13, "final_loss": 9.0},
            {**base, "cell": "s0", "cell.strategy": "sync", "state": "ok", "status": "ok", "lost_steps": 3,
             "final_loss": 1.0, "matches_reference": True, "recovery_time_s": 6.0},
            {**base, "cell": "s1", "cell.strategy": "sync", "state": "ok", "status": "ok", "lost_steps": 5,
             "final_loss": 1.0, "matches_reference": False, "recovery_time_s": 7.0},
            {**base, "cell": "s2", "cell.strategy": "sync", "state": "failed", "status": None, "error": "boom"}]
    table = recovery_peers_table(pd.DataFrame(runs)).set_index("way")
    replica, sync = table.loc["replica (NVRx detects)"], table.loc["sync (NVRx detects)"]
    assert replica["verdict"] == f"unrecovered in 2/2 (not recoverable: {why})"
    assert pd.isna(replica["lost_steps"]) and pd.isna(replica["recovery_s"])
    assert replica["detection_s"] == pytest.approx(3.0)  # the fault was still detected
    assert sync["verdict"] == "failed in 1/3; NOT bit-exact in 1/2"
    assert sync["lost_steps"] == pytest.approx(4.0)
    inv = inventory(pd.DataFrame(runs)).set_index("cell")
    assert inv.loc["r0", "error"] == why and inv.loc["s2", "error"] == "boom" and pd.isna(inv.loc["s0", "error"])


@pytest.mark.timeout(180)
def test_a_scenario_that_is_none_is_one_line(tmp_path, capsys):
    """``--config scenario=PATH`` (reports.scenario_choice): a name that is neither a built-in nor a YAML's path says
    so in one line, exit 2. A YAML of the user's own, projected: tests/test_pipeline.py's smoke matrix end to end."""
    from reports import project as project_cmd
    from reports.scenario_choice import ScenarioError, chosen

    with pytest.raises(ScenarioError, match=r"scenario=nope: must be one of .*llama3_405b"):
        chosen("nope")
    assert project_cmd.main([str(tmp_path / "summary.csv"), str(tmp_path / "p2" / "s.json"), "nope"]) == 2
    assert capsys.readouterr().err.startswith("error: scenario=nope: must be one of")


def test_the_ckpt_chaos_table_is_in_the_report_when_the_bench_wrote_it(unprobed, report):
    """Both reports rendered once for the module (``unprobed``: the bench wrote the table; ``report``: it did not)."""
    html = unprobed
    section = html[html.index('<section id="chaos"'):]
    body = section[:section.index("</section>")]
    assert "HARD_FAIL" in body and ">sync<" in body.replace(" ", "") and "Not run" not in body
    html = report[0]
    assert "Not run for this report" in html and "python -m resilience.bench.chaos" in html
    assert 'id="trace"' in html and "make trace" in html  # the failure trace's section, not run either
