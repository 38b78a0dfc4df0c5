"""Silent corruption across data-parallel replicas: their states must be equal, so compare fingerprints.

Every ``every`` steps each rank reduces its parameters and (a rotating share of) its Adam moments to two exact
integers (the sum of their raw bits, so any single flipped bit changes it and no rounding hides it) and the ranks
all-gather them. A mismatch means one replica diverged; the odd rank out by majority is named (with two ranks there is no
majority and nobody is blamed). The first mismatch is remembered: NaN can later make the replicas equal again.
A flip that hits every replica alike (a gradient before the all-reduce, an activation whose error is averaged
into everyone's update) leaves them equal and is invisible here.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

from resilience.checks import require_int
from resilience.detectors.base import Detection, Detector

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


class ReplicaFingerprint(Detector):

    compares_ranks = True  # all-gathers the fingerprints over the rank's process group

    def __init__(self, every: int = 1, moment_groups: int = 4) -> None:
        self.every = require_int("detectors.replica_fingerprint.every", every, 1)
        self.moment_groups = require_int("detectors.replica_fingerprint.moment_groups", moment_groups, 1)
        self.first_mismatch: int | None = None
        self._last_good = 0

    def attach(self, rt, state) -> None:
        self.rt, self.state = rt, state
        self._params = [p for p in state.model.parameters()]

    def fingerprint(self, position: int) -> torch.Tensor:
        """Every parameter, and one of ``moment_groups`` rotating groups of the Adam moments.

        The moments are twice the size of the parameters; checking a rotating share of them keeps the cost within
        budget, and a corrupted moment stays different on its replica, so it is found within ``moment_groups``
        checks.
        """
        moments = [v for s in self.state.optimizer.state.values() for k, v in s.items()
                   if isinstance(v, torch.Tensor) and v.dtype in _INT_VIEW and v.dim() > 0]
        group = (position // self.every) % self.moment_groups
        return torch.stack([bit_sum(self._params), bit_sum(moments[group::self.moment_groups])])

    def on_step_end(self, step: int) -> list[Detection]:
        position = step + 1
        if position % self.every:
            return []
        mine = self.fingerprint(position)
        gathered = [torch.empty_like(mine) for _ in range(self.rt.world_size)]
        dist.all_gather(gathered, mine)
        prints = [tuple(g.tolist()) for g in gathered]
        if len(set(prints)) == 1:
            if self.first_mismatch is None:
                self._last_good = position
            return []
        if self.first_mismatch is not None:
            return []  # already reported; keep the first
        self.first_mismatch = position
        odd = odd_ranks(prints)
        blamed = odd[0] if len(odd) == 1 else None
        # rollback_to: the state is certainly good only where every moment group had been checked since.
        return [Detection(self.name, blamed, f"replicas differ after step {position}"
                          + (f": rank {blamed} is the odd one out" if blamed is not None else ": no majority"),
                          {"odd_ranks": odd, "fingerprints": [list(p) for p in prints]}, step=position,
                          silent=True, rollback_to=max(0, self._last_good - (self.moment_groups - 1) * self.every))]
