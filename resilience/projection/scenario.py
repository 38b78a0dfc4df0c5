"""A scenario: the target cluster and model, its failure model, and the default cost model of each strategy.

Built from one ``conf/scenario/*.yaml`` (as a plain mapping, so it works with Hydra, the compose API or a dict);
every value is validated here and a bad one raises :class:`ConfigError` naming the field, e.g.
``scenario.gpus=0: must be an integer >= 1``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from resilience.projection.cost_model import GB, ComponentCost, CostsAtScale, StrategyCosts
from resilience.projection.failure_model import (DISTRIBUTIONS, RECOVERY_KINDS, FailureModel, FailureTable,
                                                 RecoveryKind, per_gpu_mttf_hours)
from resilience.projection.validation import (ConfigError, as_bool, as_choice, as_float, as_int, as_name,
                                              as_optional_float, fail, require_keys)


@dataclass(frozen=True)
class Storage:
    """Checkpoint sharding and the storage system: one writer per ``gpus_per_writer`` GPUs, shared bandwidth cap."""

    gpus_per_writer: int
    aggregate_Bps: float | None  # None: no cap beyond the writers' own bandwidth

    def writers(self, gpus: int) -> int:
        return max(1, math.ceil(gpus / self.gpus_per_writer))


@dataclass(frozen=True)
class Scenario:
    """Everything a projection needs about the target; costs come from ``strategies`` (defaults or fitted)."""

    name: str
    description: str
    gpus: int
    duration_days: float
    params: float
    bytes_per_param: float
    failure: FailureModel
    kinds: tuple[RecoveryKind, ...]  # RECOVERY_KINDS order, aligned with failure.kind_shares
    kind_counts: dict[str, int]
    table: FailureTable
    row_kinds: tuple[str, ...]  # recovery kind of each table row
    table_path: Path
    storage: Storage
    strategies: dict[str, StrategyCosts]
    pipeline_stages: int | None = None  # the target's pipeline degree, where given (projection.pipeline_rules)

    @property
    def ckpt_bytes(self) -> float:
        """Full checkpoint size: parameters x bytes per parameter (weights plus optimizer state)."""
        return self.params * self.bytes_per_param

    @property
    def horizon_s(self) -> float:
        return self.duration_days * 86400.0

    @property
    def mtbf_s(self) -> float:
        """Job MTBF at the scenario's GPU count."""
        return self.failure.job_mtbf_s(self.gpus)

    def costs_at(self, strategy: str, gpus: int | None = None, ckpt_bytes: float | None = None) -> CostsAtScale:
        """Costs of ``strategy`` for a checkpoint of ``ckpt_bytes`` (default: the scenario's) on ``gpus`` GPUs."""
        gpus = self.gpus if gpus is None else gpus
        nbytes = self.ckpt_bytes if ckpt_bytes is None else ckpt_bytes
        return self.strategies[strategy].at_scale(nbytes, self.storage.writers(gpus), self.storage.aggregate_Bps)

    def with_strategies(self, strategies: Mapping[str, StrategyCosts]) -> "Scenario":
        return dataclasses.replace(self, strategies=dict(strategies))

    def with_per_gpu_mttf(self, per_gpu_mttf_h: float) -> "Scenario":
        """The same scenario at another failure rate (the failure band's edges); the mix of kinds is kept."""
        return dataclasses.replace(self, failure=dataclasses.replace(self.failure, per_gpu_mttf_h=per_gpu_mttf_h))


def resolve_path(value: Any, field: str, search_dirs: Sequence[Path]) -> Path:
    """An absolute path as is; a relative one is looked up in ``search_dirs`` in order (first hit wins)."""
    name = as_name(value, field)
    path = Path(name).expanduser()
    if path.is_absolute():
        candidates = [path]
    else:
        candidates = [Path(d) / path for d in search_dirs]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    fail(field, name, "file not found (relative paths are looked up in: "
         + ", ".join(str(d) for d in search_dirs) + ")")


def build_scenario(node: Mapping[str, Any], search_dirs: Sequence[Path], prefix: str = "scenario") -> Scenario:
    """Validate a scenario mapping and build the :class:`Scenario`; ``prefix`` is used in error messages."""
    require_keys(node, prefix, ["name", "gpus", "duration_days", "model", "failures", "recovery_kinds",
                                "storage", "strategies"])
    model, fnode = node["model"], node["failures"]
    require_keys(model, f"{prefix}.model", ["params", "bytes_per_param"])
    require_keys(fnode, f"{prefix}.failures", ["table_csv", "kind_by_component", "kind_by_category"])
    table_path = resolve_path(fnode["table_csv"], f"{prefix}.failures.table_csv", search_dirs)
    table = FailureTable.from_csv(table_path, f"{prefix}.failures.table_csv")
    row_kinds = table.row_kinds(dict(fnode["kind_by_component"] or {}), dict(fnode["kind_by_category"] or {}),
                                f"{prefix}.failures")
    kind_counts = table.kind_counts(row_kinds)
    mttf = as_optional_float(fnode.get("per_gpu_mttf_h"), f"{prefix}.failures.per_gpu_mttf_h", gt=0)
    if mttf is None:  # calibrate from the table: GPU-hours observed per interruption
        gpus_seen = as_int(fnode.get("table_gpus"), f"{prefix}.failures.table_gpus", 1)
        days_seen = as_float(fnode.get("table_days"), f"{prefix}.failures.table_days", gt=0)
        mttf = per_gpu_mttf_hours(table.total, gpus_seen, days_seen)
    distribution = as_choice(fnode.get("distribution", "exponential"), f"{prefix}.failures.distribution",
                             DISTRIBUTIONS)
    shape = as_float(fnode.get("weibull_shape", 1.0), f"{prefix}.failures.weibull_shape", gt=0)
    return Scenario(
        name=as_name(node["name"], f"{prefix}.name"),
        description=str(node.get("description") or ""),
        gpus=as_int(node["gpus"], f"{prefix}.gpus", 1),
        duration_days=as_float(node["duration_days"], f"{prefix}.duration_days", gt=0),
        params=as_float(model["params"], f"{prefix}.model.params", gt=0),
        bytes_per_param=as_float(model["bytes_per_param"], f"{prefix}.model.bytes_per_param", gt=0),
        failure=FailureModel.from_counts(mttf, kind_counts, distribution, shape),
        kinds=_recovery_kinds(node["recovery_kinds"], f"{prefix}.recovery_kinds"),
        kind_counts=kind_counts, table=table, row_kinds=row_kinds, table_path=table_path,
        storage=_storage(node["storage"], f"{prefix}.storage"),
        strategies=_strategies(node["strategies"], f"{prefix}.strategies"),
        pipeline_stages=None if node.get("pipeline_stages") is None else
        as_int(node["pipeline_stages"], f"{prefix}.pipeline_stages", 1),
    )


def _recovery_kinds(node: Mapping[str, Any], field: str) -> tuple[RecoveryKind, ...]:
    require_keys(node, field, RECOVERY_KINDS)
    kinds = []
    for name in RECOVERY_KINDS:
        require_keys(node[name], f"{field}.{name}", ["detection_s", "repair_s"])
        kinds.append(RecoveryKind(name, as_float(node[name]["detection_s"], f"{field}.{name}.detection_s", ge=0),
                                  as_float(node[name]["repair_s"], f"{field}.{name}.repair_s", ge=0)))
    return tuple(kinds)


def _storage(node: Mapping[str, Any], field: str) -> Storage:
    require_keys(node, field, ["gpus_per_writer", "aggregate_GBps"])
    cap = as_optional_float(node["aggregate_GBps"], f"{field}.aggregate_GBps", gt=0)
    return Storage(as_int(node["gpus_per_writer"], f"{field}.gpus_per_writer", 1), None if cap is None else cap * GB)


def _component(node: Mapping[str, Any], field: str) -> ComponentCost:
    require_keys(node, field, ["fixed_s"])
    bandwidth = as_optional_float(node.get("per_writer_GBps"), f"{field}.per_writer_GBps", gt=0)
    return ComponentCost(as_float(node["fixed_s"], f"{field}.fixed_s", ge=0),
                         None if bandwidth is None else bandwidth * GB,
                         as_bool(node.get("storage_bound", False), f"{field}.storage_bound"))


def _strategies(node: Mapping[str, Any], field: str) -> dict[str, StrategyCosts]:
    if not node or not hasattr(node, "items"):
        fail(field, node, "must be a mapping with at least one strategy")
    out = {}
    for name, spec in node.items():
        f = f"{field}.{name}"
        checkpoints = as_bool(spec.get("checkpoint", True), f"{f}.checkpoint")
        require_keys(spec, f, ["stall", "durable", "load", "restart"] if checkpoints else ["load", "restart"])
        if not checkpoints and ("stall" in spec or "durable" in spec):
            fail(f"{f}.stall", spec.get("stall", spec.get("durable")), "must be absent when checkpoint is false")
        limit = as_optional_float(spec.get("max_shard_GB"), f"{f}.max_shard_GB", gt=0)
        share = as_float(spec.get("bytes_share", 1.0), f"{f}.bytes_share", gt=0, le=1)  # of the state, per save
        overhead = as_float(spec.get("step_overhead", 0.0), f"{f}.step_overhead", ge=0)
        if overhead >= 1:
            fail(f"{f}.step_overhead", overhead, "must be a number in [0, 1): the share of each step it costs")
        out[str(name)] = StrategyCosts(
            name=str(name), stall=_saving(spec, "stall", f), durable=_saving(spec, "durable", f),
            load=_component(spec["load"], f"{f}.load"), restart=_component(spec["restart"], f"{f}.restart"),
            max_bytes_per_writer=None if limit is None else limit * GB, description=str(spec.get("description", "")),
            checkpoints=checkpoints, bytes_share=share, step_overhead=overhead)
    return out


def _saving(spec: Mapping[str, Any], component: str, field: str) -> ComponentCost:
    """A save component (stall, durable); zero for a strategy that does not checkpoint."""
    return _component(spec[component], f"{field}.{component}") if component in spec else ComponentCost(0.0)


__all__ = ["ConfigError", "Scenario", "Storage", "build_scenario", "resolve_path"]
