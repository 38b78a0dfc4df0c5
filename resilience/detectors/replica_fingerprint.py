"""Silent corruption across data-parallel replicas: their states must be equal, so compare fingerprints.

Every ``every`` steps each rank reduces part of its state to two exact integers (the sum of their raw bits, so any
single flipped bit changes it and no rounding hides it) and the ranks all-gather them. A mismatch means one replica
diverged; the odd rank out by majority is named (with two ranks there is no majority and nobody is blamed). The
first mismatch is remembered: NaN can later make the replicas equal again. A flip that hits every replica alike (a
gradient before the all-reduce, an activation whose error is averaged into everyone's update) leaves them equal
and is invisible here.

What a check reads, so that its cost follows what the step touched and not the size of the state:

1. *what the step changed*: every parameter with a dense gradient, whole; of a parameter with a sparse gradient
   (an embedding table), only the rows this step's gradient touched, and the same rows of its optimizer state;
2. *a rotating slice of the rest*: the optimizer state and the sparse-gradient parameters laid end to end, of which
   each check reads the next ``max(slice_share x dense parameter bytes, slice_min_mb)``; the slice is a function of
   the check's number only, so every rank (a replacement included) reads the same bytes.

How often: ``every=auto`` (the default) checks the first ``calibration`` steps, then every ``every`` steps where
``every`` is the shortest interval whose checks cost at most ``budget`` (1%) of the step: the slowest rank's
typical check over the fastest rank's typical step, both all-gathered with the fingerprints so that every rank
decides the same; rank 0 records it (``fingerprint_interval``) and a rank started later (a restart, a replacement)
takes it from the record. The detection latency is then up to ``every`` steps (gpt_tiny 2, dlrm_emb 5 on 2 CPU
cores); an integer ``every`` checks at that fixed interval.

Coverage: every byte of the state has been read within ``coverage_checks`` checks (``ceil(rest / slice)``), i.e.
``coverage_checks x every`` steps; rank 0 emits it (``fingerprint_coverage``) at its first check. A corrupted byte
stays different on its replica, so it is found within that many checks, or at once if a step touches it first. On
the dense models the slice is half the parameters' bytes: a quarter of AdamW's two moments, found within 4 checks;
on ``dlrm_emb`` (1.1 GB of tables and Adagrad sums, ~3,600 rows touched per step) 2 MB per check, every byte within
565 checks (``python -m resilience.bench.detectors --only fingerprint-cpu`` prints the figures of each workload).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter

import torch
import torch.distributed as dist

from resilience.caps import DetectorCaps
from resilience.settings.checks import require_int, require_number
from resilience.detectors.base import Detection, Detector
from resilience.record.events import read_events
from resilience.runtime.rank import RankRuntime
from resilience.state.train import TrainState

MAX_EVERY = 64  # every=auto never checks less often than this (detection latency and coverage stay bounded)
_INT_VIEW = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
             torch.bfloat16: torch.int16}


def bit_sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The sum of the raw bits of all ``tensors``, as wrapping 64-bit integers: exact and order-independent.

    Viewed as int64 where the storage allows it (half the elements, no widening: memory-bound and fast).
    """
    total = torch.zeros((), dtype=torch.int64, device=tensors[0].device if tensors else "cpu")
    for t in tensors:
        flat = t.detach().reshape(-1)
        if (flat.numel() * flat.element_size()) % 8 == 0 and flat.data_ptr() % 8 == 0:
            total += flat.view(torch.int64).sum()
        else:
            total += flat.view(_INT_VIEW[t.dtype]).sum(dtype=torch.int64)
    return total


def odd_ranks(prints: list[tuple[int, ...]]) -> list[int]:
    """The ranks whose fingerprint differs from a strict majority's; empty when there is no majority."""
    majority, n = Counter(prints).most_common(1)[0]
    return [r for r, p in enumerate(prints) if p != majority] if n > len(prints) / 2 else []


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def byte_window(tensors: list[torch.Tensor], start: int, length: int) -> list[torch.Tensor]:
    """Flat views covering bytes ``[start, start + length)`` of ``tensors`` laid end to end, wrapping at the end
    (widened to whole elements); every byte once when ``length`` >= their total."""
    total = sum(nbytes(t) for t in tensors)
    if total == 0:
        return []
    start, length = start % total, min(length, total)
    spans = [(start, min(start + length, total))]
    if start + length > total:
        spans.append((0, start + length - total))
    views, offset = [], 0
    for t in tensors:
        size, flat = nbytes(t), t.detach().reshape(-1)
        for lo, hi in spans:
            a, b = max(lo, offset), min(hi, offset + size)
            if a < b:
                e = t.element_size()
                views.append(flat[(a - offset) // e: -(-(b - offset) // e)])
        offset += size
    return views


def _typical(samples: list[float]) -> float:
    """The median, the first sample (warm-up) left out where there are others."""
    return statistics.median(samples[1:] or samples) if samples else 0.0


def _micros(seconds: float) -> int:
    return int(round(seconds * 1e6))


def sparse_grad_params(model: torch.nn.Module) -> set[int]:
    """The ids of the parameters whose gradient is sparse (``nn.Embedding``/``EmbeddingBag`` with ``sparse=True``)."""
    return {id(p) for m in model.modules() if getattr(m, "sparse", False) is True
            for p in m.parameters(recurse=False)}


class ReplicaFingerprint(Detector):

    caps = DetectorCaps(compares_ranks=True)  # all-gathers the fingerprints over the rank's process group

    def __init__(self, every: int | str = "auto", budget: float = 0.01, calibration: int = 5,
                 slice_share: float = 0.5, slice_min_mb: float = 2.0) -> None:
        self.auto = every == "auto"
        if not self.auto and not isinstance(every, int):
            raise ValueError(f"detectors.replica_fingerprint.every={every}: must be auto or an integer >= 1")
        self.every = 1 if self.auto else require_int("detectors.replica_fingerprint.every", every, 1)
        self.budget = require_number("detectors.replica_fingerprint.budget", budget, above=0)
        self.calibration = require_int("detectors.replica_fingerprint.calibration", calibration, 1)
        self.slice_share = require_number("detectors.replica_fingerprint.slice_share", slice_share, above=0)
        self.slice_min_mb = require_number("detectors.replica_fingerprint.slice_min_mb", slice_min_mb, above=0)
        self.first_mismatch: int | None = None
        self._last_good = 0
        self._touched: dict[int, torch.Tensor] = {}
        self.anchor: int | None = None  # every=auto: the step after which the decided interval applies
        self._costs: list[float] = []  # this rank's checks (fingerprint + all-gather), seconds
        self._periods: list[float] = []  # this rank's steps without the check, seconds
        self._left_at: float | None = None  # when the last on_step_end returned

    def attach(self, rt: RankRuntime, state: TrainState) -> None:
        self.rt, self.state = rt, state
        model = getattr(state.model, "module", state.model)
        sparse = sparse_grad_params(model)
        self._params = list(model.parameters())
        self._dense = [p for p in self._params if id(p) not in sparse]
        self._sparse = [p for p in self._params if id(p) in sparse]
        self.slice_bytes = max(int(self.slice_share * sum(nbytes(p) for p in self._dense)),
                               int(self.slice_min_mb * 1e6)) // 8 * 8
        self._stated = rt.rank != 0  # rank 0 states the coverage at its first check (Adam's state exists then)
        if self.auto:  # a restarted or replacement rank takes the interval the run decided, as the others have
            decided = [e for e in read_events(rt.run_dir) if e["kind"] == "fingerprint_interval"]
            if decided:
                self.every, self.anchor = int(decided[-1]["every"]), int(decided[-1]["anchor"])

    def coverage_checks(self) -> int:
        """Checks until every byte of the state has been read (the optimizer's state as it is now: an optimizer
        that creates it at its first step, like Adam, has none before)."""
        return max(1, math.ceil(sum(nbytes(t) for t in self._rest()) / self.slice_bytes))

    def _state_of(self, p: torch.Tensor) -> list[torch.Tensor]:
        return [v for v in self.state.optimizer.state.get(p, {}).values()
                if isinstance(v, torch.Tensor) and v.dtype in _INT_VIEW and v.dim() > 0]

    def _rest(self) -> list[torch.Tensor]:
        """The state a check reads a slice of, in a fixed order: the sparse-gradient parameters, then the optimizer
        state of every parameter."""
        return self._sparse + [v for p in self._params for v in self._state_of(p)]

    def on_backward(self, step: int, loss: float, grad_norm: float | None) -> list[Detection]:
        # The rows the step's sparse gradients touch: the optimizer step clears the gradients before on_step_end.
        if self.due(step + 1):
            # the set of rows, without coalescing the values (the optimizer does that; this is half the cost)
            self._touched = {id(p): torch.unique(p.grad._indices()[0]) for p in self._sparse
                             if p.grad is not None and p.grad.is_sparse}
        return []

    def due(self, position: int) -> bool:
        """Whether the step that ends at ``position`` is checked: a function of the step and the run's decided
        interval only, so that every rank (a replacement included) checks the same steps."""
        if self.anchor is None:
            return position % self.every == 0
        return position > self.anchor and (position - self.anchor) % self.every == 0

    def check_number(self, position: int) -> int:
        """Which slice of the rest the check at ``position`` reads (the same on every rank)."""
        if self.anchor is None:
            return position // self.every
        return self.anchor + (position - self.anchor) // self.every

    def fingerprint(self, position: int) -> torch.Tensor:
        """[bits of what the step changed, bits of this check's slice of the rest]."""
        check = self.check_number(position)
        changed = list(self._dense)
        for p in self._sparse:
            rows = self._touched.get(id(p))
            if rows is not None and rows.numel():
                changed += [t.index_select(0, rows) for t in [p, *self._state_of(p)] if t.shape == p.shape]
        self._touched = {}
        return torch.stack([bit_sum(changed), bit_sum(byte_window(self._rest(), check * self.slice_bytes,
                                                                  self.slice_bytes))])

    def _decide(self, position: int, costs: list[list[int]]) -> None:
        """every=auto: from the ranks' typical check and step (all-gathered: the same numbers everywhere), the
        shortest interval whose checks cost at most ``budget`` of the steps (the slowest check over the fastest
        step). Rank 0 records it; a rank started later reads it (``attach``)."""
        check_us = max(c for c, _ in costs)
        step_us = min(p for _, p in costs) or 1
        self.every = max(1, min(MAX_EVERY, math.ceil(check_us / (self.budget * step_us))))
        self.anchor = position
        if self.rt.rank == 0:
            self.rt.events.emit("fingerprint_interval", every=self.every, anchor=position, check_s=check_us / 1e6,
                                step_s=step_us / 1e6, budget=self.budget)

    def on_step_end(self, step: int) -> list[Detection]:
        position = step + 1
        t0 = time.perf_counter()
        deciding = self.auto and self.anchor is None  # only then are the costs sampled: nothing grows after it
        if deciding and self._left_at is not None:
            self._periods.append(t0 - self._left_at)
        if not self.due(position):
            self._left_at = time.perf_counter()
            return []
        mine = self.fingerprint(position)
        t1 = time.perf_counter()
        # Beside the two fingerprints (compared), this rank's typical check and step (never compared): what
        # every=auto decides the interval from, the same numbers on every rank (zeros once it has decided).
        costs = [_micros(_typical(self._costs)), _micros(_typical(self._periods))] if deciding else [0, 0]
        payload = torch.cat([mine, torch.tensor(costs, dtype=torch.int64, device=mine.device)])  # CUDA too
        gathered = [torch.empty_like(payload) for _ in range(self.rt.world_size)]
        dist.all_gather(gathered, payload)
        prints = [tuple(g[:2].tolist()) for g in gathered]
        t2 = time.perf_counter()
        if deciding:
            self._costs.append(t2 - t0)
        if deciding and position >= self.calibration:
            self._decide(position, [g[2:].tolist() for g in gathered])
        if not self._stated and (not self.auto or self.anchor is not None):
            self._stated = True
            checks = self.coverage_checks()
            self.rt.events.emit("fingerprint_coverage", every=self.every, slice_bytes=self.slice_bytes,
                                rest_bytes=sum(nbytes(t) for t in self._rest()), coverage_checks=checks,
                                coverage_steps=checks * self.every)
        # The check's own cost, in the run it slows: its share of the step period is the detector's overhead,
        # measured where host load tilts both alike (python -m resilience.bench.speed reads it).
        self.rt.events.emit("fingerprint_check", step=position, compute_s=t1 - t0, gather_s=t2 - t1)
        self._left_at = time.perf_counter()
        if len(set(prints)) == 1:
            if self.first_mismatch is None:
                self._last_good = position
            return []
        if self.first_mismatch is not None:
            return []  # already reported; keep the first
        self.first_mismatch = position
        odd = odd_ranks(prints)
        blamed = odd[0] if len(odd) == 1 else None
        # rollback_to: the state is certainly good only where every byte had been read since.
        return [Detection(self.name, blamed, f"replicas differ after step {position}"
                          + (f": rank {blamed} is the odd one out" if blamed is not None else ": no majority"),
                          {"odd_ranks": odd, "fingerprints": [list(p) for p in prints]}, step=position,
                          silent=True,
                          rollback_to=max(0, self._last_good - (self.coverage_checks() - 1) * self.every))]
