"""``python -m resilience.projection scenario=<name>``: project measured costs to cluster scale.

Reads ``conf/projection.yaml`` (+ ``conf/scenario/<name>.yaml``) with Hydra, writes CSVs and PNGs into
``output_dir`` (default: the Hydra run dir) and prints a summary. A bad configuration value is reported as one
line on stderr (``scenario.gpus=0: must be an integer >= 1``) and exit status 2, without a traceback.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import hydra
import pandas as pd
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from resilience.settings.command_line import CommandLineError, compose_checked
from resilience.projection import plots, sweeps
from resilience.projection.calibration import FailureBand, read_figures, select
from resilience.projection.measured import fit_strategies, read_measured
from resilience.projection.outputs import write_csv, write_png
from resilience.projection.pipeline_rules import pipeline_costs
from resilience.projection.report import format_summary
from resilience.projection.scenario import Scenario, build_scenario, resolve_path
from resilience.projection.settings import CONF_DIR, Settings, build_settings, search_dirs
from resilience.projection.sharded import per_shard_fit
from resilience.projection.simulator import SimulationResult, simulate
from resilience.projection.validation import ConfigError


@dataclass(frozen=True)
class ProjectionRun:
    """What a run produced: the printed summary and the files written."""

    summary: str
    files: list[Path]


def load(cfg: Mapping[str, Any], cwd: Path) -> tuple[Settings, Scenario, str | None]:
    """Validate the config and build the scenario, with costs fitted from ``measured_csv`` when one is given."""
    settings = build_settings(cfg)
    dirs = search_dirs(CONF_DIR, cwd)
    scn = build_scenario(cfg.get("scenario"), dirs)
    failure_band(settings, cwd)  # checked here, so that a bad figure fails before anything runs
    measured = None
    if settings.measured_csv:
        path = resolve_path(settings.measured_csv, "measured_csv", dirs)
        try:
            frame = read_measured(str(path))
        except (OSError, ValueError) as err:
            raise ConfigError(f"measured_csv={settings.measured_csv}: cannot be read ({err})") from None
        # the checkpoint costs fitted, then the pipeline techniques' rules (lost work, per-step overhead) on top
        scn = scn.with_strategies(pipeline_costs(fit_strategies(frame, scn.strategies), frame, scn.pipeline_stages))
        measured = str(path)
    return settings, scn, measured


def failure_band(settings: Settings, cwd: Path) -> FailureBand:
    """The band the published figures of ``failure_band.figures_csv`` span (those in ``failure_band.use``)."""
    path = resolve_path(settings.band_figures_csv, "failure_band.figures_csv", search_dirs(CONF_DIR, cwd))
    figures = read_figures(path, "failure_band.figures_csv")
    return FailureBand.of(select(figures, settings.band_use, "failure_band.use"))


def monte_carlo(scn: Scenario, settings: Settings) -> tuple[dict[str, SimulationResult], float]:
    """Simulate every feasible strategy at its optimal interval; returns the results and the seconds it took."""
    started, results = time.perf_counter(), {}
    for i, name in enumerate(scn.strategies):
        p = sweeps.evaluate(scn, name)
        if p.costs.feasible:
            results[name] = simulate(p.costs, scn.failure, scn.kinds, gpus=scn.gpus, interval_s=p.interval_s,
                                     horizon_s=scn.horizon_s, trials=settings.trials, seed=settings.seed + i,
                                     bootstrap=settings.bootstrap)
    return results, time.perf_counter() - started


def cluster_monte_carlo(scn: Scenario, settings: Settings, sizes: tuple[int, ...]) -> pd.DataFrame:
    """Monte Carlo goodput at a few cluster sizes (markers on the cluster figure); empty if disabled."""
    rows = []
    for gpus in sizes if settings.cluster_trials else ():
        for i, name in enumerate(scn.strategies):
            p = sweeps.evaluate(scn, name, gpus)
            if not p.costs.feasible:
                continue
            sim = simulate(p.costs, scn.failure, scn.kinds, gpus=gpus, interval_s=p.interval_s,
                           horizon_s=scn.horizon_s, trials=settings.cluster_trials, seed=settings.seed + 1000 + i,
                           bootstrap=settings.bootstrap)
            rows.append({"label": sweeps.LABEL, "scenario": scn.name, "strategy": name, "gpus": gpus,
                         "goodput_monte_carlo": sim.mean, "goodput_monte_carlo_ci95": sim.ci95,
                         "trials": settings.cluster_trials})
    return pd.DataFrame(rows)


def run(cfg: Mapping[str, Any], default_out_dir: Path | None = None, cwd: Path | None = None) -> ProjectionRun:
    """The whole projection for a plain-mapping config; raises :class:`ConfigError` on a bad value.

    Outputs go to ``cfg["output_dir"]`` if set, else to ``default_out_dir`` (the CLI passes the Hydra run dir).
    """
    cwd = Path.cwd() if cwd is None else cwd
    settings, scn, measured = load(cfg, cwd)
    band = failure_band(settings, cwd)
    if settings.output_dir is None and default_out_dir is None:
        raise ConfigError("output_dir=None: must be a path when not run through Hydra")
    out_dir = Path(settings.output_dir) if settings.output_dir else Path(default_out_dir)
    mc, mc_seconds = monte_carlo(scn, settings)
    summary = sweeps.strategy_summary(scn, mc, band)
    calibration = band.table(scn.failure.per_gpu_mttf_h, scn.name)
    tables = {
        "projection_summary.csv": summary,
        "projection_calibration.csv": calibration,
        "projection_failure_mix.csv": sweeps.failure_mix(scn),
        "projection_interval_sweep.csv": sweeps.interval_sweep(scn, settings.interval_points),
        "projection_cluster_sweep.csv": sweeps.cluster_sweep(scn, settings.cluster_sizes, band),
        "projection_winner_grid.csv": sweeps.winner_grid(scn, settings.cluster_sizes, settings.ckpt_sizes_TB, band,
                                                         settings.winner_trials, settings.seed + 2000),
    }
    # Markers at the ends and the middle of the size range are enough to show the closed form holds (or not).
    marker_sizes = tuple(sorted({settings.cluster_sizes[0], scn.gpus, settings.cluster_sizes[-1]}))
    cluster_mc = cluster_monte_carlo(scn, settings, marker_sizes)
    if len(cluster_mc):
        tables["projection_cluster_monte_carlo.csv"] = cluster_mc
    fit = per_shard_fit(read_measured(measured)) if measured else None
    if fit is not None and len(fit):  # the per-shard line the strategy fit used for sharded runs, with its inputs
        fit.insert(0, "label", sweeps.LABEL)
        tables["projection_per_shard.csv"] = fit
    out_dir.mkdir(parents=True, exist_ok=True)
    files = [write_csv(frame, out_dir / name) for name, frame in tables.items()]
    where = f"{scn.name}, {scn.gpus:,} GPUs, {scn.ckpt_bytes / sweeps.TB:.2f} TB checkpoint"
    mtbf = f"job MTBF {scn.mtbf_s / 3600:.2f} h"
    figures = {
        "projection_goodput_vs_interval.png":
            plots.goodput_vs_interval(tables["projection_interval_sweep.csv"], f"{where}, {mtbf}"),
        "projection_goodput_vs_cluster.png":
            plots.goodput_vs_cluster(tables["projection_cluster_sweep.csv"], where, cluster_mc),
        "projection_winner_heatmap.png":
            plots.winner_heatmap(tables["projection_winner_grid.csv"], f"{scn.name} failure and cost model"),
        "projection_failure_band.png":
            plots.failure_band(calibration, band.low_h, band.high_h, f"{scn.name}; band {band.low_h:,.0f}-"
                               f"{band.high_h:,.0f} GPU-hours per failure"),
    }
    for name, fig in figures.items():
        files.append(write_png(fig, out_dir / name))
        plots.close(fig)
    text = format_summary(scn, summary, settings.example_stalls_s, mc_seconds, settings.trials, str(out_dir),
                          measured, band, calibration, tables["projection_winner_grid.csv"])
    return ProjectionRun(text, files)


# An absolute path computed from this file: with "python -m", Hydra would resolve a relative config_path as a
# Python package ("pkg://conf"), and conf/ is a plain directory.
@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="projection")
def main(cfg: DictConfig) -> None:
    """Hydra entry point: resolve the output dir, run, print the summary; a bad value exits 2 with one line."""
    try:
        plain = OmegaConf.to_container(cfg, resolve=True)
        result = run(plain, Path(HydraConfig.get().runtime.output_dir))
    except ConfigError as err:
        print(err, file=sys.stderr)
        sys.exit(2)
    print(result.summary)


def precheck(argv: list[str]) -> None:
    """The whole validation of a command line, before Hydra creates anything; raises on the first bad value."""
    composed = compose_checked(CONF_DIR, "projection", argv)
    with open_dict(composed):
        del composed["hydra"]
    load(OmegaConf.to_container(composed, resolve=True), Path.cwd())


def cli() -> None:
    """``python -m resilience.projection``: the command line checked first (one line, exit 2, nothing created)."""
    try:
        precheck(sys.argv[1:])
    except (CommandLineError, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    main()
