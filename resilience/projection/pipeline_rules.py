"""The pipeline techniques' cost models: what a failure costs under Swift's logging (Zhong et al., TPDS 2024).

Under pipeline parallelism over S stages, ``sync`` (checkpoint-restart) sends every stage back to its checkpoint:
the job retrains the steps since, as the closed form assumes (lost work factor f = 1). Under ``swift_log`` every
stage logs what it sends across its boundaries; after a failure only the failed stage's rank restarts, loads its own
checkpoint and replays the steps since from its neighbours' logs while the other stages, which keep their state,
wait: the job loses (steps since the checkpoint) x step time / S, f = 1/S. Under ``swift_log_selective``
(``log_every`` = g) the g stages between two logged boundaries recover as one group and retrain the steps together:
f = g / S; on the 2 stages measured (g = 2 = S) nothing is logged and every stage retrains, f = 1, as sync.

S at scale: the scenario's ``pipeline_stages`` where it gives one, else the stages of the measured runs
(``parallel.shards_per_replica`` of a ``pp``/``pp_dp`` run). The restart stays the scenario's (one cost basis,
:mod:`resilience.projection.measured`), so that a Swift recovery restarts one rank and not the job is not credited.

Per-step overhead (logging the boundary tensors): the median step time over ``none``'s under the same parallel
setting, minus 1, where the ratio's interval (``reports.stats.ratio_estimate``, the report's rule) is at 95% and
clear of 1; otherwise 0, the reason in the strategy's ``note``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping

import pandas as pd

from reports.stats import LEVEL, level_text, ratio_estimate
from resilience.projection.cost_model import StrategyCosts
from resilience.projection.measured import timed

BASELINE = "none"  # no checkpoint, no log: the step time's reference
PIPELINES = ("pp", "pp_dp")  # parallel.name of a pipeline run; its shards_per_replica are its stages


@dataclass(frozen=True)
class PipelineRule:
    """How a pipeline technique recovers: ``group`` stages retrain a failure's lost steps, the others wait."""

    group: int

    def lost_work_factor(self, stages: int) -> float:
        return min(self.group, stages) / stages


# The one table of the pipeline techniques; 2 is log_every of conf/strategy/swift_log_selective.yaml (a test holds it).
RULES: dict[str, PipelineRule] = {"swift_log": PipelineRule(group=1), "swift_log_selective": PipelineRule(group=2)}


def pipeline_costs(costs: Mapping[str, StrategyCosts], measured: pd.DataFrame | None,
                   stages_at_scale: int | None) -> dict[str, StrategyCosts]:
    """``costs`` with each pipeline technique's lost work factor and per-step overhead set (module docstring)."""
    out = dict(costs)
    rows = measured[timed(measured)] if measured is not None and "strategy" in measured else pd.DataFrame()
    for name, rule in RULES.items():
        if name not in out:
            continue
        own = rows[rows["strategy"] == name] if len(rows) else rows
        where = _main_setting(own)
        stages, whose = (stages_at_scale, "the scenario's pipeline_stages") if stages_at_scale else \
            (_stages(own, where), "the measured runs' stages")
        if stages is None:
            factor, lost = 1.0, "lost work as sync's (no pipeline stages known)"
        else:
            factor = rule.lost_work_factor(stages)
            group = min(rule.group, stages)
            lost = f"lost work x {group}/{stages} ({group} of S = {stages} stages retrain, the others wait, S {whose})"
        overhead, why = _step_overhead(rows, name, where)
        if overhead is None:
            overhead, why = out[name].step_overhead, f"step overhead {out[name].step_overhead:g}: {why}"
        out[name] = dataclasses.replace(out[name], lost_work_factor=factor, step_overhead=overhead,
                                        note=f"{lost}; {why}")
    return out


def _settings(rows: pd.DataFrame) -> pd.Series:
    """Per row: the parallel setting ("pp [2]", "pp_dp [2, 2]"); one setting where the runs do not say."""
    name = rows.get("parallel.name", pd.Series("ddp", index=rows.index)).fillna("ddp").astype(str)
    mesh = rows.get("parallel.mesh", pd.Series("", index=rows.index)).fillna("").astype(str)
    return (name + " " + mesh).str.strip()


def _main_setting(rows: pd.DataFrame) -> str | None:
    """The setting most of ``rows`` ran under (the first by name on a tie); None without rows."""
    if not len(rows):
        return None
    counts = _settings(rows).value_counts()
    return str(sorted(counts[counts == counts.max()].index)[0])


def _stages(rows: pd.DataFrame, where: str | None) -> int | None:
    """The pipeline stages of the runs under setting ``where``; None where they are no pipeline runs."""
    if where is None or "parallel.shards_per_replica" not in rows or "parallel.name" not in rows:
        return None
    own = rows[(_settings(rows) == where) & rows["parallel.name"].astype(str).isin(PIPELINES)]
    stages = pd.to_numeric(own["parallel.shards_per_replica"], errors="coerce").dropna()
    return int(stages.median()) if len(stages) and stages.median() >= 1 else None


def _step_overhead(rows: pd.DataFrame, name: str, where: str | None) -> tuple[float | None, str]:
    """(overhead, why) from the step times of ``name`` and of ``none`` under ``where``; None: not measured."""
    if where is None or "step_time_s" not in rows:
        return None, "no measured step times"
    same = rows[_settings(rows) == where]
    times = {s: pd.to_numeric(same.loc[same["strategy"] == s, "step_time_s"], errors="coerce").dropna()
             for s in (name, BASELINE)}
    if not len(times[name]):
        return None, f"no step times of '{name}' under {where}"
    if not len(times[BASELINE]):
        return None, f"no '{BASELINE}' runs under {where} to compare the step time with"
    ratio = float(times[name].median() / times[BASELINE].median())
    est = ratio_estimate(times[name], times[BASELINE])
    said = f"step time x{ratio:.2f} of {BASELINE}'s under {where} (n={len(times[name])} vs {len(times[BASELINE])}"
    if est is None:
        return 0.0, f"step overhead 0: {said}, no interval)"
    said += f", [{est.low:.2f}, {est.high:.2f}] at {level_text(est.level)})"
    if est.level < LEVEL or est.low <= 1 <= est.high:
        return 0.0, f"step overhead 0: {said}, not a 95% interval clear of 1"
    if est.high < 1:
        return 0.0, f"step overhead 0: {said}, faster than {BASELINE} (clamped at 0)"
    return ratio - 1.0, f"step overhead {ratio - 1.0:.3f}: {said}"
