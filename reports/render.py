"""The report: ``index.html`` (one self-contained file) plus, beside it, every figure as PNG and its data as CSV.

Sections, in order: what to choose (``reports/decision.py``), headline tables, what each technique restores (``reports/job_state.py``), the measured
figures of ``reports/registry.py`` (in its order), environment and run inventory, methods, and the scale projection
with the registry's projected figures (labelled as a model output). Every file is written atomically;
``index.html`` last, so that its presence means the whole report is there.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import pandas as pd
from markupsafe import Markup

from reports import decision, job_state, methods, outside, project, registry, sharded, stats, tables
from reports.html import badge, figure, fmt, page, png_bytes, render_template, section, table
from resilience.record.fsio import atomic_write_bytes

PROJECTION_COLUMNS = ("strategy", "costs", "gpus", "ckpt_TB", "job_mtbf_h", "stall_s", "durable_s", "load_s",
                      "restart_s", "mean_recovery_s", "optimal_interval_s", "goodput_closed_form",
                      "goodput_monte_carlo", "goodput_monte_carlo_ci95", "gap_flagged", "goodput_shown")


def caption(name: str) -> str:
    """A caption shared with ``snakemake --report`` (reports/captions/<name>.rst), as one paragraph."""
    return " ".join((registry.CAPTIONS / f"{name}.rst").read_text().split())


def write_csv(frame: pd.DataFrame, path: Path) -> None:
    atomic_write_bytes(path, frame.to_csv(index=False).encode())


def render(summary: pd.DataFrame, out_html: Path, matrix: dict[str, str], limits: dict[str, Any],
           environment: dict[str, Any], projection_status: Path | None, chaos: Path | None = None,
           trace: Path | None = None) -> Path:
    """Write the report into ``out_html``'s folder; returns ``out_html``."""
    out = out_html.parent
    out.mkdir(parents=True, exist_ok=True)
    parts = [_header(summary, matrix, limits), _decision(summary, out, projection_status),
             _headline(summary, limits, out),
             _job_state(summary, out)]
    for name, spec in registry.MEASURED.items():
        fig, data = spec.drawing()(summary)
        png = png_bytes(fig)
        plt.close(fig)
        atomic_write_bytes(out / f"fig_{name}.png", png)
        write_csv(data, out / f"{name}.csv")
        note = spec.noting()
        if not spec.applies(summary):  # its files are written (the pipeline's outputs), its section left out
            continue
        parts.append(section(name, spec.title, render_template(
            "measured.html.j2", figure=figure(png, spec.title, spec.caption_text(), f"{name}.csv"),
            note=Markup(note(summary)) if note else "")))
    # strategy -> the runs the projection fits (resilience.projection.measured: ok, not noisy, a checkpoint saved)
    timed = tables.timed_runs(summary)
    saved = timed[(tables.col(timed, "ckpt_bytes") > 0) & tables.col(timed, "ckpt_stall_s").notna()]
    measured = saved["strategy"].value_counts().to_dict() if "strategy" in saved else {}
    parts += [outside.chaos_section(chaos), _environment(summary, limits, environment, out), _methods(),
              _projection(projection_status, measured), outside.trace_section(trace)]
    atomic_write_bytes(out_html, page(f"resilience-bench report: {matrix['name']}", "".join(parts)).encode())
    return out_html


def cell_counts(summary: pd.DataFrame, html: bool = False) -> str:
    """What the matrix asked for and how far it got: "9 of 25 cells finished (9 ok, 16 not run)"."""
    states = summary["state"].value_counts().to_dict() if "state" in summary else {}
    rank = {"ok": 0, "unrecovered": 1, "failed": 2, "invalid": 3, tables.NOT_RUN: 4}
    parts = [badge(s, f"{n} {s}") if html else f"{n} {s}"
             for s, n in sorted(states.items(), key=lambda kv: (rank.get(kv[0], 5), kv[0]))]
    ran = tables.finished(summary)
    noisy = int(tables.noisy(ran).sum())
    if noisy:  # measured while the host was busy: kept out of the headline figures
        parts.append(badge("failed", f"{noisy} noisy") if html else f"{noisy} noisy")
    return f"{len(ran)} of {len(summary)} cells finished" + (f" ({', '.join(parts)})" if parts else "")


def _header(summary: pd.DataFrame, matrix: dict[str, str], limits: dict[str, Any]) -> Markup:
    toc = [("decision", DECISION_TITLE), ("headline", "Headline"), ("job_state", JOB_STATE_TITLE),
           *[(k, v.title) for k, v in registry.MEASURED.items() if v.applies(summary)],
           ("chaos", outside.CHAOS_TITLE), ("environment", "Environment, limits and run inventory"),
           ("methods", "Methods"),
           ("projection", "Projection to cluster scale (model output)"), ("trace", outside.TRACE_TITLE)]
    return render_template("header.html.j2", matrix=matrix, counts=Markup(cell_counts(summary, html=True)),
                           generated=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                           probe_note=tables.probe_note(limits, summary), toc=toc)


def _headline(summary: pd.DataFrame, limits: dict[str, Any], out: Path) -> str:
    strat = tables.headline_strategies(summary, limits)
    faults = tables.headline_faults(summary)
    write_csv(strat, out / "headline_strategies.csv")
    write_csv(faults, out / "headline_faults.csv")
    disk = tables.disk_limit(limits, summary)
    disk_note = f"probed disk write bandwidth {disk:.0f} MB/s" if disk else "disk bandwidth not probed"
    t1 = table(strat, [("strategy", "strategy"), ("cells", "cells"), ("runs", "finished"), ("runs_ok", "ok"),
                       ("ckpt_stall_s", "checkpoint stall (s)"), ("ckpt_durable_s", "time until durable (s)"),
                       ("ckpt_MB", "checkpoint size (MB)"), ("write_MBps", "write bandwidth (MB/s)"),
                       ("write_pct_of_disk", "% of disk limit"), ("step_time_s", "step time (s)"),
                       ("ettr_fault_free", "ETTR, fault-free (start-up excluded)"), ("bit_exact", "bit-exact"),
                       ("workarounds", "ran with our workarounds (docs/peers.md)"), ("note", "")],
               text=["strategy", "bit_exact", "workarounds", "note"], ratios={m: f"{m}_vs_sync" for m in (
                   "ckpt_stall_s", "ckpt_durable_s", "write_MBps", "step_time_s", "ettr_fault_free")},
               intervals=tables.STRATEGY_METRICS)
    t2 = table(faults, [("strategy", "strategy"), ("fault", "fault"), ("cells", "cells"), ("runs", "finished"),
                        ("recovered", "recovered"),
                        ("recovery_time_s", "recovery time (s)"), ("lost_steps", "lost steps"),
                        ("detection_latency_s", "detection latency (s)"), ("ettr", "ETTR (start-up excluded)"),
                        ("bit_exact", "bit-exact"), ("note", "")],
               text=["strategy", "fault", "bit_exact", "note"], ratios={m: f"{m}_vs_sync" for m in (
                   "recovery_time_s", "lost_steps", "ettr")}, intervals=tables.FAULT_METRICS)
    return section("headline", "Headline", render_template(
        "headline.html.j2", strategies=t1, faults=None if faults.empty else t2, disk_note=disk_note,
        interval_rule=INTERVAL_RULE))


INTERVAL_RULE = stats.INTERVAL_RULE  # the interval rule in words, kept beside its code
DECISION_TITLE = "What to choose"


def _decision(summary: pd.DataFrame, out: Path, projection_status: Path | None = None) -> Markup:
    body, data = decision.html(summary, _projection_summary(projection_status))
    write_csv(data, out / "decision.csv")
    return section("decision", DECISION_TITLE, body)


def _projection_summary(status_path: Path | None) -> pd.DataFrame | None:
    """The projection's per-technique summary, where it ran and ended ok."""
    status = json.loads(status_path.read_text()) if status_path and status_path.exists() else None
    path = status_path.parent / "projection_summary.csv" if status_path else None
    return pd.read_csv(path) if status and status.get("ok") and path.exists() else None


JOB_STATE_TITLE = "What each technique restores"


def _job_state(summary: pd.DataFrame, out: Path) -> Markup:
    body, data = job_state.job_state_html(summary)
    write_csv(data, out / "job_state.csv")
    return section("job_state", JOB_STATE_TITLE, body)


def _environment(summary: pd.DataFrame, limits: dict[str, Any], env: dict[str, Any], out: Path) -> str:
    envt = tables.environment_table(env, limits, summary)
    inv = tables.inventory(summary)
    write_csv(envt, out / "environment.csv")
    write_csv(inv, out / "inventory.csv")
    bad = inv[inv["state"].isin(["failed", "invalid"])]
    body = render_template(
        "environment.html.j2",
        environment=table(envt, [("group", "group"), ("key", "key"), ("value", "value")],
                          text=["group", "key", "value"]),
        probe_note=tables.probe_note(limits, summary), counts=cell_counts(summary),
        bad=bad.to_dict("records"), not_run=int((inv["state"] == tables.NOT_RUN).sum()), cells=len(inv),
        inventory=table(inv, [("cell", "cell"), ("state", "state"), ("status", "result status"),
                              ("attempts", "attempts"), ("steps_completed", "steps done"), ("steps", "steps"),
                              ("wall_time_s", "wall (s)"), ("elapsed_s", "job (s)"),
                              ("matches_reference", "bit-exact"), ("validity.verdict", "validity"),
                              ("validity.reasons", "why noisy"), ("error", "error, or why unrecoverable")],
                        text=["cell", "state", "status", "validity.verdict", "validity.reasons", "error"]))
    return section("environment", "Environment, limits and run inventory", body)


def _methods() -> Markup:
    body = render_template("methods.html.j2", groups=[("Per run (result.json)", methods.RESULT_METRICS),
                                                      ("Derived in this report", methods.DERIVED_METRICS)],
                           aggregation=methods.AGGREGATION)
    return section("methods", "Methods", body)


def _projection(status_path: Path | None, measured: dict[str, int]) -> Markup:
    status = json.loads(status_path.read_text()) if status_path and status_path.exists() else None
    title = "Projection to cluster scale (model output)"
    context: dict[str, Any] = {"caption": caption("projection"), "status": status, "figures": [], "summary": None}
    if status and status.get("scenario"):  # --config scenario=: a name, or the user's YAML
        title += f", scenario {Path(status['scenario']).stem}"
    if status:
        folder = status_path.parent
        for name, spec in registry.PROJECTED.items():
            png = folder / f"projection_{name}.png"
            if png.exists():
                context["figures"].append(figure(png.read_bytes(), f"projection: {name}", spec.caption,
                                                 f"{folder.name}/{spec.data_csv}"))
        summary_csv = folder / "projection_summary.csv"
        if status.get("ok") and summary_csv.exists():
            proj = pd.read_csv(summary_csv)
            proj.insert(1, "costs", [f"stall, durable, load fitted from this matrix (n={int(measured[s])} runs); "
                                     f"restart and detection the scenario's" if s in measured
                                     else "scenario default (assumption)" for s in proj["strategy"]])
            shown = [c for c in PROJECTION_COLUMNS if c in proj.columns]
            # goodput_shown: to the failure band's precision; beside it the two models and whether their gap is larger
            # than the simulation's own 95% error
            context.update(summary=table(proj, [(c, c) for c in shown], text=["strategy", "costs", "goodput_shown"]),
                           folder=folder.name, calibration=Markup(project.calibration_html(folder)),
                           per_shard=sharded.projection_html(folder))
    return section("projection", title, render_template("projection.html.j2", **context), "projection")


__all__ = ["render", "caption", "fmt"]
