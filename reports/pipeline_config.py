"""The Snakefile's settings: the ``--config`` keys its docstring lists, checked, and what they prepare.

They live here so that the Snakefile can open with its default target (the Snakefile holds no functions: Snakemake's
lint asks for them elsewhere). A bad key ends Snakemake in one line naming it, before any job. Reading them also
prepares what every rule's command inherits from the Snakemake process: the probe snapshot of this pipeline run
(``RB_PROBE``, ``RB_ENVIRONMENT``) and the interpreter behind ``python``.
"""

from __future__ import annotations

import logging
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

from reports import scenario_choice
from reports.cell import set_aside_noisy
from reports.limits import snapshot_dir
from reports.matrix import Matrix, MatrixError, load_matrix

TRUE = ("true", "1", "yes")


@dataclass(frozen=True)
class PipelineConfig:
    """One pipeline run's settings: the matrix, where its results go, the probe snapshot its cells record."""

    matrix: Matrix
    results: str  # results/<matrix> unless --config results=...
    allow_failed: bool
    probe: str  # the snapshot folder, results/<matrix>/probe/<stamp>
    run_dirs: list[Path]  # one per cell, whether it ran or not
    tokens: str  # the real loop's token file (train.data=loader), built once by rule tokens
    scenario: str  # the projection's cluster: a conf/scenario/ name or a YAML's absolute path
    chaos: str  # ckpt-chaos's table for the report (python -m resilience.bench.chaos; --config chaos=PATH)
    trace: str  # the failure trace's table for the report (make trace; --config trace=PATH)
    preload: bool  # the cells' commands forked from one preloaded interpreter (resilience.proc.pool)


@contextmanager
def root_logging_kept() -> Iterator[None]:
    """The root logger as it was before the block: checking the cells imports the roles' classes, and DLRover's
    import calls ``logging.basicConfig`` (dlrover/python/common/log.py, 0.6.1), a root handler that printed every
    Snakemake line a second time."""
    handlers, level = list(logging.root.handlers), logging.root.level
    try:
        yield
    finally:
        logging.root.handlers[:] = handlers
        logging.root.setLevel(level)


def pipeline_config(config: Mapping[str, Any]) -> PipelineConfig:
    """Check Snakemake's ``config`` and prepare this pipeline run; a bad setting exits with one line."""
    try:
        with root_logging_kept():
            matrix = load_matrix(str(config.get("matrix", "default")), check=True)  # every cell, as the command checks it
    except MatrixError as exc:  # one line naming the key, not a traceback
        sys.exit(f"error: {exc}")
    results = str(config.get("results", f"results/{matrix.name}")).rstrip("/")  # one folder per matrix
    try:
        scenario = scenario_choice.chosen(config.get("scenario", scenario_choice.DEFAULT))
    except scenario_choice.ScenarioError as exc:
        sys.exit(f"error: {exc}")
    allow_failed = str(config.get("allow_failed", "false")).lower() in TRUE
    preload = str(config.get("preload", "true")).lower()
    if preload not in (*TRUE, "false", "0", "no"):
        sys.exit(f"error: preload={config.get('preload')}: must be true or false")
    try:
        max_age_h = float(config.get("probe_max_age_h", 0))
        assert max_age_h >= 0
    except (TypeError, ValueError, AssertionError):
        sys.exit(f"error: probe_max_age_h={config.get('probe_max_age_h')}: must be a number of hours >= 0")
    if str(config.get("rerun_noisy", "false")).lower() in TRUE:
        # Cells measured on a busy host run again; what they measured is kept aside, never deleted. Before the
        # snapshot is chosen below: those cells are then cells to run.
        aside = set_aside_noisy(Path(results), [c.dir for c in matrix.cells])
        for name in aside:
            print(f"rerun_noisy: {name} was measured on a busy host; kept in {results}/noisy/, it runs again")
        if aside:  # else Snakemake sees the summary newer than what is left and reruns nothing (its done.json is
            # an intermediate file to it): the summary is made again from the cells, the noisy ones run again first.
            # The report too: Snakemake 9.27 does not make a missing intermediate summary again for a report that is
            # present (found on the pipeline matrix, 2026-11-28: "Nothing to be done" with 30 cells set aside)
            for derived in ("summary.csv", "summary.parquet", "report/index.html"):
                Path(results, derived).unlink(missing_ok=True)
    run_dirs = [Path(f"{results}/runs/{c.dir}") for c in matrix.cells]
    cells_to_run = any(not (d / "done.json").exists() for d in run_dirs)
    # The limits snapshot of this pipeline run (reports/limits.py): a new one when cells are about to run (unless one
    # younger than probe_max_age_h exists). Every cell records it (reports/cell.py reads RB_PROBE); a job that
    # Snakemake starts as its own process (SLURM) parses the Snakefile again and inherits the choice.
    probe = os.environ.setdefault("RB_PROBE", str(snapshot_dir(Path(results), cells_to_run, max_age_h * 3600)))
    # The environment (torch.utils.collect_env and more) is captured once per pipeline run, in the probe snapshot;
    # each cell's result.json names it instead of spending a second per cell on its own copy.
    os.environ.update(RB_ENVIRONMENT=str(Path(probe, "environment.json").resolve()))  # follows RB_PROBE
    # `python` in every rule is the interpreter running Snakemake (the project's venv), activated or not.
    os.environ.update(
        PATH=os.pathsep.join([str(Path(config.get("python", sys.executable)).parent), os.environ.get("PATH", "")])
    )
    # The real loop's token file: one per machine, where every cell's loader looks for it (RB_DATA_DIR, the default
    # of train.loader.dir), built by rule tokens before any cell (a cell would build it itself, each one at once).
    data = os.environ.setdefault("RB_DATA_DIR", str(Path("data").resolve()))
    chaos = str(config.get("chaos", "results/chaos/chaos.md"))
    trace = str(config.get("trace", "results/trace/trace.md"))
    return PipelineConfig(matrix, results, allow_failed, probe, run_dirs, f"{data}/tokens.bin", scenario, chaos,
                          trace, preload in TRUE)
