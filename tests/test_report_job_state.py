"""The report's "What each technique restores" (reports/job_state.py) from hand-made summary rows, and the
pipeline's per-part verdict against its reference cell (reports/aggregate.job_state) from hand-made event logs: no
runs, seconds."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest

from reports.aggregate import job_state
from reports.job_state import REPLAYABLE, job_state_html, job_state_table
from reports.matrix import load_matrix

PARTS = ("model", "optimizer", "lr_scheduler", "train_state", "rng", "dataloader")  # bf16: no scaler
REAL = ("python -m resilience train=real workload.dropout=0.1 steps=16 checkpoint.every=3 fault.at_step=[6,10,13] "
        "reference.check=none")


def run(strategy: str, lost: dict[str, int] | None = None, ledger: dict | None = None, **extra) -> dict:
    """One summary row of the real loop, as reports.aggregate flattens it; ``lost``: {part: first step}."""
    lost = lost or {}
    row = {"cell": f"gpt_tiny-{strategy}-kill3", "cell.strategy": strategy, "cell.fault_label": "kill3",
           "is_reference": False, "state": "ok", "matches_reference": not lost,
           "command": f"{REAL} strategy={strategy} fault=kill"}
    for part in PARTS:
        row.update({f"state_parts.{part}.exact": part not in lost,
                    f"state_parts.{part}.first_diff_step": lost.get(part, math.nan),
                    f"state_parts.{part}.checked_points": 14})
    led = ledger or {"exactly_once": True, "first_diff_step": math.nan, "skipped": 0, "repeated": 0}
    row.update({f"ledger.{k}": v for k, v in led.items()})
    return {**row, **extra}


def unjudged(strategy: str, **extra) -> dict:
    """A row of the real loop without a verdict (state_parts null)."""
    return {"cell": f"gpt_tiny-{strategy}-kill3", "cell.strategy": strategy, "cell.fault_label": "kill3",
            "is_reference": False, "state": "ok", "matches_reference": None, "state_parts": None, "ledger": None,
            "command": f"{REAL} strategy={strategy} fault=kill", **extra}


@pytest.fixture
def summary() -> pd.DataFrame:
    reference = {**run("none"), "cell": "gpt_tiny-none-none", "cell.fault_label": "none", "is_reference": True}
    return pd.DataFrame([
        reference,
        run("sync"),
        run("sync_no_rng", lost={"rng": 3, "model": 6, "optimizer": 6}),
        run("sync_model_only", lost={"lr_scheduler": 3, "rng": 3, "dataloader": 3},
            ledger={"exactly_once": False, "first_diff_step": 4, "skipped": 192, "repeated": 192}),
        unjudged("replica_torchft", bit_exact="not by design"),
        unjudged("nvrx_async", state="invalid", error="strategy=nvrx_async: refused with train.precision=fp16"),
    ])


@pytest.mark.timeout(60)
def test_each_part_is_exact_lost_at_its_step_or_na_with_the_reason(summary):
    data, _ = job_state_table(summary)
    rows = data.set_index("strategy")
    # the reference cell is no row
    assert list(rows.index) == ["sync", "sync_no_rng", "sync_model_only", "replica_torchft", "nvrx_async"]
    assert list(data.columns) == ["strategy", "fault", "runs", "final state exact", "model", "optimizer",
                                  "lr_scheduler", "scaler", "train_state", "rng", "dataloader", "ledger", "note"]
    assert set(rows["scaler"]) == {"n/a"}  # bf16: no run hashed one
    assert set(rows.loc["sync", list(PARTS)]) == {"exact"} and rows.loc["sync", "ledger"] == "exactly once"
    assert rows.loc["sync", "final state exact"] == "yes"
    assert rows.loc["sync_no_rng", "rng"] == "lost at 3" and rows.loc["sync_no_rng", "model"] == "lost at 6"
    assert rows.loc["sync_no_rng", "dataloader"] == "exact" and rows.loc["sync_no_rng", "final state exact"] == "NO"
    assert rows.loc["sync_model_only", "ledger"] == "192 skipped, 192 repeated (from step 4)"
    assert set(rows.loc["replica_torchft", [*PARTS, "ledger"]]) == {"n/a"}
    assert rows.loc["replica_torchft", "note"].startswith("not compared (not by design")
    assert rows.loc["nvrx_async", "note"] == ("refused by the rules: strategy=nvrx_async: refused with "
                                              "train.precision=fp16")


@pytest.mark.timeout(60)
def test_a_part_lost_in_any_run_of_a_row_is_lost_from_the_earliest_step(summary):
    repeat = {**run("sync_no_rng", lost={"rng": 2}), "cell": "gpt_tiny-sync_no_rng-kill3-rep1"}
    data, findings = job_state_table(pd.concat([summary, pd.DataFrame([repeat])], ignore_index=True))
    row = data.set_index("strategy").loc["sync_no_rng"]
    assert row["runs"] == 2 and row["rng"] == "lost at 2" and row["model"] == "lost at 6"
    finding = next(f for f in findings if f["strategy"] == "sync_no_rng")
    assert finding["cell"] == "gpt_tiny-sync_no_rng-kill3-rep1"  # the run that lost a part the earliest


@pytest.mark.timeout(60)
def test_findings_list_every_cell_not_exact_with_its_reproducer(summary):
    html, _ = job_state_html(summary)
    html = str(html)
    assert "<table>" in html and "job_state.csv" in html
    assert "lost at 3" in html and "n/a" in html and "refused by the rules" in html
    findings = html.split("Findings:", 1)[1]
    assert "<b>sync_no_rng</b> (kill3): model: lost at 6; optimizer: lost at 6; rng: lost at 3" in findings
    shown = REAL.replace("fault.at_step=[6,10,13]", "&#39;fault.at_step=[6,10,13]&#39;")  # quoted: a glob
    assert f"<code>{shown} strategy=sync_no_rng fault=kill</code>" in findings
    assert "samples: 192 skipped, 192 repeated (from step 4)" in findings
    assert "<b>sync</b>" not in findings and "replica_torchft" not in findings  # exact, or no verdict: no finding


@pytest.mark.timeout(60)
def test_the_replayable_loop_gets_one_sentence_and_how_to_get_the_table():
    replayable = pd.DataFrame([{"cell": "gpt_tiny-sync-kill", "cell.strategy": "sync", "cell.fault_label": "kill",
                                "is_reference": False, "state": "ok", "matches_reference": True,
                                "state_parts": None, "ledger": None, "command": "python -m resilience strategy=sync"}])
    for frame in (replayable, pd.DataFrame()):
        html, data = job_state_html(frame)
        assert data.empty and "<table>" not in str(html)
        assert "ran the replayable loop" in str(html) and "matrix=job_state" in str(html)
    assert REPLAYABLE.count(". ") == 0 and REPLAYABLE.endswith(".")  # one sentence, with how to get the table


@pytest.mark.timeout(60)
def test_a_summary_read_back_from_csv_renders_the_same(summary, tmp_path):
    summary.to_csv(tmp_path / "summary.csv", index=False)
    again, _ = job_state_table(pd.read_csv(tmp_path / "summary.csv"))
    assert again.fillna("").astype(str).equals(job_state_table(summary)[0].fillna("").astype(str))


def _run_dir(path: Path, hashes: dict[tuple[int, int], dict[str, str]], **result) -> Path:
    path.mkdir(parents=True)
    events = [{"kind": "parts_hashed", "rank": rank, "step": step, "parts": parts}
              for (rank, step), parts in hashes.items()]
    (path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (path / "result.json").write_text(json.dumps({"status": "ok", "state_parts": None, "ledger": None, **result}))
    return path


@pytest.mark.timeout(60)
def test_the_pipeline_judges_each_part_against_its_reference_cell(tmp_path):
    ref = _run_dir(tmp_path / "ref", {(0, 3): {"model": "a", "rng": "r3"}, (1, 3): {"model": "a", "rng": "s3"},
                                      (0, 6): {"model": "b", "rng": "r6"}})
    run_ = _run_dir(tmp_path / "run", {(0, 3): {"model": "a", "rng": "r3"}, (1, 3): {"model": "a", "rng": "XX"},
                                       (0, 6): {"model": "c", "rng": "r6"}})
    verdict = job_state(run_, ref)
    assert verdict["state_parts"]["model"] == {"exact": False, "first_diff_step": 6, "checked_points": 3}
    assert verdict["state_parts"]["rng"] == {"exact": False, "first_diff_step": 3, "checked_points": 3}
    assert verdict["ledger"] is None  # neither run kept a ledger (train.data=synthetic)
    replayable = _run_dir(tmp_path / "replayable", {})
    assert job_state(replayable, ref) == {}  # no part hashed: result.json's nulls stay
    torchft = _run_dir(tmp_path / "torchft", {(0, 3): {"model": "z"}}, bit_exact="not by design")
    assert job_state(torchft, ref) == {}  # not compared by design, as result.json's reference verdict says


@pytest.mark.timeout(120)
def test_the_job_state_matrix_runs_the_real_loop_with_three_kills_and_its_reference():
    matrix = load_matrix("job_state", check=True)  # every cell as the command checks it
    # one run directory per cell, short enough for the pipeline (as tests/test_pipeline.py checks the other matrices)
    assert len({c.dir for c in matrix.cells}) == len(matrix.cells) and max(len(c.dir) for c in matrix.cells) < 64
    reference = matrix.cells[0]
    assert reference.is_reference and reference.values["strategy"] == "none"
    assert {c.reference for c in matrix.cells} == {reference.name}
    for cell in matrix.cells:
        assert {"train=real", "workload.dropout=0.1", "steps=16", "checkpoint.every=3",
                "reference.check=none"} <= set(cell.overrides)
    phases = {c.values["strategy"]: c.values["fault"].params.get("phase") for c in matrix.cells[1:]}
    assert phases["sync"] == ["during_checkpoint", "before_optimizer_step", "before_forward"]
    assert phases["replica"] == ["before_forward", "before_optimizer_step", "before_forward"]  # it never saves
    assert {"sync_model_only", "sync_no_rng", "replica_torchft", "dlrover_flash"} <= set(phases)


@pytest.mark.timeout(60)
def test_a_fault_entry_takes_one_value_per_planned_fault():
    from reports.matrix import expand
    from reports.matrix_spec import MatrixError

    spec = {"axes": {"workload": ["gpt_tiny"], "strategy": ["sync"], "detectors": [["process_exit"]],
                     "checkpoint.every": [3], "seed": [0], "world_size": [2], "steps": [16],
                     "fault": ["none", {"name": "kill", "at_step": [6, 10], "phase": "before_forward"}]}}
    killed = expand(spec).cells[-1]
    assert "fault.at_step=[6,10]" in killed.overrides and killed.values["fault"].label == \
        "kill.at_step=6-10.phase=before_forward"  # a file name: no brackets or commas
    assert killed.columns()["cell.fault.at_step"] == "[6,10]"
    spec["axes"]["fault"][1]["at_step"] = [6, {"step": 10}]
    with pytest.raises(MatrixError, match=r"fault\[1\]\.at_step=.*a non-empty list of them"):
        expand(spec)


@pytest.mark.timeout(60)
def test_a_real_loop_matrix_that_has_not_run_keeps_every_part_column():
    data, findings = job_state_table(pd.DataFrame([unjudged("sync", state="not run")]))
    assert list(data["note"]) == ["not run"] and not findings
    assert {"model", "scaler", "dataloader", "ledger"} <= set(data.columns)
