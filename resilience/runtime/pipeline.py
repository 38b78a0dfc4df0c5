"""What pipeline parallelism shares with the rest of a rank (``parallel=pp``, ``pp_dp``; docs/pipeline_parallel.md).

``Layout``: which stage of which pipeline a rank holds, and its groups (``make_layout`` forms them, ``StageGroups``
forms them again in place after the world's group is re-formed by a replica heal). ``global_norm``:
the gradients' norm over every stage (a stage's own norm would clip or judge each stage by a different number).
``combined_sha256``: the final state hash over every stage, the same on every rank. ``StepRunner``: what runs a
step's micro-batches in place of the loop's own forward and backward.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist


class StageGroups:
    """This rank's two groups under ``pp_dp``: its pipeline's and its stage's data-parallel one. ``form`` forms every
    group of the world (``new_group`` is collective over it) in ``group_order``'s order, and is called again on a
    survivor after the world's group is re-formed with a replacement (``strategy=replica``), so that every holder of
    the layout (the runner, the detectors, the final hash) reads the new generation's groups; ``drop`` lets go of the
    broken ones first (a gloo group closes its sockets only once nothing refers to it: a peer blocked on this rank
    in the broken group is freed then)."""

    def __init__(self, stage: int, replica: int, stages: int, replicas: int, timeout: timedelta | None) -> None:
        self.stage, self.replica, self.stages, self.replicas, self.timeout = stage, replica, stages, replicas, timeout
        self.pp: dist.ProcessGroup | None = None
        self.dp: dist.ProcessGroup | None = None

    def form(self) -> None:
        dp = replica_groups(self.stages, self.replicas, self.timeout)
        pp = pipeline_groups(self.stages, self.replicas, self.timeout)
        self.dp, self.pp = dp[self.stage], pp[self.replica]

    def drop(self) -> None:
        self.dp = self.pp = None


@dataclass(frozen=True)
class Layout:
    """Rank ``pp_ranks[stage]`` holds stage ``stage`` of ``stages`` in pipeline ``replica`` of ``replicas``."""

    stage: int
    stages: int
    pp_ranks: tuple[int, ...]  # the global ranks of this rank's pipeline, in stage order
    replica: int = 0
    replicas: int = 1
    dp_ranks: tuple[int, ...] = ()  # the global ranks holding this rank's stage, in replica order (pp_dp)
    groups: StageGroups | None = None  # pp_dp's groups (None: one pipeline, the world's group)

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        """The pipeline's group (None: the world's, one pipeline)."""
        return None if self.groups is None else self.groups.pp

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The stage's replicas' group: the stage's gradients are averaged over it (pp_dp)."""
        return None if self.groups is None else self.groups.dp

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1


def make_layout(rank: int, world_size: int, stages: int, replicas: int = 1,
                timeout: timedelta | None = None) -> Layout:
    """Rank ``r`` holds stage ``r // replicas`` of pipeline ``r % replicas`` (stages outermost). One pipeline: the
    world's group carries the activations. More (pp_dp): the groups are formed here, each with ``timeout`` (a new
    gloo group otherwise waits 30 minutes on a dead peer), on every rank in ``group_order``'s order."""
    if world_size != stages * replicas:  # the table refuses it before launch (resilience.compat.pipeline)
        raise ValueError(f"world_size={world_size}: must be parallel.stages={stages} x {replicas} pipeline(s), "
                         f"one stage per rank")
    stage, replica = divmod(rank, replicas)
    if replicas == 1:
        return Layout(stage=rank, stages=stages, pp_ranks=tuple(range(stages)))
    groups = StageGroups(stage, replica, stages, replicas, timeout)
    groups.form()
    return Layout(stage=stage, stages=stages, pp_ranks=pipeline_ranks(replica, stages, replicas), replica=replica,
                  replicas=replicas, dp_ranks=stage_ranks(stage, replicas), groups=groups)


def stage_ranks(stage: int, replicas: int) -> tuple[int, ...]:
    """The ranks holding ``stage``, one per pipeline, in replica order (the order their gradients are summed)."""
    return tuple(stage * replicas + r for r in range(replicas))


def pipeline_ranks(replica: int, stages: int, replicas: int) -> tuple[int, ...]:
    """The ranks of pipeline ``replica``, in stage order (a group's ranks in that order: stage ``s`` is its rank
    ``s``, as torch's schedule takes it)."""
    return tuple(s * replicas + replica for s in range(stages))


def group_order(stages: int, replicas: int) -> list[tuple[int, ...]]:
    """Every group's ranks in the order every rank forms them (``new_group`` is collective over the world): each
    stage's data-parallel group, then each pipeline."""
    return [stage_ranks(s, replicas) for s in range(stages)] + \
        [pipeline_ranks(r, stages, replicas) for r in range(replicas)]


def replica_groups(stages: int, replicas: int, timeout: timedelta | None) -> list[dist.ProcessGroup]:
    """Each stage's data-parallel group, in stage order."""
    return [dist.new_group(list(stage_ranks(s, replicas)), timeout=timeout) for s in range(stages)]


def pipeline_groups(stages: int, replicas: int, timeout: timedelta | None) -> list[dist.ProcessGroup]:
    """Each pipeline's group, in replica order."""
    return [dist.new_group(list(pipeline_ranks(r, stages, replicas)), timeout=timeout) for r in range(replicas)]


def global_norm(params: Iterable[torch.Tensor], layout: Layout) -> torch.Tensor:
    """The 2-norm of every stage's gradients together: each stage's norm, gathered in stage order, then the norm of
    those (what ``clip_grad_norm_`` computes over one model, up to the order of its terms)."""
    return torch.nn.utils.get_total_norm(stage_norms(params, layout))


def stage_norms(params: Iterable[torch.Tensor], layout: Layout) -> list[torch.Tensor]:
    """Each stage's gradient 2-norm (0-d tensors), gathered in stage order over the pipeline: the same on every
    stage, and what ``global_norm`` is the norm of."""
    grads = [p.grad for p in params if p.grad is not None]
    local = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
    norms = [torch.empty_like(local) for _ in range(layout.stages)]
    dist.all_gather(norms, local, group=layout.pp_group)
    return norms


def combined_sha256(local: str, layout: Layout) -> str:
    """The SHA-256 over the ``local`` state hashes of this rank's pipeline, each stage's once, in stage order: a
    function of the stages' states alone, so every rank of every pipeline ends on it when the replicas of each stage
    agree (and ``replicas_agree`` says so), and a replica that drifted gives its pipeline another value."""
    stages: list = [None] * layout.stages
    dist.all_gather_object(stages, (layout.stage, local), group=layout.pp_group)
    # written "stage/0:" as before pp_dp, which gathered every rank keyed by (stage, replica): the same value for
    # parallel=pp, whose recorded hashes stay comparable
    return hashlib.sha256("".join(f"{s}/0:{h};" for s, h in sorted(stages)).encode()).hexdigest()


class StepRunner(Protocol):
    """Runs one step's forward and backward over a pipeline (the gradients accumulate in the stage's parameters)."""

    def forward_backward(self, batch: tuple[torch.Tensor, ...], step: int | None = None) -> torch.Tensor:
        """The step's mean loss over its micro-batches, the same on every stage of the pipeline; ``step`` (the
        loop's) keys what a logging runner keeps of the step's sends."""

    def clip_(self, params: list[torch.Tensor], max_norm: float) -> None:
        """Clip the stage's gradients to ``max_norm`` by the norm over every stage's (``global_norm``)."""

    def release(self) -> None:
        """Let go of the stage, its schedule and the pipeline's groups: the group broke (a peer was lost)."""

    def regroup(self) -> None:
        """After the world's group was re-formed: the pipeline's groups again (every rank, in one order) and the
        stage and its schedule over them."""
