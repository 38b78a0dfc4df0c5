"""What pipeline parallelism shares with the rest of a rank (``parallel=pp``, docs/pipeline_parallel.md).

``Layout``: which stage of which pipeline a rank holds. ``global_norm``: the gradients' norm over every stage (a
stage's own norm would clip or judge each stage by a different number). ``combined_sha256``: the final state hash
over every stage, the same on every rank. ``StepRunner``: what runs a step's micro-batches in place of the loop's own
forward and backward.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Layout:
    """Rank ``pp_ranks[stage]`` holds stage ``stage`` of ``stages`` in pipeline ``replica`` of ``replicas``."""

    stage: int
    stages: int
    pp_ranks: tuple[int, ...]  # the global ranks of this rank's pipeline, in stage order
    replica: int = 0
    replicas: int = 1
    pp_group: dist.ProcessGroup | None = None  # the pipeline's group (None: the world's, one pipeline)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1


def make_layout(rank: int, world_size: int, stages: int) -> Layout:
    """One pipeline over the world: rank ``r`` holds stage ``r`` (the world's group carries the activations)."""
    if world_size != stages:  # the table refuses it before launch (resilience.compat.pipeline)
        raise ValueError(f"world_size={world_size}: must be parallel.stages={stages} (one stage per rank)")
    return Layout(stage=rank, stages=stages, pp_ranks=tuple(range(stages)))


def global_norm(params: Iterable[torch.Tensor], layout: Layout) -> torch.Tensor:
    """The 2-norm of every stage's gradients together: each stage's norm, gathered in stage order, then the norm of
    those (what ``clip_grad_norm_`` computes over one model, up to the order of its terms)."""
    grads = [p.grad for p in params if p.grad is not None]
    local = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
    norms = [torch.empty_like(local) for _ in range(layout.stages)]
    dist.all_gather(norms, local, group=layout.pp_group)
    return torch.nn.utils.get_total_norm(norms)


def combined_sha256(local: str, layout: Layout) -> str:
    """The SHA-256 over every rank's ``local`` state hash, keyed by (stage, replica): equal on every rank (so rank
    0's stands for the run and replicas agree), a function of the states alone, not of who holds which."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (layout.stage, layout.replica, local))
    return hashlib.sha256("".join(f"{s}/{r}:{h};" for s, r, h in sorted(everyone)).encode()).hexdigest()


class StepRunner(Protocol):
    """Runs one step's forward and backward over a pipeline (the gradients accumulate in the stage's parameters)."""

    def forward_backward(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The step's mean loss over its micro-batches, the same on every stage of the pipeline."""
