"""Silent corruption across data-parallel replicas: their states must be equal, so compare fingerprints.

Every ``every`` steps each rank reduces its parameters and Adam moments to a few exact integers (the sum of the
raw bits of each group, so any single flipped bit changes it and no rounding hides it) and the ranks all-gather
them. A mismatch means one replica diverged; the odd rank out by majority is named (with two ranks there is no
majority and nobody is blamed). The first mismatch is remembered: NaN can later make the replicas equal again.
A flip that hits every replica alike (a gradient before the all-reduce, an activation whose error is averaged
into everyone's update) leaves them equal and is invisible here.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

from resilience.detectors.base import Detection, Detector

_INT_VIEW = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
             torch.bfloat16: torch.int16}


def bit_sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The sum of the raw bit patterns (as integers) of all ``tensors``: exact, order-independent."""
    total = torch.zeros((), dtype=torch.int64, device=tensors[0].device if tensors else "cpu")
    for t in tensors:
        total += t.detach().reshape(-1).view(_INT_VIEW[t.dtype]).sum(dtype=torch.int64)
    return total


def odd_ranks(prints: list[tuple[int, ...]]) -> list[int]:
    """The ranks whose fingerprint differs from a strict majority's; empty when there is no majority."""
    majority, n = Counter(prints).most_common(1)[0]
    return [r for r, p in enumerate(prints) if p != majority] if n > len(prints) / 2 else []


class ReplicaFingerprint(Detector):
    name = "replica_fingerprint"

    def __init__(self, every: int = 1) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"detectors.replica_fingerprint.every={every}: must be an integer >= 1")
        self.every = every
        self.first_mismatch: int | None = None
        self._last_good = 0

    def attach(self, rt, state) -> None:
        self.rt, self.state = rt, state
        self._params = [p for p in state.model.parameters()]

    def fingerprint(self) -> torch.Tensor:
        moments = [v for s in self.state.optimizer.state.values() for k, v in s.items()
                   if isinstance(v, torch.Tensor) and v.dtype in _INT_VIEW and v.dim() > 0]
        return torch.stack([bit_sum(self._params), bit_sum(moments) if moments else bit_sum([])])

    def on_step_end(self, step: int) -> list[Detection]:
        position = step + 1
        if position % self.every:
            return []
        mine = self.fingerprint()
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
        return [Detection(self.name, blamed, f"replicas differ after step {position}"
                          + (f": rank {blamed} is the odd one out" if blamed is not None else ": no majority"),
                          {"odd_ranks": odd, "fingerprints": [list(p) for p in prints]}, step=position,
                          silent=True, rollback_to=self._last_good)]
