"""Per-strategy cost models fitted from measured runs (one row per run, as the benchmark runner reports them).

Columns used (flattened names, as ``pandas.json_normalize`` writes nested results):

============================== ======== ==========================================================
column                         needed   use
============================== ======== ==========================================================
strategy                       yes      groups rows
ckpt_bytes                     yes      total checkpoint bytes of the run
ckpt_stall_s                   yes      training-visible stall per checkpoint -> ``stall``
ckpt_durable_s                 no       checkpoint start -> durable -> ``durable`` (else = stall)
recovery_breakdown_s.load      no       checkpoint load on recovery -> ``load``
recovery_breakdown_s.restart   -        never fitted: see below
detection_latency_s            -        never fitted: see below
ckpt_writers or world_size     no       ranks that wrote the checkpoint (bytes per writer); else 1
parallel.shards_per_replica    no       a sharded run's writers: each writes one shard (``sharded.py``)
============================== ======== ==========================================================

A component whose column is missing (or all NaN for a strategy) keeps the scenario's default for that strategy;
if the scenario has no such strategy either, a :class:`ConfigError` names the column. ``step_time_s`` and other
columns are ignored here.

One cost basis at scale: the restart (relaunching the job's processes, forming its communicators) and the
detection of a failure are the job's and the cluster's, not the technique's, and what a few local ranks measure of
them (~3 s and ~0.1 s here) says nothing of 16,384 GPUs. So every strategy, measured or not, takes them from the
scenario: its own ``restart`` entry, else the scenario's ``sync`` one (``RESTART_BASIS``), and the scenario's
detection time of each recovery kind. Only what scales with the checkpoint (its bytes per writer over the fitted
bandwidth, and the fixed part of stall, durability and load) is fitted.
"""

from __future__ import annotations

import logging
from typing import Mapping

import numpy as np
import pandas as pd

from resilience.projection.cost_model import ComponentCost, StrategyCosts, fit_component
from resilience.projection.sharded import resized, shards
from resilience.projection.validation import ConfigError

log = logging.getLogger(__name__)

REQUIRED_COLUMNS: tuple[str, ...] = ("strategy", "ckpt_bytes", "ckpt_stall_s")
OPTIONAL_COLUMNS: dict[str, str] = {
    "durable": "ckpt_durable_s",
    "load": "recovery_breakdown_s.load",
}
RESTART_BASIS = "sync"  # the scenario's restart for a strategy it does not list
WRITER_COLUMNS: tuple[str, ...] = ("ckpt_writers", "world_size")


def fit_strategies(measured: pd.DataFrame, defaults: Mapping[str, StrategyCosts]) -> dict[str, StrategyCosts]:
    """Fit a :class:`StrategyCosts` per strategy in ``measured``; strategies only in ``defaults`` are kept as is.

    Strategies that never wrote a checkpoint (no row with ``ckpt_bytes > 0`` and a stall) are skipped with a
    logged warning: without checkpoints every failure restarts from scratch, which the interval model does not cover.
    """
    if not isinstance(measured, pd.DataFrame):
        raise ConfigError(f"measured={type(measured).__name__}: must be a pandas DataFrame")
    for column in REQUIRED_COLUMNS:
        if column not in measured.columns:
            raise ConfigError(f"measured: column '{column}' missing (required: {', '.join(REQUIRED_COLUMNS)})")
    measured = measured[timed(measured) & ~resized(measured)]  # a shrunk run: its saves mix two shard counts
    writers = shards(measured).fillna(_writers(measured))  # FSDP/HSDP: the shard count, whatever the world size
    out = dict(defaults)
    for name, rows in measured.groupby("strategy", sort=True):
        name = str(name)
        per_writer = pd.to_numeric(rows["ckpt_bytes"], errors="coerce") / writers.loc[rows.index]
        fitted = _fit_one(name, rows, per_writer, defaults.get(name), _restart(name, defaults))
        if fitted is None:
            log.warning("measured: strategy '%s' has no checkpoint samples; skipped", name)
            continue
        out[name] = fitted
    return out


def timed(measured: pd.DataFrame) -> pd.Series:
    """The rows whose times may be fitted: ended ``ok`` and not measured on a busy host (``validity.verdict``
    noisy), where the pipeline's summary says so (a results file without those columns is taken whole)."""
    keep = pd.Series(True, index=measured.index)
    if "state" in measured.columns:
        keep &= measured["state"].astype(str) == "ok"
    if "validity.verdict" in measured.columns:
        keep &= measured["validity.verdict"].astype(str) != "noisy"
    return keep


def _restart(name: str, defaults: Mapping[str, StrategyCosts]) -> ComponentCost:
    """The scenario's restart for strategy ``name`` (its own entry, else ``RESTART_BASIS``'s)."""
    for key in (name, RESTART_BASIS):
        if key in defaults:
            return defaults[key].restart
    raise ConfigError(f"scenario: no restart cost for strategy '{name}' and no '{RESTART_BASIS}' strategy to take "
                      f"it from: give strategies.{RESTART_BASIS}.restart in the scenario")


def _writers(measured: pd.DataFrame) -> pd.Series:
    for column in WRITER_COLUMNS:
        if column in measured.columns:
            w = pd.to_numeric(measured[column], errors="coerce").fillna(1.0)
            if (w < 1).any():
                raise ConfigError(f"measured: column '{column}' must be >= 1 in every row")
            return w
    return pd.Series(1.0, index=measured.index)


def _samples(rows: pd.DataFrame, per_writer: pd.Series, column: str) -> tuple[np.ndarray, np.ndarray]:
    """(bytes per writer, seconds) of rows where both are valid numbers."""
    seconds = pd.to_numeric(rows[column], errors="coerce")
    ok = per_writer.notna() & seconds.notna() & (per_writer >= 0) & (seconds >= 0)
    return per_writer[ok].to_numpy(float), seconds[ok].to_numpy(float)


def _fit_one(name: str, rows: pd.DataFrame, per_writer: pd.Series, default: StrategyCosts | None,
             restart: ComponentCost) -> StrategyCosts | None:
    x, stall_y = _samples(rows, per_writer, "ckpt_stall_s")
    if not np.any(x > 0):
        return None
    durable_y = None
    if OPTIONAL_COLUMNS["durable"] in rows.columns:
        _, durable_y = _samples(rows, per_writer, OPTIONAL_COLUMNS["durable"])
    # Where the default does not say, a stall that lasts as long as the save (synchronous) is storage-bound.
    asynchronous = durable_y is not None and durable_y.size > 0 and \
        float(np.median(durable_y)) > 1.1 * float(np.median(stall_y))
    stall_bound = default.stall.storage_bound if default else not asynchronous
    components: dict[str, ComponentCost] = {"stall": fit_component(x, stall_y, storage_bound=stall_bound),
                                            "restart": restart}
    for component, column in OPTIONAL_COLUMNS.items():
        bound = getattr(default, component).storage_bound if default else True
        cx, cy = _samples(rows, per_writer, column) if column in rows.columns else (np.empty(0), np.empty(0))
        if cy.size:
            components[component] = fit_component(cx, cy, storage_bound=bound)
        elif default is not None:
            components[component] = getattr(default, component)
        elif component == "durable":
            components[component] = components["stall"]  # nothing persists after the stall: synchronous
        else:
            raise ConfigError(f"measured: column '{column}' missing or empty for strategy '{name}', "
                              f"and the scenario has no default strategy '{name}' to fall back on")
    return StrategyCosts(name=name, detection_samples=(),  # the scenario's detection times (module docstring)
                         max_bytes_per_writer=default.max_bytes_per_writer if default else None,
                         # what the runs measure is a rate per byte written: the share written stays the scenario's
                         bytes_share=default.bytes_share if default else 1.0,
                         step_overhead=default.step_overhead if default else 0.0,
                         description=(default.description if default else "") + " (fitted from measured runs)",
                         **components)


def read_measured(path: str) -> pd.DataFrame:
    """Load measured results from a CSV (flattened columns) or JSON-lines file of per-run results."""
    if str(path).endswith((".jsonl", ".json")):
        return pd.json_normalize(pd.read_json(path, lines=str(path).endswith(".jsonl")).to_dict("records"))
    return pd.read_csv(path)
