"""The report: ``index.html`` (one self-contained file) plus, beside it, every figure as PNG and its data as CSV.

Sections, in order: headline tables, the measured figures of ``reports/registry.py`` (in its order), environment
and run inventory, methods, and the scale projection with the registry's projected figures (labelled as a model
output). Every file is written atomically; ``index.html`` last, so that its presence means the whole report is
there.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import pandas as pd

from reports import methods, project, registry, stats, tables
from reports.html import badge, esc, figure, fmt, page, png_bytes, section, table
from resilience.record.fsio import atomic_write_bytes

PROJECTION_COLUMNS = ("strategy", "costs", "gpus", "ckpt_TB", "job_mtbf_h", "stall_s", "durable_s", "load_s",
                      "restart_s", "mean_recovery_s", "optimal_interval_s", "goodput_closed_form",
                      "goodput_monte_carlo", "goodput_shown")


def caption(name: str) -> str:
    """A caption shared with ``snakemake --report`` (reports/captions/<name>.rst), as one paragraph."""
    return " ".join((registry.CAPTIONS / f"{name}.rst").read_text().split())


def write_csv(frame: pd.DataFrame, path: Path) -> None:
    atomic_write_bytes(path, frame.to_csv(index=False).encode())


def render(summary: pd.DataFrame, out_html: Path, matrix: dict[str, str], limits: dict[str, Any],
           environment: dict[str, Any], projection_status: Path | None) -> Path:
    """Write the report into ``out_html``'s folder; returns ``out_html``."""
    out = out_html.parent
    out.mkdir(parents=True, exist_ok=True)
    parts = [_header(summary, matrix, limits), _headline(summary, limits, out)]
    for name, spec in registry.MEASURED.items():
        fig, data = spec.drawing()(summary)
        png = png_bytes(fig)
        plt.close(fig)
        atomic_write_bytes(out / f"fig_{name}.png", png)
        write_csv(data, out / f"{name}.csv")
        note = spec.noting()
        parts.append(section(name, spec.title, figure(png, spec.title, spec.caption_text(), f"{name}.csv")
                             + (note(summary) if note else "")))
    measured = tables.headline_strategies(summary, limits).dropna(subset=["ckpt_stall_s"])["strategy"].tolist()
    parts += [_environment(summary, limits, environment, out), _methods(), _projection(projection_status, measured)]
    atomic_write_bytes(out_html, page(f"resilience-bench report: {matrix['name']}", "".join(parts)).encode())
    return out_html


def cell_counts(summary: pd.DataFrame, html: bool = False) -> str:
    """What the matrix asked for and how far it got: "9 of 25 cells finished (9 ok, 16 not run)"."""
    states = summary["state"].value_counts().to_dict() if "state" in summary else {}
    rank = {"ok": 0, "unrecovered": 1, "failed": 2, "invalid": 3, tables.NOT_RUN: 4}
    parts = [badge(s, f"{n} {esc(s)}") if html else f"{n} {s}"
             for s, n in sorted(states.items(), key=lambda kv: (rank.get(kv[0], 5), kv[0]))]
    ran = tables.finished(summary)
    noisy = int(tables.noisy(ran).sum())
    if noisy:  # measured while the host was busy: kept out of the headline figures
        parts.append(badge("failed", f"{noisy} noisy") if html else f"{noisy} noisy")
    return f"{len(ran)} of {len(summary)} cells finished" + (f" ({', '.join(parts)})" if parts else "")


def _header(summary: pd.DataFrame, matrix: dict[str, str], limits: dict[str, Any]) -> str:
    toc = "".join(f'<li><a href="#{a}">{esc(t)}</a></li>' for a, t in [
        ("headline", "Headline"), *[(k, v.title) for k, v in registry.MEASURED.items()],
        ("environment", "Environment, limits and run inventory"), ("methods", "Methods"),
        ("projection", "Projection to cluster scale (model output)")])
    return (f"<h1>resilience-bench report</h1><p class=\"meta\">Matrix <b>{esc(matrix['name'])}</b> "
            f"({esc(matrix['source'])}): {esc(matrix['description'])}<br>{cell_counts(summary, html=True)}. "
            f"Generated {esc(time.strftime('%Y-%m-%d %H:%M:%S %Z'))}. All numbers below are measured, except the "
            f"last section, which is a projection. {esc(tables.probe_note(limits, summary))}</p>"
            f"<nav><ol>{toc}</ol></nav>")


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
                       ("goodput_fault_free", "goodput, fault-free"), ("bit_exact", "bit-exact"), ("note", "")],
               text=["strategy", "bit_exact", "note"], ratios={m: f"{m}_vs_sync" for m in (
                   "ckpt_stall_s", "ckpt_durable_s", "write_MBps", "goodput_fault_free")},
               intervals=tables.STRATEGY_METRICS)
    t2 = table(faults, [("strategy", "strategy"), ("fault", "fault"), ("cells", "cells"), ("runs", "finished"),
                        ("recovered", "recovered"),
                        ("recovery_time_s", "recovery time (s)"), ("lost_steps", "lost steps"),
                        ("detection_latency_s", "detection latency (s)"), ("goodput", "goodput"),
                        ("bit_exact", "bit-exact"), ("note", "")],
               text=["strategy", "fault", "bit_exact", "note"], ratios={m: f"{m}_vs_sync" for m in (
                   "recovery_time_s", "lost_steps", "goodput")}, intervals=tables.FAULT_METRICS)
    if faults.empty:
        t2 = "<p class=\"note\">No cell of this matrix injects a fault.</p>"
    body = (f"<h3>Per strategy</h3>{t1}<p class=\"caption\">Checkpoint cost per strategy (medians over its ok runs; "
            f"{esc(disk_note)}; cells: asked for by the matrix; a strategy without an ok cell keeps its row, \"not "
            f"measured\" and why). {esc(INTERVAL_RULE)} Look at the stall first: it is paid at every checkpoint. Bit-exact: every run's "
            f"final state equals the fault-free reference's, bit for bit. Data: headline_strategies.csv.</p>"
            f"<h3>Per strategy and fault</h3>{t2}<p class=\"caption\">Recovery per injected fault (medians over ok "
            f"runs; recovered counts all runs; n and intervals as above). Look at recovery time and lost steps against sync, and at any "
            f"\"no\" in bit-exact: a recovery that changed the training result. Data: headline_faults.csv.</p>")
    return section("headline", "Headline", body)


INTERVAL_RULE = (f"Under each median: n, the runs it is the median of, and its 95% interval (exact, from order "
                 f"statistics; with fewer than {stats.MIN_N} runs there is none and the runs' range is shown). "
                 f"Under a ratio to sync: its 95% interval; a strategy is called lower or higher than sync only "
                 f"where the two medians' intervals do not overlap, otherwise \"{stats.NO_DIFFERENCE}\" (Methods).")


def _environment(summary: pd.DataFrame, limits: dict[str, Any], env: dict[str, Any], out: Path) -> str:
    envt = tables.environment_table(env, limits, summary)
    inv = tables.inventory(summary)
    write_csv(envt, out / "environment.csv")
    write_csv(inv, out / "inventory.csv")
    bad = inv[inv["state"].isin(["failed", "invalid"])]
    not_run = int((inv["state"] == tables.NOT_RUN).sum())
    problems = "".join(
        f"<details><summary><b>{esc(r['cell'])}</b>: {esc(r['state'])} - {esc(r['error'])}</summary>"
        f"<pre>{esc(r['error_detail'])}</pre></details>" for _, r in bad.iterrows())
    env_table = table(envt, [("group", "group"), ("key", "key"), ("value", "value")], text=["group", "key", "value"])
    body = (f"<h3>Machine and physical limits</h3>{env_table}"
            f"<p class=\"caption\">Where the numbers were measured. Limits come from this pipeline run's probe "
            f"(python -m resilience.bench.probe, into results/probe/&lt;snapshot&gt;/); \"not probed\" where it has "
            f"not measured them. {esc(tables.probe_note(limits, summary))} Data: environment.csv."
            f"</p><h3>Run inventory</h3>"
            + f"<p>{esc(cell_counts(summary))}.</p>"
            + (f"<p>{len(bad)} cell(s) did not produce a usable result:</p>{problems}" if len(bad) else "")
            + (f"<p>{not_run} cell(s) of the matrix have not run (no done.json): run the pipeline again to run "
               f"them.</p>" if not_run else "")
            + ("<p>Every cell produced a result.</p>" if not len(bad) and not not_run and len(inv) else "")
            + table(inv, [("cell", "cell"), ("state", "state"), ("status", "result status"), ("attempts", "attempts"),
                          ("steps_completed", "steps done"), ("steps", "steps"), ("wall_time_s", "wall (s)"),
                          ("elapsed_s", "job (s)"), ("matches_reference", "bit-exact"), ("error", "error")],
                    text=["cell", "state", "status", "error"])
            + "<p class=\"caption\">Every cell of the matrix, problems first. failed: harness failure, crash or "
              "time limit; invalid: configuration rejected (its one-line reason); not run: no done.json yet. "
              "Data: inventory.csv.</p>")
    return section("environment", "Environment, limits and run inventory", body)


def _methods() -> str:
    def dl(items: list[tuple[str, str]]) -> str:
        return "<dl>" + "".join(f"<dt>{esc(k)}</dt><dd>{esc(v)}</dd>" for k, v in items) + "</dl>"

    body = (f"<p>Every metric is computed from the run's event log (events.jsonl) by one function "
            f"(resilience/record/metrics.py); times are seconds on one host's monotonic clock.</p>"
            f"<h3>Per run (result.json)</h3>{dl(methods.RESULT_METRICS)}"
            f"<h3>Derived in this report</h3>{dl(methods.DERIVED_METRICS)}<p>{esc(methods.AGGREGATION)}</p>")
    return section("methods", "Methods", body)


def _projection(status_path: Path | None, measured: list[str]) -> str:
    label = f"<p><b>Model output, not a measurement.</b> {esc(caption('projection'))}</p>"
    status = json.loads(status_path.read_text()) if status_path and status_path.exists() else None
    title = "Projection to cluster scale (model output)"
    if not status:
        return section("projection", title, label + "<p>Not run.</p>", "projection")
    folder = status_path.parent
    body = label
    if not status.get("ok"):
        body += f"<p class=\"note\">The projection could not run: {esc(status.get('error'))}</p>"
    for name, spec in registry.PROJECTED.items():
        png = folder / f"projection_{name}.png"
        if png.exists():
            body += figure(png.read_bytes(), f"projection: {name}", spec.caption, f"{folder.name}/{spec.data_csv}")
    summary_csv = folder / "projection_summary.csv"
    if status.get("ok") and summary_csv.exists():
        proj = pd.read_csv(summary_csv)
        proj.insert(1, "costs", ["fitted from this matrix" if s in measured else "scenario default (assumption)"
                                 for s in proj["strategy"]])
        shown = [c for c in PROJECTION_COLUMNS if c in proj.columns]
        if "goodput_shown" in shown:  # goodput to the failure band's precision, not 3 digits (reports/project.py)
            shown = [c for c in shown if c not in ("goodput_closed_form", "goodput_monte_carlo")]
        body += ("<h3>Projected per strategy</h3>"
                 + table(proj, [(c, c) for c in shown], text=["strategy", "costs", "goodput_shown"])
                 + "<p class=\"caption\">Projection at the scenario's size: fitted costs per checkpoint and "
                   "recovery, optimal interval, goodput (closed form; in brackets at the failure band's edges, rounded to "
                   "what the band supports). Strategies this matrix "
                   "did not measure keep the scenario's assumed costs. Data: "
                   f"{esc(folder.name)}/projection_summary.csv.</p>")
        body += project.calibration_html(folder)
    body += f"<details><summary>Projection console output</summary><pre>{esc(status.get('console'))}</pre></details>"
    return section("projection", title, body, "projection")


__all__ = ["render", "caption", "fmt"]
