"""The benchmark pipeline: probe the machine, run every cell of a matrix, aggregate, project to scale, report.

    snakemake --cores 2                          # default matrix -> results/report/index.html
    snakemake --cores 2 --config matrix=smoke    # another conf/matrix/<name>.yaml (or a path to one)
    snakemake --cores 2 --config results=/tmp/r  # somewhere else than results/
    snakemake --cores 2 --config probe_max_age_h=6  # reuse a limits snapshot up to 6 h old (default 0: probe anew)
    snakemake --cores 2 --config rerun_noisy=true   # run again the cells measured on a busy host (kept in noisy/)
    snakemake --report results/snakemake-report.zip

Each cell is one `python -m resilience` run in results/runs/<cell>/; its done.json (written last) records how it
ended, so a failed or invalid cell is kept and reported instead of stopping the pipeline. docs/pipeline.md has
the details, the matrix format and the SLURM profile.
"""

import os
import sys
from pathlib import Path

from reports import registry
from reports.cell import set_aside_noisy
from reports.limits import snapshot_dir
from reports.matrix import MatrixError, load_matrix

try:
    MATRIX = load_matrix(str(config.get("matrix", "default")), check=True)  # every cell, as the command checks it
except MatrixError as exc:  # one line naming the key, not a traceback
    sys.exit(f"error: {exc}")
RESULTS = str(config.get("results", "results")).rstrip("/")
try:
    PROBE_MAX_AGE_H = float(config.get("probe_max_age_h", 0))
    assert PROBE_MAX_AGE_H >= 0
except (TypeError, ValueError, AssertionError):
    sys.exit(f"error: probe_max_age_h={config.get('probe_max_age_h')}: must be a number of hours >= 0")
# The limits snapshot of this pipeline run (reports/limits.py): a new one when cells are about to run (unless one
# younger than probe_max_age_h exists). Every cell records it (reports/cell.py reads RB_PROBE); a job that
# Snakemake starts as its own process (SLURM) parses this file again and inherits the choice.
if str(config.get("rerun_noisy", "false")).lower() in ("true", "1", "yes"):
    # Cells measured on a busy host run again; what they measured is kept aside, never deleted.
    for name in set_aside_noisy(Path(RESULTS), [c.name for c in MATRIX.cells]):
        print(f"rerun_noisy: {name} was measured on a busy host; kept in {RESULTS}/noisy/, it runs again")
CELLS_TO_RUN = any(not Path(f"{RESULTS}/runs/{c.name}/done.json").exists() for c in MATRIX.cells)
PROBE = os.environ.setdefault("RB_PROBE", str(snapshot_dir(Path(RESULTS), CELLS_TO_RUN, PROBE_MAX_AGE_H * 3600)))
ENV = "workflow/envs/bench.yaml"
CAPTIONS = "reports/captions"
REPORT_CODE = sorted(str(p) for p in [*Path("reports").glob("*.py"), *Path(CAPTIONS).glob("*.rst")])
# Every figure and table of the report comes from one registry (reports/registry.py).
FIGURES = list(registry.MEASURED.values())
TABLES = registry.report_tables()
PROJECTION_FIGURES = list(registry.PROJECTED)

# `python` in every rule is the interpreter running Snakemake (the project's venv), activated or not.
os.environ.update(PATH=os.pathsep.join([str(Path(config.get("python", sys.executable)).parent),
                                        os.environ.get("PATH", "")]))


wildcard_constraints:
    cell=r"[A-Za-z0-9_.=-]+",


rule all:
    input:
        f"{RESULTS}/report/index.html",
    default_target: True


rule probe:
    """Physical limits of this machine (disk and memory bandwidth, rank start cost) and its environment: the
    snapshot of this pipeline run, measured first (priority) and alone."""
    output:
        limits=f"{PROBE}/limits.json",
        environment=f"{PROBE}/environment.json",
    log:
        f"{RESULTS}/logs/probe.log",
    threads: lambda wc: workflow.cores  # alone on the machine: a bandwidth measured beside a training run means nothing
    priority: 100  # before the cells, which record this snapshot
    resources:
        runtime=15,
    conda:
        ENV
    shell:
        "python -m reports.limits {output.limits:q} {output.environment:q} > {log:q} 2>&1"


rule run:
    """One cell: `python -m resilience <overrides> hydra.run.dir=results/runs/<cell>`, its outcome in done.json."""
    output:
        f"{RESULTS}/runs/{{cell}}/done.json",
    log:
        f"{RESULTS}/logs/run/{{cell}}.log",
    params:
        spec=lambda wc: MATRIX.cell(wc.cell).job_spec(),
    threads: lambda wc: MATRIX.cell(wc.cell).world_size  # one process per rank
    resources:
        mem_mb=lambda wc: 1500 * MATRIX.cell(wc.cell).world_size + 1000,
        runtime=MATRIX.runtime_min,
    conda:
        ENV
    shell:
        "python -m reports.cell {output:q} {params.spec:q} --timeout-min {resources.runtime} > {log:q} 2>&1"


rule aggregate:
    """One row per cell: every result.json field (dotted names), the cell's parameters, its state, bit-exactness."""
    input:
        done=[f"{RESULTS}/runs/{c.name}/done.json" for c in MATRIX.cells],
        matrix=MATRIX.source,
        code="reports/aggregate.py",
    output:
        csv=f"{RESULTS}/summary.csv",
    log:
        f"{RESULTS}/logs/aggregate.log",
    conda:
        ENV
    shell:
        "python -m reports.aggregate {input.matrix:q} {output.csv:q} {input.done:q} > {log:q} 2>&1"


rule project:
    """Measured costs projected to cluster scale by `python -m resilience.projection` (model output, labelled so)."""
    input:
        summary=f"{RESULTS}/summary.csv",
    output:
        status=f"{RESULTS}/projection/projection_status.json",
        summary=f"{RESULTS}/projection/projection_summary.csv",
        figures=[
            report(f"{RESULTS}/projection/projection_{name}.png", caption=f"{CAPTIONS}/projection.rst",
                   category="Projection (model output)", labels={"figure": name})
            for name in PROJECTION_FIGURES
        ],
    log:
        f"{RESULTS}/logs/project.log",
    conda:
        ENV
    shell:
        "python -m reports.project {input.summary:q} {output.status:q} > {log:q} 2>&1"


rule report:
    """results/report/index.html: one self-contained file; every figure's data also as CSV beside it."""
    input:
        summary=f"{RESULTS}/summary.csv",
        limits=f"{PROBE}/limits.json",
        environment=f"{PROBE}/environment.json",
        projection=f"{RESULTS}/projection/projection_status.json",
        code=REPORT_CODE,
    output:
        html=report(f"{RESULTS}/report/index.html", category="Report", labels={"file": "index.html"}),
        figures=[
            report(f"{RESULTS}/report/fig_{fig.name}.png", caption=fig.caption_file(), category="Measured",
                   labels={"figure": fig.name})
            for fig in FIGURES
        ],
        tables=[f"{RESULTS}/report/{name}.csv" for name in TABLES],
    params:
        matrix=MATRIX.source,
    log:
        f"{RESULTS}/logs/report.log",
    conda:
        ENV
    shell:
        "python -m reports {input.summary:q} --matrix {params.matrix:q} --limits {input.limits:q} "
        "--environment {input.environment:q} --projection {input.projection:q} --out {output.html:q} > {log:q} 2>&1"
