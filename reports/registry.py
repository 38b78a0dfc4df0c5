"""Every figure of the report, registered once: the Snakefile, the renderer and the captions read this list.

A measured figure is one drawing function (summary table in, ``(Figure, DataFrame)`` out) and one entry here; its
caption is the entry's ``caption``, or ``reports/captions/<name>.rst`` (which ``snakemake --report`` shows too).
To add a figure: write the function, add a ``Measured(...)`` line below (or call ``register`` from your own code).
The report draws it, writes ``fig_<name>.png`` and ``<name>.csv``, lists it in the contents, and the Snakefile
declares both files. Drawing functions are named as ``"module:function"`` so that the Snakefile can read this list
without importing matplotlib.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pandas as pd

CAPTIONS = Path(__file__).resolve().parent / "captions"
Draw = Callable[[pd.DataFrame], tuple[Any, pd.DataFrame]]


@dataclass(frozen=True)
class Measured:
    """A figure of measured data: ``fig_<name>.png`` and its data ``<name>.csv`` in the report folder."""

    name: str
    title: str
    draw: str | Draw  # "module:function", or the function itself
    caption: str | None = None  # None: reports/captions/<name>.rst
    note: str | None = None  # "module:function" (summary -> HTML under the figure), or None
    # "module:function" (summary -> bool): whether the report shows the section; its files are written either way
    # (the pipeline's outputs). None: always shown
    shown: str | None = None

    def drawing(self) -> Draw:
        """The drawing function (imported on first use)."""
        return _resolve(self.draw)

    def noting(self) -> Callable[[pd.DataFrame], str] | None:
        """The function that writes the HTML under the figure, if any."""
        return _resolve(self.note) if self.note else None

    def applies(self, summary: pd.DataFrame) -> bool:
        """Whether the section has anything to show for ``summary`` (a matrix without sharded cells: no section)."""
        return _resolve(self.shown)(summary) if self.shown else True

    def caption_text(self) -> str:
        """The caption as one paragraph: the entry's own, or its caption file's."""
        return self.caption or " ".join((CAPTIONS / f"{self.name}.rst").read_text().split())

    def caption_file(self) -> str | None:
        """The caption file for ``snakemake --report``, if there is one."""
        path = CAPTIONS / f"{self.name}.rst"
        return str(path.relative_to(CAPTIONS.parent.parent)) if path.exists() else None


@dataclass(frozen=True)
class Projected:
    """A figure the projection draws (``projection_<name>.png``), with the CSV that holds its data."""

    name: str
    data_csv: str
    caption: str


MEASURED: dict[str, Measured] = {}
PROJECTED: dict[str, Projected] = {}
HEADLINE_TABLES = ("headline_strategies", "headline_faults", "job_state")  # job_state: reports/job_state.py
INVENTORY_TABLES = ("environment", "inventory")
# the renderer's own, around the figures (job_state: reports/job_state.py)
FIXED_SECTIONS = ("headline", "job_state", "environment", "methods", "projection")


def register(figure: Measured | Projected) -> None:
    """Add a figure to the report (a later entry of the same name replaces the earlier one)."""
    if not re.fullmatch(r"[a-z][a-z0-9_]*", figure.name):  # it names files and an HTML anchor
        raise ValueError(f"figure name {figure.name!r}: must be lower-case letters, digits and '_'")
    if isinstance(figure, Measured):
        if figure.name in (*HEADLINE_TABLES, *INVENTORY_TABLES, *FIXED_SECTIONS):
            raise ValueError(f"figure name {figure.name!r}: taken by the report's own tables and sections")
        if not figure.caption and not (CAPTIONS / f"{figure.name}.rst").exists():
            raise ValueError(f"figure {figure.name!r}: no caption (give caption=... or write "
                             f"reports/captions/{figure.name}.rst)")
    (MEASURED if isinstance(figure, Measured) else PROJECTED)[figure.name] = figure


def report_tables() -> list[str]:
    """Every CSV the report writes beside ``index.html`` (without the ``.csv``)."""
    return [*HEADLINE_TABLES, *MEASURED, *INVENTORY_TABLES]


def _resolve(ref: str | Callable) -> Callable:
    if callable(ref):
        return ref
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


for _figure in (
    Measured("recovery_breakdown", "Recovery time breakdown", "reports.figures:recovery_breakdown"),
    Measured("ckpt_overhead", "Checkpoint overhead (against the interval where the matrix sweeps it)",
             "reports.figures:ckpt_overhead"),
    Measured("detection", "Detection coverage", "reports.figures:detection", note="reports.tables:false_alarm_note"),
    Measured("timeline", "Timelines: one representative run per strategy", "reports.timeline:timeline",
             note="reports.timeline:trace_links"),
    Measured("peers", "Ours against the libraries", "reports.peers:peers", note="reports.peers:peers_note"),
    Measured("recovery_peers", "Recovery without a checkpoint: ours against torchft and NVRx",
             "reports.recovery_peers:recovery_peers"),
    Measured("sharded", "Sharded training: FSDP and HSDP", "reports.sharded:sharded",
             note="reports.sharded:sharded_note", shown="reports.sharded:has_sharded_cells",
             caption="Checkpoint save (training-visible stall) and load after a fault per parallel setting, shard "
                     "count, strategy and fault (medians; bars: the median's interval, 95% from 6 runs, else the runs' range at its own level: 75% at n=3)."),
    Measured("per_step", "Per-step techniques: a gradient shadow and just-in-time checkpointing",
             "reports.per_step:per_step", note="reports.per_step:per_step_note", shown="reports.per_step:has_per_step",
             caption="Step time of the techniques that work at every step (shadow: each step's gradients applied by "
                     "a process beside the job; jit: each rank's own parts kept each step, the state written only "
                     "at a failure) against training with no checkpoint code, fault-free runs (medians; bars: the "
                     "median's interval, 95% from 6 runs, else the runs' range at its own level); the table adds the "
                     "shadow's lag behind the training (a lag of a whole step is a step a failure would lose)."),
    Measured("stage_recovery", "Pipeline parallelism: logging overhead and recovery side by side",
             "reports.stage_recovery:stage_recovery", note="reports.stage_recovery:stage_recovery_note",
             shown="reports.stage_recovery:has_stage_cells",
             caption="gpt_tiny cut into 2 stages, one pipeline (pp) and two replicated (pp_dp 2x2, 4 ranks on 2 "
                     "cores: contended step times), per technique: the fault-free step against none's (no "
                     "checkpoint, no log), the boundary log's bytes per step and most held, the run's peak memory; "
                     "after stage 1's rank is killed, the recovery and its parts, the steps trained again, the "
                     "stage-steps recomputed and the lost work (medians of ok, quiet runs; bars: the median's "
                     "interval, 95% from 6 runs, else the runs' range at its own level, 75% at n=3)."),
    Projected("goodput_vs_interval", "projection_interval_sweep.csv",
              "Projection: goodput against the checkpoint interval per strategy at the scenario's size; the star "
              "marks each strategy's optimal interval. Look at the height and the width of each peak: a flat peak "
              "forgives a badly chosen interval."),
    Projected("goodput_vs_cluster", "projection_cluster_sweep.csv",
              "Projection: goodput at the optimal interval against cluster size (lines: closed form; markers: "
              "Monte Carlo). Look at where the lines part: failures become frequent enough for recovery cost to "
              "matter."),
    Projected("winner_heatmap", "projection_winner_grid.csv",
              "Projection: the best strategy for each cluster size and checkpoint size, its goodput and its lead "
              "over the runner-up. Look for the boundary between regions."),
):
    register(_figure)
