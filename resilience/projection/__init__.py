"""Project measured checkpoint and recovery costs to cluster scale (issue 7; docs/projection.md).

Roles, one module each: ``failure_model`` (how often, which recovery), ``cost_model`` (checkpoint costs at scale,
fitted from samples), ``calibration`` (the failure band: published figures inverted through the model),
``measured`` (fits from a DataFrame of runs), ``pipeline_rules`` (the pipeline techniques' lost work and per-step
overhead), ``intervals`` (Young, Daly, exact optimum), ``goodput`` (closed form), ``simulator`` (Monte Carlo),
``scenario``/``settings`` (validated config), ``sweeps`` (tables), ``plots``,
``outputs`` (atomic files), ``report`` (summary) and ``cli``; ``run_model`` (the run-level model and its measurement)
and ``parity`` (its out-of-sample validation on real runs).
"""

from __future__ import annotations

import importlib
from typing import Any

# goodput names a module and its function: imported here (numpy alone), since once the module is imported the
# package's attribute `goodput` would be the module, and __getattr__ is asked only for what is missing
from resilience.projection.goodput import goodput, predicted_goodput, recovery_survival  # noqa: E402,F401

# name -> its module: imported on first use (PEP 562), so that a rank needing one formula (checkpoint.every=auto
# uses ``intervals``) does not import pandas with the fitting and report modules (1.1 s at a rank's start)
_WHERE = {
    "calibration": ("FailureBand", "PublishedFigure", "read_figures"),
    "cost_model": ("ComponentCost", "CostsAtScale", "StrategyCosts", "fit_component"),
    "failure_model": ("RECOVERY_KINDS", "FailureModel", "FailureTable", "RecoveryKind", "per_gpu_mttf_hours"),
    "intervals": ("daly_interval", "optimal_interval", "young_interval"),
    "measured": ("fit_strategies", "read_measured"),
    "pipeline_rules": ("pipeline_costs",),
    "scenario": ("Scenario", "Storage", "build_scenario"),
    "simulator": ("SimulationResult", "simulate"),
    "validation": ("ConfigError",),
}
_MODULE = {name: module for module, names in _WHERE.items() for name in names}
__all__ = sorted([*_MODULE, "goodput", "predicted_goodput", "recovery_survival"])


def __getattr__(name: str) -> Any:
    if name not in _MODULE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE[name]}"), name)

