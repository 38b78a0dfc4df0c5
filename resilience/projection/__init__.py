"""Project measured checkpoint and recovery costs to cluster scale (issue 7; docs/projection.md).

Roles, one module each: ``failure_model`` (how often, which recovery), ``cost_model`` (checkpoint costs at scale,
fitted from samples), ``calibration`` (the failure band: published figures inverted through the model),
``measured`` (fits from a DataFrame of runs), ``intervals`` (Young, Daly, exact optimum), ``goodput`` (closed form),
``simulator`` (Monte Carlo), ``scenario``/``settings`` (validated config), ``sweeps`` (tables), ``plots``,
``outputs`` (atomic files), ``report`` (summary) and ``cli``; ``run_model`` (the run-level model and its measurement)
and ``parity`` (its out-of-sample validation on real runs).
"""

from __future__ import annotations

from resilience.projection.calibration import FailureBand, PublishedFigure, read_figures
from resilience.projection.cost_model import ComponentCost, CostsAtScale, StrategyCosts, fit_component
from resilience.projection.failure_model import (RECOVERY_KINDS, FailureModel, FailureTable, RecoveryKind,
                                                 per_gpu_mttf_hours)
from resilience.projection.goodput import goodput, predicted_goodput, recovery_survival
from resilience.projection.intervals import daly_interval, optimal_interval, young_interval
from resilience.projection.measured import fit_strategies, read_measured
from resilience.projection.scenario import Scenario, Storage, build_scenario
from resilience.projection.simulator import SimulationResult, simulate
from resilience.projection.validation import ConfigError

__all__ = [
    "RECOVERY_KINDS", "ComponentCost", "ConfigError", "CostsAtScale", "FailureBand", "FailureModel", "FailureTable",
    "PublishedFigure", "RecoveryKind", "read_figures",
    "Scenario", "SimulationResult", "Storage", "StrategyCosts", "build_scenario", "daly_interval", "fit_component",
    "fit_strategies", "goodput", "optimal_interval", "per_gpu_mttf_hours", "predicted_goodput", "read_measured",
    "recovery_survival", "simulate", "young_interval",
]
