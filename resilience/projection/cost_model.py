"""Checkpoint and recovery costs at the target scale.

A checkpoint of ``params * bytes_per_param`` bytes is sharded evenly across ``writers`` ranks. Each cost component
(training-visible stall, time to durable, load, restart) is modelled as::

    seconds = fixed_s + total_bytes / rate,   rate = writers * per_writer_Bps        (per-rank links in parallel)
                                              rate = min(rate, storage_Bps)           (if the component hits storage)

``fixed_s`` covers what does not grow with size (coordination, metadata, process start); ``per_writer_Bps`` is
the bandwidth one rank gets. Both can be fitted by least squares from measured (bytes per writer, seconds) samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from resilience.projection.failure_model import RecoveryKind
from resilience.projection.validation import ConfigError

GB = 1e9

#: Kinds whose detection is a crash the runtime notices (what fault-injection runs measure as detection latency).
#: Hangs and silent corruption are found by a timeout or a monitor instead, so their detection stays as configured.
CRASH_KINDS: tuple[str, ...] = ("restart", "node_replacement")

COMPONENTS: tuple[str, ...] = ("stall", "durable", "load", "restart")


@dataclass(frozen=True)
class ComponentCost:
    """One cost component: ``fixed_s + total_bytes / rate`` (see the module docstring).

    ``per_writer_Bps=None`` means the component does not depend on size. ``residuals`` are observed/fitted ratios
    of the samples it was fitted from; the simulator resamples them (multiplicative residual bootstrap), so the
    measured spread carries over to the target scale while the mean follows the fitted model.
    """

    fixed_s: float
    per_writer_Bps: float | None = None
    storage_bound: bool = False
    residuals: tuple[float, ...] = field(default=(), repr=False)

    def seconds(self, total_bytes: float, writers: int, storage_Bps: float | None) -> float:
        rate = math.inf if self.per_writer_Bps is None else writers * self.per_writer_Bps
        if self.storage_bound and storage_Bps is not None:
            rate = min(rate, storage_Bps)
        return self.fixed_s + (0.0 if math.isinf(rate) else total_bytes / rate)


def fit_component(bytes_per_writer: Sequence[float], seconds: Sequence[float], *, storage_bound: bool,
                  fixed_only: bool = False) -> ComponentCost:
    """Least-squares fit of ``seconds = fixed_s + bytes_per_writer / per_writer_Bps`` with both terms >= 0.

    Degenerate cases, chosen so that projecting to larger checkpoints never under-estimates a cost:
    - a single distinct size: all time is attributed to bandwidth (fixed_s = 0), the pessimistic reading;
    - a fitted slope <= 0 (time does not grow with size): a constant, fixed_s = mean;
    - a fitted intercept < 0: refitted through the origin.
    """
    x = np.asarray(bytes_per_writer, dtype=float)
    y = np.asarray(seconds, dtype=float)
    if x.shape != y.shape or x.size == 0:
        raise ConfigError(f"samples={x.size}: need at least one (bytes, seconds) pair of equal-length arrays")
    if np.any(~np.isfinite(x)) or np.any(~np.isfinite(y)) or np.any(x < 0) or np.any(y < 0):
        raise ConfigError("samples: bytes and seconds must be finite and >= 0")
    fixed, slope = float(y.mean()), 0.0
    if not fixed_only and np.any(x > 0):
        if np.unique(x).size == 1:
            fixed, slope = 0.0, float(y.mean() / x[0])
        else:
            slope, intercept = np.polyfit(x, y, 1)
            if slope <= 0:
                fixed, slope = float(y.mean()), 0.0
            elif intercept < 0:
                fixed, slope = 0.0, float(np.dot(x, y) / np.dot(x, x))
            else:
                fixed, slope = float(intercept), float(slope)
    fitted = fixed + slope * x
    ok = fitted > 0
    residuals = tuple((y[ok] / fitted[ok]).tolist())
    return ComponentCost(fixed, 1.0 / slope if slope > 0 else None, storage_bound, residuals)


@dataclass(frozen=True)
class CostsAtScale:
    """A strategy's costs (seconds) at one checkpoint size and writer count.

    ``lag_s`` is the time from the start of a checkpoint until it is durable (>= ``stall_s``; equal for a
    synchronous save). ``feasible`` is False when a shard exceeds the strategy's memory limit. ``checkpoints`` is
    False for a strategy that never checkpoints and never loses work (a live replica holds the state).
    ``step_overhead`` is the share of every step's time the technique costs besides its checkpoints (a gradient
    shadow's per-step copy): the goodput is scaled by ``1 - step_overhead``. ``lost_work_factor`` is the share of
    the work since the last durable checkpoint that a failure costs the job (1: everything is retrained; Swift's
    pipeline logging, 1/S: one of S stages replays it while the others wait; ``projection.pipeline_rules``).
    """

    strategy: str
    stall_s: float
    lag_s: float
    load_s: float
    restart_s: float
    feasible: bool = True
    checkpoints: bool = True
    step_overhead: float = 0.0
    lost_work_factor: float = 1.0
    residuals: dict[str, tuple[float, ...]] = field(default_factory=dict, repr=False)
    detection_samples: tuple[float, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.lost_work_factor <= 1:
            raise ValueError(f"lost_work_factor={self.lost_work_factor}: must be in (0, 1]")

    def detection_s(self, kinds: Sequence[RecoveryKind]) -> np.ndarray:
        """Mean detection latency per kind: the measured mean for crash kinds when measured, else as configured."""
        measured = float(np.mean(self.detection_samples)) if self.detection_samples else None
        return np.asarray([measured if (measured is not None and k.name in CRASH_KINDS) else k.detection_s
                           for k in kinds])

    def recovery_s(self, kinds: Sequence[RecoveryKind]) -> np.ndarray:
        """Mean recovery time per kind (same order as ``kinds``): detection + repair + restart + load."""
        repair = np.asarray([k.repair_s for k in kinds])
        return self.detection_s(kinds) + repair + self.restart_s + self.load_s

    def draw(self, component: str, rng: np.random.Generator, size: tuple[int, ...], bootstrap: bool) -> np.ndarray:
        """Values of ``component`` ('stall', 'durable', 'load', 'restart'): constant, or bootstrapped residuals."""
        base = {"stall": self.stall_s, "durable": self.lag_s, "load": self.load_s, "restart": self.restart_s}[component]
        res = self.residuals.get(component, ())
        if not bootstrap or not res:
            return np.full(size, base)
        return base * rng.choice(np.asarray(res), size=size)

    def draw_recovery(self, kinds: Sequence[RecoveryKind], kind_index: np.ndarray, rng: np.random.Generator,
                      bootstrap: bool) -> np.ndarray:
        """Recovery time of each failure whose kind (index into ``kinds``) is given by ``kind_index``."""
        detect = self.detection_s(kinds)[kind_index]
        if bootstrap and self.detection_samples:
            crash = np.isin(kind_index, [i for i, k in enumerate(kinds) if k.name in CRASH_KINDS])
            drawn = rng.choice(np.asarray(self.detection_samples), size=kind_index.shape)
            detect = np.where(crash, drawn, detect)
        repair = np.asarray([k.repair_s for k in kinds])[kind_index]
        size = kind_index.shape
        return detect + repair + self.draw("restart", rng, size, bootstrap) + self.draw("load", rng, size, bootstrap)


@dataclass(frozen=True)
class StrategyCosts:
    """Cost model of one checkpoint strategy (scenario defaults or fitted from measured runs)."""

    name: str
    stall: ComponentCost
    durable: ComponentCost
    load: ComponentCost
    restart: ComponentCost
    detection_samples: tuple[float, ...] = ()  # measured crash-detection latencies (s); empty: scenario's values
    max_bytes_per_writer: float | None = None  # host-memory limit of in-memory strategies; None: no limit
    description: str = ""
    checkpoints: bool = True  # False: no checkpoint, no lost work (stall and durable are zero)
    # the mean share of the full state one checkpoint writes (an incremental chain: a base every N saves, the
    # touched rows between); the load reads a whole state
    bytes_share: float = 1.0
    step_overhead: float = 0.0  # the share of every step it costs besides its checkpoints (CostsAtScale)
    lost_work_factor: float = 1.0  # the share of the work since the checkpoint a failure costs (CostsAtScale)
    note: str = ""  # how a per-technique rule set the two above (printed under the strategies table)

    def at_scale(self, total_bytes: float, writers: int, storage_Bps: float | None) -> CostsAtScale:
        saved = total_bytes * self.bytes_share
        stall = self.stall.seconds(saved, writers, storage_Bps)
        durable = max(self.durable.seconds(saved, writers, storage_Bps), stall)
        feasible = self.max_bytes_per_writer is None or total_bytes / writers <= self.max_bytes_per_writer
        return CostsAtScale(
            strategy=self.name, stall_s=stall, lag_s=durable,
            load_s=self.load.seconds(total_bytes, writers, storage_Bps),
            restart_s=self.restart.seconds(total_bytes, writers, storage_Bps), feasible=feasible,
            checkpoints=self.checkpoints, step_overhead=self.step_overhead, lost_work_factor=self.lost_work_factor,
            residuals={c: getattr(self, c).residuals for c in COMPONENTS}, detection_samples=self.detection_samples)

