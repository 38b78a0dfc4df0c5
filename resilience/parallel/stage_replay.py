"""A failed stage's steps recomputed on that stage alone, from its neighbours' boundary logs (Swift's replay).

The stage is restored to its checkpoint at position ``c``; for each step ``c .. k-1`` its schedule runs as in the
fault-free run, with every receive filled from the neighbours' logs (the activations the previous stage sent, the
gradients the next stage sent back) and every send kept in a log of its own instead of sent (``ReplayStage``), then
the caller's commit applies the optimizer step. It ends on the state the stage had at ``k`` bit for bit: the same
inputs (the logged bytes; the first stage's batch and the last stage's targets are functions of ``(seed, step)``),
the same schedule, so the same micro-batch order and the same gradient sums, the same optimizer steps. The
neighbours are not involved beyond sending their logs (``send_entries`` / ``receive_entries``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from resilience.parallel.boundary_log import BoundaryLog
from resilience.parallel.pp_runner import PipelineRunner
from resilience.runtime.pipeline import Layout
from resilience.workloads.base import Workload

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage


@dataclass
class Replayed:
    """What a replay did: the steps it recomputed, how long it took, the last stage's loss per step."""

    steps: list[int]
    duration_s: float
    losses: list[float] = field(default_factory=list)


class _ReplayRunner(PipelineRunner):
    """The pipeline runner over a ``ReplayStage``: the same schedule, the receives and sends the logs'."""

    def __init__(self, *args: Any, received: BoundaryLog, log: BoundaryLog) -> None:
        self.received = received  # make_stage, called by the runner's __init__, reads it
        super().__init__(*args, log=log)

    def make_stage(self, *args: Any, **kwargs: Any) -> PipelineStage:
        from resilience.parallel.logged_stage import ReplayStage

        assert self.log is not None
        return ReplayStage(*args, log=self.log, received=self.received, **kwargs)


class StageReplay:
    """This rank's stage under its schedule, fed from ``received`` (the neighbours' logged sends), its own sends
    logged into ``log`` (none kept without one). Nothing crosses to another rank while it runs."""

    def __init__(self, module: nn.Module, layout: Layout, workload: Workload, device: torch.device,
                 microbatches: int, schedule: str, received: BoundaryLog, log: BoundaryLog | None = None) -> None:
        self.log = log if log is not None else BoundaryLog(kinds=frozenset())
        self.runner = _ReplayRunner(module, layout, workload, device, microbatches, schedule, received=received,
                                    log=self.log)

    def run(self, steps: range, batch: Callable[[int], tuple[torch.Tensor, ...]],
            commit: Callable[[int], None]) -> Replayed:
        """Recompute ``steps`` in order: ``batch(t)`` is step ``t``'s (inputs, targets), where the caller also
        re-seeds its RNG as its loop did; ``commit(t)`` applies the step (the optimizer step, zeroed gradients)."""
        start, losses = time.perf_counter(), []
        for t in steps:
            self.runner.stage.begin(t)
            parts = self.runner.run_schedule(batch(t))
            commit(t)
            if parts:  # summed in micro-batch order, as forward_backward sums them
                loss = torch.zeros((), dtype=torch.float32, device=self.runner.device)
                for part in parts:
                    loss += part.detach()
                losses.append(float(loss / self.runner.n))
        return Replayed(list(steps), time.perf_counter() - start, losses)


def send_entries(log: BoundaryLog, kind: str, steps: range, dst: int, group: dist.ProcessGroup | None) -> int:
    """Send ``log``'s ``kind`` entries of ``steps`` to global rank ``dst`` (sealed: checked where they land); the
    bytes sent."""
    blob = log.export(steps.start, steps.stop - 1, kind)
    dist.send(torch.tensor([len(blob)], dtype=torch.int64), dst=dst, group=group)
    if blob:
        dist.send(torch.frombuffer(bytearray(blob), dtype=torch.uint8), dst=dst, group=group)
    return len(blob)


def receive_entries(into: BoundaryLog, src: int, group: dist.ProcessGroup | None) -> int:
    """Receive what ``send_entries`` sent from global rank ``src`` into ``into``; the entries taken."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src=src, group=group)
    if not int(size):
        return 0
    blob = torch.empty(int(size), dtype=torch.uint8)
    dist.recv(blob, src=src, group=group)
    return into.adopt(blob.numpy().tobytes())


def send_norms(log: BoundaryLog, steps: range, dst: int, group: dist.ProcessGroup | None) -> int:
    """Send ``log``'s stage norms of ``steps`` and the clip they served (``train.clip_norm``; none: no clip) to global
    rank ``dst``; the steps sent."""
    norms = {t: log.norms[t] for t in steps if t in log.norms}
    dist.send_object_list([(log.max_norm, norms)], dst=dst, group=group)
    return len(norms)


def receive_norms(into: BoundaryLog, src: int, group: dist.ProcessGroup | None) -> int:
    """Receive what ``send_norms`` sent from global rank ``src`` into ``into``; the steps taken."""
    box: list = [None]
    dist.recv_object_list(box, src=src, group=group)
    max_norm, norms = box[0]
    into.max_norm = max_norm if max_norm is not None else into.max_norm
    into.norms.update(norms)
    return len(norms)
