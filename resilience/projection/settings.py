"""Run settings of the projection CLI (everything in ``conf/projection.yaml`` except the scenario), validated."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from resilience.projection.validation import as_bool, as_float, as_int, as_name, fail, require_keys

#: The repository's top-level ``conf/`` directory (found from this file, so no machine-specific path is stored).
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


@dataclass(frozen=True)
class Settings:
    """Validated run settings; ``output_dir``/``measured_csv`` are as written (resolved by the CLI)."""

    output_dir: str | None
    measured_csv: str | None
    trials: int
    seed: int
    bootstrap: bool
    cluster_trials: int
    winner_trials: int
    interval_points: int
    cluster_sizes: tuple[int, ...]
    ckpt_sizes_TB: tuple[float, ...]
    example_stalls_s: tuple[float, ...]
    band_figures_csv: str
    band_use: tuple[str, ...] | None  # None: every figure of the file


def _list(value: Any, field: str) -> Sequence[Any]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) == 0:
        fail(field, value, "must be a non-empty list")
    return value


def build_settings(cfg: Mapping[str, Any]) -> Settings:
    """Validate the non-scenario part of the projection config (a plain mapping)."""
    require_keys(cfg, "config", ["monte_carlo", "sweep", "summary", "failure_band"])
    band = cfg["failure_band"]
    require_keys(band, "failure_band", ["figures_csv", "use"])
    mc, sweep, summary = cfg["monte_carlo"], cfg["sweep"], cfg["summary"]
    require_keys(mc, "monte_carlo", ["trials", "seed", "bootstrap", "cluster_trials", "winner_trials"])
    require_keys(sweep, "sweep", ["interval_points", "cluster_sizes", "ckpt_sizes_TB"])
    require_keys(summary, "summary", ["example_stalls_s"])
    out_dir, measured = cfg.get("output_dir"), cfg.get("measured_csv")
    for field, value in (("output_dir", out_dir), ("measured_csv", measured)):
        if value is not None and (not isinstance(value, str) or not value):
            fail(field, value, "must be a path or null")
    return Settings(
        output_dir=out_dir,
        measured_csv=measured,
        trials=as_int(mc["trials"], "monte_carlo.trials", 1),
        seed=as_int(mc["seed"], "monte_carlo.seed", 0),
        bootstrap=as_bool(mc["bootstrap"], "monte_carlo.bootstrap"),
        cluster_trials=as_int(mc["cluster_trials"], "monte_carlo.cluster_trials", 0),
        winner_trials=as_int(mc["winner_trials"], "monte_carlo.winner_trials", 0),
        interval_points=as_int(sweep["interval_points"], "sweep.interval_points", 10),
        cluster_sizes=tuple(as_int(v, f"sweep.cluster_sizes[{i}]", 1)
                            for i, v in enumerate(_list(sweep["cluster_sizes"], "sweep.cluster_sizes"))),
        ckpt_sizes_TB=tuple(as_float(v, f"sweep.ckpt_sizes_TB[{i}]", gt=0)
                            for i, v in enumerate(_list(sweep["ckpt_sizes_TB"], "sweep.ckpt_sizes_TB"))),
        example_stalls_s=tuple(as_float(v, f"summary.example_stalls_s[{i}]", gt=0)
                               for i, v in enumerate(_list(summary["example_stalls_s"], "summary.example_stalls_s"))),
        band_figures_csv=as_name(band["figures_csv"], "failure_band.figures_csv"),
        band_use=None if band["use"] is None else tuple(
            as_name(v, f"failure_band.use[{i}]") for i, v in enumerate(_list(band["use"], "failure_band.use"))),
    )


def search_dirs(conf_dir: Path, cwd: Path) -> list[Path]:
    """Where relative data paths are looked up: the launch directory first, then the ``conf/`` directory."""
    return [cwd, conf_dir]
