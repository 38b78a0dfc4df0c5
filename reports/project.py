"""``python -m reports.project SUMMARY_CSV STATUS_JSON [SCENARIO]``: measured costs projected to cluster scale.

SCENARIO: a name in conf/scenario/ or a scenario YAML's path (the pipeline's ``--config scenario=``; default
llama3_405b). Runs ``python -m resilience.projection measured_csv=SUMMARY_CSV output_dir=<STATUS_JSON's folder>``
with it (figures and
CSVs named ``projection_*``; see docs/projection.md). The projection is a model, not a measurement: it is labelled
so wherever it appears. If it cannot run (e.g. no strategy in the matrix saved a checkpoint), STATUS_JSON records
why and each expected figure is replaced by one that says so, so that the report still renders and tells the reader.
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib
import pandas as pd

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from reports import registry, scenario_choice  # noqa: E402
from reports.html import figure, table  # noqa: E402
from resilience.proc import child  # noqa: E402
from resilience.record.fsio import atomic_write_bytes, atomic_write_json  # noqa: E402
from resilience.projection.outputs import write_png  # noqa: E402

FIGURES = tuple(registry.PROJECTED)
TABLES = ("summary",)
TIMEOUT_S = 600


def project(summary_csv: Path, status_json: Path, scenario: str = scenario_choice.DEFAULT) -> dict:
    """Run the projection into ``status_json``'s folder; always leaves every expected file there."""
    out_dir = status_json.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "resilience.projection", f"measured_csv={summary_csv.resolve()}",
           f"output_dir={out_dir.resolve()}", f"hydra.run.dir={(out_dir / 'hydra').resolve()}",
           *scenario_choice.overrides(scenario, out_dir / "scenario_conf")]
    print("$ " + " ".join(cmd), flush=True)
    done = child.run(cmd, timeout_s=TIMEOUT_S)
    code, out, err = done.returncode, done.stdout, done.stderr + (f"timed out after {TIMEOUT_S} s" if done.timed_out
                                                                  else "")
    print(out + err, flush=True)
    missing = [n for n in FIGURES if not (out_dir / f"projection_{n}.png").exists()]
    missing += [f"projection_{n}.csv" for n in TABLES if not (out_dir / f"projection_{n}.csv").exists()]
    ok = code == 0 and not missing
    reason = None
    if not ok:
        last = next((s for s in reversed((err or out).splitlines()) if s.strip()), "")
        reason = f"exit {code}: {last}" if code != 0 else f"missing outputs: {', '.join(missing)}"
        for name in FIGURES:  # also over stale figures of an earlier run: they would not match these data
            _placeholder(out_dir / f"projection_{name}.png", name, reason)
        for name in TABLES:
            atomic_write_bytes(out_dir / f"projection_{name}.csv", b"label,error\nprojection,not available\n")
    status = {"ok": ok, "command": cmd, "exit_code": code, "error": reason, "console": out.strip(),
              "scenario": scenario}
    atomic_write_json(status_json, status)
    return status


CALIBRATION_COLUMNS = [("figure", "figure"), ("source", "source"), ("source_id", "independent source"),
                       ("gpus", "GPUs"), ("published", "published"),
                       ("implied_per_gpu_mttf_h", "per-GPU MTTF it implies (GPU-h)"), ("bound", "point or bound"),
                       ("model_value", "model at the scenario's rate"), ("error", "relative error")]


def calibration_html(folder: Path) -> str:
    """The failure band in the report: each published figure, its source and the model's reproduction (relative
    error: model / published - 1), and the figure of the rates they imply; empty without the projection's CSV."""
    csv = folder / "projection_calibration.csv"
    if not csv.exists():
        return ""
    cal = pd.read_csv(csv)
    cal["error"] = [f"{v:+.0%}" for v in cal["relative_error"]]
    rate = float(cal["scenario_per_gpu_mttf_h"].iloc[0])
    html = ("<h3>The failure band: published figures and the model's reproduction</h3>"
            + str(table(cal, CALIBRATION_COLUMNS, text=["figure", "source", "source_id", "published", "bound", "error"]))
            + f"<p class=\"caption\">Each figure inverted through the failure model gives a per-GPU MTTF; the "
              f"scenario's own calibration is {rate:,.0f} GPU-hours, and the model's value of each figure at that "
              f"rate is shown with its relative error. The rates the figures imply span the failure band; every "
              f"projected goodput is shown with its value at the band's edges and rounded to the precision the band "
              f"supports. Data: {folder.name}/projection_calibration.csv.</p>")
    png = folder / "projection_failure_band.png"
    if png.exists():
        html += str(figure(png.read_bytes(), "projection: failure band", "Projection: the per-GPU MTTF each published "
                       "figure implies (dots), the band they span (shaded) and the scenario's calibration (line).",
                       f"{folder.name}/projection_calibration.csv"))
    return html


def _placeholder(path: Path, name: str, reason: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 2))
    ax.axis("off")
    ax.text(0.5, 0.5, f"projection: {name.replace('_', ' ')} not available\n{reason}", ha="center", va="center",
            wrap=True)
    write_png(fig, path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (2, 3):
        print("usage: python -m reports.project SUMMARY_CSV STATUS_JSON [SCENARIO]", file=sys.stderr)
        return 2
    try:
        scenario = scenario_choice.chosen(args[2]) if len(args) == 3 else scenario_choice.DEFAULT
    except scenario_choice.ScenarioError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    status = project(Path(args[0]), Path(args[1]), scenario)
    print("projection: " + ("done" if status["ok"] else f"not available ({status['error']})"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
