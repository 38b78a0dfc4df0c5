"""The benchmark pipeline: probe the machine, run every cell of a matrix, aggregate, project to scale, report.

    snakemake                                   # default matrix -> results/default/report/index.html
    snakemake --config matrix=smoke             # another conf/matrix/<name>.yaml (or a path) -> results/smoke/
    snakemake --config results=/tmp/r           # somewhere else than results/<matrix>/
    snakemake --config probe_max_age_h=6        # reuse a limits snapshot up to 6 h old (default 0: probe anew)
    snakemake --config rerun_noisy=true         # run again the cells measured on a busy host (kept in noisy/)
    snakemake --config allow_failed=true        # exit 0 even when a cell failed
    snakemake --config scenario=meta_rsc_1k     # project to another cluster (conf/scenario/) or my.yaml's
    snakemake --config preload=false            # every cell's command starts cold (default: forked, preloaded)
    snakemake --report results/default/snakemake-report.zip

profiles/default/config.yaml (read by itself) sets the cores and the resume behaviour. Each cell is one
`python -m resilience` run in results/<matrix>/runs/<strategy>-<fault>-<hash>/ (params.yaml there names it in
full); its done.json (written last) records how it ended, so a failed or invalid cell is kept and reported instead
of stopping the pipeline; one console line per finished cell, a table of states at the end, and the exit status
is 1 when a cell failed. docs/pipeline.md has the details, the matrix format and the SLURM profile.
"""

import json
import sys
from pathlib import Path

from reports import registry
from reports.pipeline import (
    cell_states,
    failed_count,
    results_summary,
    start_pool,
    state_table,
    stop_jobs_on_signal,
    stop_pool,
)
from reports.pipeline_config import pipeline_config


include: "workflow/slurm/settings.smk"  # first: profiles/slurm's account and partition set, or one line before any job


# The --config keys above, checked (one line for a bad one), and the probe snapshot chosen: reports/pipeline_config.py.
PIPELINE = pipeline_config(config)
MATRIX, RESULTS, PROBE, RUN_DIRS = PIPELINE.matrix, PIPELINE.results, PIPELINE.probe, PIPELINE.run_dirs
ENV = "workflow/envs/bench.yaml"
CAPTIONS = "reports/captions"
REPORT_CODE = sorted(str(p) for p in [*Path("reports").glob("*.py"), *Path(CAPTIONS).glob("*.rst")])
# Every figure and table of the report comes from one registry (reports/registry.py).
FIGURES = list(registry.MEASURED.values())
TABLES = registry.report_tables()
PROJECTION_FIGURES = list(registry.PROJECTED)


wildcard_constraints:
    cell=r"[A-Za-z0-9_.=-]+",


rule all:
    default_target: True
    input:
        f"{RESULTS}/report/index.html",


# The stages, in the order they run: probe, run (one job per cell), aggregate, project, report.


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
    input:
        PIPELINE.tokens,
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
        matrix=MATRIX.source,  # the cell by name: its settings (~1.5 kB of JSON) stay off the console
    shell:
        "python -m reports.cell {output:q} --matrix {params.matrix:q} --cell {wildcards.cell} "
        "--timeout-min {resources.runtime} > {log:q} 2>&1 && tail -n 1 {log:q}"


rule tokens:
    """The real loop's token file (train=real), built offline from this machine's Python sources, once."""
    output:
        PIPELINE.tokens,
    log:
        f"{RESULTS}/logs/tokens.log",
    conda:
        ENV
    shell:
        "python -m resilience.data.prepare --out $(dirname {output:q}) > {log:q} 2>&1"


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
    localrule: True  # seconds of work: on the submit node, not a batch job (profiles/slurm)
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
    localrule: True  # seconds of work: on the submit node, not a batch job (profiles/slurm)
    conda:
        ENV
    params:
        scenario=PIPELINE.scenario,  # --config scenario=: a conf/scenario/ name or a YAML's path
    shell:
        "python -m reports.project {input.summary:q} {output.status:q} {params.scenario:q} > {log:q} 2>&1"


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
    localrule: True  # seconds of work: on the submit node, not a batch job (profiles/slurm)
    conda:
        ENV
    params:
        matrix=MATRIX.source,
        chaos=PIPELINE.chaos,  # ckpt-chaos's table, when python -m resilience.bench.chaos has written it
        trace=PIPELINE.trace,  # the projection against a failure trace, when make trace has written it
    shell:
        "python -m reports {input.summary:q} --matrix {params.matrix:q} --limits {input.limits:q} "
        "--environment {input.environment:q} --projection {input.projection:q} --chaos {params.chaos:q} "
        "--trace {params.trace:q} "
        "--out {output.html:q} > {log:q} 2>&1"


include: "workflow/slurm/multinode.smk"  # rule multinode: one experiment across nodes (profiles/slurm), not in `all`


report: "workflow/report/workflow.rst"


onstart:
    stop_jobs_on_signal()  # SIGTERM/SIGINT to snakemake alone stops the running cells too
    # the cells' commands forked from one preloaded interpreter (not on a SLURM run's nodes)
    start_pool(PIPELINE.preload and workflow.local_exec)


onsuccess:
    stop_pool()
    states = cell_states(RUN_DIRS)
    print(state_table(states))
    if Path(f"{RESULTS}/report/index.html").exists():
        print(results_summary(Path(f"{RESULTS}/report/decision.csv")))
        print(f"report: {RESULTS}/report/index.html")
    if MULTINODE and Path(MULTINODE_DIR, "result.json").exists():  # rule multinode ran: its outcome in one line
        r = json.loads(Path(MULTINODE_DIR, "result.json").read_text())
        print(
            f"multinode {MULTINODE_NAME} ({NODES} node(s) x {NPROC_PER_NODE} rank(s)): {r['status']}, recovered "
            f"{r['recovered']}, final state {str(r['final_state_sha256'])[:12]}, {MULTINODE_DIR}/result.json"
        )
    if failed_count(states) and not PIPELINE.allow_failed:
        print(f"error: {failed_count(states)} cell(s) failed (--config allow_failed=true exits 0)")
        sys.exit(1)


onerror:
    stop_pool()
    print(state_table(cell_states(RUN_DIRS)))
