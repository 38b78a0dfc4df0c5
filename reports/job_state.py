"""The report's "What each technique restores" (docs/job_state.md): per strategy and fault, each part of the job's
state exact or lost from the step it first differs, and whether every sample was trained on exactly once.

The verdicts are the summary's ``state_parts.<part>.*`` and ``ledger.*`` columns: runs of the real loop
(``train=real``) against their reference cell (``reports.aggregate.job_state``). A row sums up its runs (seeds,
repeats): a part lost in any run is lost, from the earliest step any run lost it. A real-loop row without a verdict
keeps its place, every cell "n/a", with the reason (a cell the rules refused, a strategy not compared by design).
Under the table, one finding per row with a cell that is not exact, with the command of the run that lost the
earliest. A matrix of the replayable loop has no verdicts; the section then says so, and how to get them.
"""

from __future__ import annotations

import math
import shlex
from typing import Any

import pandas as pd
from markupsafe import Markup

from reports.html import render_template, table

REAL = "train=real"
EXACT, NA, NOT_CHECKED = "exact", "n/a", "not checked"
LEDGER = "ledger"
REPLAYABLE = ("This matrix ran the replayable loop (train=replayable, the default: the RNG re-seeded from the step "
              "before every step, a batch a function of the step), whose whole state is model and optimizer, which "
              "the bit-exact columns above cover; for each part of the job's state (LR schedule, scaler, counters, "
              "RNG streams, data loader position) and the samples' ledger, run a matrix with train=real: snakemake "
              "--config matrix=job_state (conf/matrix/job_state.yaml, docs/job_state.md).")


def parts(summary: pd.DataFrame, real: bool) -> list[str]:
    """Every part of the job's state, in its order (model and optimizer first), where any run is of the real loop
    (``real``) or has a verdict: a part no run hashed keeps its column, n/a (the scaler of a bf16 or fp32 run)."""
    found = {c.split(".")[1] for c in summary.columns if c.startswith("state_parts.") and c.endswith(".exact")}
    if not found and not real:
        return []
    from resilience.state.parts import JOB_PARTS, MODEL, OPTIMIZER, RANK_PARTS  # torch: only for real-loop rows

    known = [MODEL, OPTIMIZER, *JOB_PARTS, *RANK_PARTS]
    return known + sorted(found - set(known))


def real_runs(summary: pd.DataFrame) -> pd.DataFrame:
    """The cells of the real loop that are not a reference: those with a verdict, and those whose command asks for
    ``train=real`` (a refused or failed cell keeps its row)."""
    if summary.empty or "cell.strategy" not in summary:
        return summary.iloc[0:0]
    judged = summary[[c for c in summary.columns if c.startswith("state_parts.")]].notna().any(axis=1)
    asked = summary.get("command", pd.Series("", index=summary.index)).fillna("").str.split().apply(
        lambda words: REAL in words)
    reference = summary.get("is_reference", pd.Series(False, index=summary.index)).isin([True, "True"])
    return summary[(judged | asked) & ~reference]


def _true(value: Any) -> bool | None:
    """A verdict as read back from summary.csv (bool, "True"/"False" text, or missing)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return value in (True, "True", "true")


def _step(value: Any) -> int | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else int(value)


def part_cell(runs: pd.DataFrame, part: str) -> tuple[str, pd.Series | None]:
    """A part's cell over the row's runs, and the run that lost it earliest (None unless lost)."""
    verdicts = [(_true(r.get(f"state_parts.{part}.exact")), _step(r.get(f"state_parts.{part}.first_diff_step")), r)
                for _, r in runs.iterrows()]
    lost = sorted(((step if step is not None else math.inf), i) for i, (v, step, _) in enumerate(verdicts)
                  if v is False)
    if lost:
        step, i = lost[0]
        return f"lost at {step}", verdicts[i][2]
    if any(v is True for v, _, _ in verdicts):
        return EXACT, None
    # exact: null (no checked point shared with the reference), or the part was not hashed (bf16 has no scaler)
    checked = any(f"state_parts.{part}.exact" in r and pd.notna(r.get(f"state_parts.{part}.checked_points"))
                  for _, r in runs.iterrows())
    return (NOT_CHECKED if checked else NA), None


def ledger_cell(runs: pd.DataFrame) -> tuple[str, pd.Series | None]:
    """The ledger's cell over the row's runs: exactly once, or what the worst run skipped and repeated."""
    broken = [(_step(r.get("ledger.first_diff_step")) or 0, i, r) for i, (_, r) in enumerate(runs.iterrows())
              if _true(r.get("ledger.exactly_once")) is False]
    if broken:
        step, _, run = min(broken, key=lambda b: (b[0], b[1]))
        return (f"{_step(run.get('ledger.skipped'))} skipped, {_step(run.get('ledger.repeated'))} repeated "
                f"(from step {step})"), run
    if any(_true(r.get("ledger.exactly_once")) is True for _, r in runs.iterrows()):
        return "exactly once", None
    return NA, None


def why_not_judged(runs: pd.DataFrame) -> str:
    """Why a real-loop row has no verdict, from its first run."""
    run = runs.iloc[0]
    state = str(run.get("state"))
    if state == "invalid":
        return f"refused by the rules: {run.get('error')}"
    if state not in ("ok", "unrecovered"):
        return f"{state}" + (f": {run.get('error')}" if isinstance(run.get("error"), str) else "")
    design = next((str(v) for v in (run.get("bit_exact"), run.get("reference.why"))
                   if isinstance(v, str) and v.startswith("not by design")), None)
    if design:
        return f"not compared ({design}: the strategy does not end on the fault-free state, docs/recovery_peers.md)"
    return "no part hashed, or its reference cell has no result"


def final_state(runs: pd.DataFrame) -> str:
    verdicts = [_true(v) for v in runs.get("matches_reference", pd.Series(dtype=object))]
    return "NO" if False in verdicts else "yes" if verdicts and all(v is True for v in verdicts) else "-"


def job_state_table(summary: pd.DataFrame) -> tuple[pd.DataFrame, list[dict[str, Any]]]:
    """One row per (strategy, fault) of the real loop, and the findings: every row with a cell not exact."""
    runs = real_runs(summary)
    names = parts(summary, real=len(runs) > 0)
    rows, findings = [], []
    groups = runs.groupby(["cell.strategy", "cell.fault_label"], sort=False, dropna=False) if len(runs) else []
    for (strategy, fault), group in groups:
        verdicts = [c for c in (f"state_parts.{p}.exact" for p in names) if c in group]
        judged = group[group[verdicts].notna().any(axis=1)] if verdicts else group[0:0]
        row: dict[str, Any] = {"strategy": strategy, "fault": fault, "runs": len(judged),
                               "final state exact": final_state(group)}
        lost: list[tuple[str, str, pd.Series]] = []
        if judged.empty:
            row.update({p: NA for p in [*names, LEDGER]}, note=why_not_judged(group))
        else:
            for p in names:
                row[p], run = part_cell(judged, p)
                if run is not None:
                    lost.append((p, row[p], run))
            row[LEDGER], run = ledger_cell(judged)
            if run is not None:
                lost.append(("samples", row[LEDGER], run))
            row["note"] = ""
        rows.append(row)
        if lost:
            first = min(lost, key=lambda x: _earliest(x[1]))[2]  # the run that lost a part the earliest
            findings.append({"strategy": strategy, "fault": fault, "cell": first.get("cell"),
                             "lost": [f"{p}: {text}" for p, text, _ in lost],
                             "command": reproducer(str(first.get("command", "")))})
    return pd.DataFrame(rows, columns=["strategy", "fault", "runs", "final state exact", *names, LEDGER, "note"]), \
        findings


def reproducer(command: str) -> str:
    """The cell's command line, its overrides quoted for a shell (``fault.at_step=[6,10,13]`` is a glob)."""
    prefix = "python -m resilience"
    if not command.startswith(prefix + " "):
        return command
    return f"{prefix} {shlex.join(command[len(prefix):].split())}"


def _earliest(text: str) -> float:
    """The step a cell's text names ("lost at 6", "... (from step 4)")."""
    digits = text.rsplit(" ", 1)[-1].strip("()")
    return float(digits) if digits.isdigit() else math.inf


def job_state_html(summary: pd.DataFrame) -> tuple[Markup, pd.DataFrame]:
    """The section's body, and its table (the report writes it as job_state.csv)."""
    data, findings = job_state_table(summary)
    if data.empty:
        return render_template("job_state.html.j2", table=None, findings=[], replayable=REPLAYABLE), data
    text = list(data.columns)
    shown = table(data.fillna(""), [(c, c) for c in text], text=text)
    return render_template("job_state.html.j2", table=shown, findings=findings, replayable=None), data
