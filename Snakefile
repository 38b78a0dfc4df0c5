"""The benchmark pipeline: probe the machine, run every cell of a matrix, aggregate, project to scale, report.

    snakemake                                   # default matrix -> results/default/report/index.html
    snakemake --config matrix=smoke             # another conf/matrix/<name>.yaml (or a path) -> results/smoke/
    snakemake --config results=/tmp/r           # somewhere else than results/<matrix>/
    snakemake --config probe_max_age_h=6        # reuse a limits snapshot up to 6 h old (default 0: probe anew)
    snakemake --config rerun_noisy=true         # run again the cells measured on a busy host (kept in noisy/)
    snakemake --config allow_failed=true        # exit 0 even when a cell failed
    snakemake --report results/default/snakemake-report.zip

profiles/default/config.yaml (read by itself) sets the cores and the resume behaviour. Each cell is one
`python -m resilience` run in results/<matrix>/runs/<strategy>-<fault>-<hash>/ (params.yaml there names it in
full); its done.json (written last) records how it ended, so a failed or invalid cell is kept and reported instead
of stopping the pipeline; one console line per finished cell, a table of states at the end, and the exit status
is 1 when a cell failed. docs/pipeline.md has the details, the matrix format and the SLURM profile.
"""

import json
import os
import sys
from pathlib import Path

from reports import registry
from reports.cell import set_aside_noisy
from reports.pipeline import cell_states, failed_count, state_table, stop_jobs_on_signal
from reports.limits import snapshot_dir
from reports.matrix import MatrixError, load_matrix


include: "workflow/slurm/settings.smk"  # profiles/slurm: account and partition set, or one line before any job


try:
    MATRIX = load_matrix(str(config.get("matrix", "default")), check=True)  # every cell, as the command checks it
except MatrixError as exc:  # one line naming the key, not a traceback
    sys.exit(f"error: {exc}")
RESULTS = str(config.get("results", f"results/{MATRIX.name}")).rstrip("/")  # one folder per matrix
ALLOW_FAILED = str(config.get("allow_failed", "false")).lower() in ("true", "1", "yes")
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
    for name in set_aside_noisy(Path(RESULTS), [c.dir for c in MATRIX.cells]):
        print(f"rerun_noisy: {name} was measured on a busy host; kept in {RESULTS}/noisy/, it runs again")
RUN_DIRS = [Path(f"{RESULTS}/runs/{c.dir}") for c in MATRIX.cells]
CELLS_TO_RUN = any(not (d / "done.json").exists() for d in RUN_DIRS)
PROBE = os.environ.setdefault("RB_PROBE", str(snapshot_dir(Path(RESULTS), CELLS_TO_RUN, PROBE_MAX_AGE_H * 3600)))
# The environment (torch.utils.collect_env and more) is captured once per pipeline run, in the probe snapshot;
# each cell's result.json names it instead of spending a second per cell on its own copy.
os.environ.update(RB_ENVIRONMENT=str(Path(PROBE, "environment.json").resolve()))  # follows RB_PROBE
ENV = "workflow/envs/bench.yaml"
CAPTIONS = "reports/captions"
REPORT_CODE = sorted(str(p) for p in [*Path("reports").glob("*.py"), *Path(CAPTIONS).glob("*.rst")])
# Every figure and table of the report comes from one registry (reports/registry.py).
FIGURES = list(registry.MEASURED.values())
TABLES = registry.report_tables()
PROJECTION_FIGURES = list(registry.PROJECTED)

# `python` in every rule is the interpreter running Snakemake (the project's venv), activated or not.
os.environ.update(
    PATH=os.pathsep.join([str(Path(config.get("python", sys.executable)).parent), os.environ.get("PATH", "")])
)


include: "workflow/slurm/multinode.smk"  # rule multinode: one experiment across nodes (profiles/slurm)


localrules:
    aggregate,
    project,
    report,  # seconds of work: on the submit node, not a batch job each (profiles/slurm)


wildcard_constraints:
    cell=r"[A-Za-z0-9_.=-]+",


report: "workflow/report/workflow.rst"


onstart:
    stop_jobs_on_signal()  # SIGTERM/SIGINT to snakemake alone stops the running cells too


onsuccess:
    states = cell_states(RUN_DIRS)
    print(state_table(states))
    if Path(f"{RESULTS}/report/index.html").exists():
        print(f"report: {RESULTS}/report/index.html")
    if MULTINODE and Path(MULTINODE_DIR, "result.json").exists():  # rule multinode ran: its outcome in one line
        r = json.loads(Path(MULTINODE_DIR, "result.json").read_text())
        print(
            f"multinode {MULTINODE_NAME} ({NODES} node(s) x {NPROC_PER_NODE} rank(s)): {r['status']}, recovered "
            f"{r['recovered']}, final state {str(r['final_state_sha256'])[:12]}, {MULTINODE_DIR}/result.json"
        )
    if failed_count(states) and not ALLOW_FAILED:
        print(f"error: {failed_count(states)} cell(s) failed (--config allow_failed=true exits 0)")
        sys.exit(1)


onerror:
    print(state_table(cell_states(RUN_DIRS)))


rule all:
    default_target: True
    input:
        f"{RESULTS}/report/index.html",


rule probe:
    """Physical limits of this machine (disk and memory bandwidth, rank start cost) and its environment: the
    snapshot of this pipeline run, measured first (priority) and alone."""
    output:
        limits=f"{PROBE}/limits.json",
        environment=f"{PROBE}/environment.json",
    log:
        f"{RESULTS}/logs/probe.log",
    priority: 100  # before the cells, which record this snapshot
    conda:
        ENV
    threads: lambda wc: workflow.cores  # alone on the machine: a bandwidth measured beside a training run means nothing
    resources:
        runtime=15,
    shell:
        "python -m reports.limits {output.limits:q} {output.environment:q} > {log:q} 2>&1"


rule run:
    """One cell: `python -m resilience <overrides> hydra.run.dir=results/<matrix>/runs/<cell>`, its outcome in
    done.json; its last log line (state and time) goes to the console."""
    output:
        f"{RESULTS}/runs/{{cell}}/done.json",
    log:
        f"{RESULTS}/logs/run/{{cell}}.log",
    conda:
        ENV
    threads: lambda wc: MATRIX.at(wc.cell).world_size  # one process per rank
    resources:
        mem_mb=lambda wc: 1500 * MATRIX.at(wc.cell).world_size + 1000,
        runtime=MATRIX.runtime_min,
    params:
        spec=lambda wc: MATRIX.at(wc.cell).job_spec(),
    shell:
        "python -m reports.cell {output:q} {params.spec:q} --timeout-min {resources.runtime} > {log:q} 2>&1 "
        "&& tail -n 1 {log:q}"


rule aggregate:
    """One row per cell: every result.json field (dotted names), the cell's parameters, its state, bit-exactness."""
    input:
        done=[f"{d}/done.json" for d in RUN_DIRS],
        matrix=MATRIX.source,
        code="reports/aggregate.py",
    output:
        csv=f"{RESULTS}/summary.csv",
        parquet=f"{RESULTS}/summary.parquet",
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
            report(
                f"{RESULTS}/projection/projection_{name}.png",
                caption=f"{CAPTIONS}/projection.rst",
                category="Projection (model output)",
                labels={"figure": name},
            )
            for name in PROJECTION_FIGURES
        ],
    log:
        f"{RESULTS}/logs/project.log",
    conda:
        ENV
    shell:
        "python -m reports.project {input.summary:q} {output.status:q} > {log:q} 2>&1"


rule report:
    """results/<matrix>/report/index.html: one self-contained file; every figure's data also as CSV beside it."""
    input:
        summary=f"{RESULTS}/summary.csv",
        limits=f"{PROBE}/limits.json",
        environment=f"{PROBE}/environment.json",
        projection=f"{RESULTS}/projection/projection_status.json",
        code=REPORT_CODE,
    output:
        html=report(f"{RESULTS}/report/index.html", category="Report", labels={"file": "index.html"}),
        figures=[
            report(
                f"{RESULTS}/report/fig_{fig.name}.png",
                caption=fig.caption_file(),
                category="Measured",
                labels={"figure": fig.name},
            )
            for fig in FIGURES
        ],
        tables=[f"{RESULTS}/report/{name}.csv" for name in TABLES],
    log:
        f"{RESULTS}/logs/report.log",
    conda:
        ENV
    params:
        matrix=MATRIX.source,
    shell:
        "python -m reports {input.summary:q} --matrix {params.matrix:q} --limits {input.limits:q} "
        "--environment {input.environment:q} --projection {input.projection:q} --out {output.html:q} > {log:q} 2>&1"
