"""The workload interface: everything the training loop needs to know about what it trains."""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod

from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

from resilience.caps import WorkloadCaps


def stream_seed(*parts: int | str) -> int:
    """A 63-bit seed that is a pure function of ``parts`` (e.g. seed, step, rank), identical on every machine."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class Workload(ABC):
    """A model, its optimizer and its data; the batch for (step, rank) is a pure function of (seed, step, rank)."""

    caps = WorkloadCaps()
    tokens_per_sample = 0  # what the job's token counter adds per sample (a sequence model: its length)

    def __init__(self, seed: int) -> None:
        self.seed = seed

    @abstractmethod
    def build_model(self) -> nn.Module:
        """A freshly initialised model; initialisation uses a private generator seeded from ``seed``. A replacement
        healed from a replica calls it under the meta device (``resilience.state.uninitialised``): a tensor that is
        not state (not in ``state_dict``) is made with an explicit device, or the model is built initialised."""

    @abstractmethod
    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """The optimizer over ``model``'s parameters."""

    def build_scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler | None:
        """The workload's own LR scheduler over ``optimizer`` (``caps.schedules_lr``), or None: the loop's
        ``train.lr_schedule`` applies."""
        return None

    def build_dataset(self, tokens: Path, samples: int) -> Dataset | None:
        """The workload's own dataset for ``train.data=loader`` (items ``(id, x, y)``, ``samples`` of them, read
        from the token file ``tokens`` or elsewhere), or None: the token file's windows."""
        return None

    @abstractmethod
    def batch(self, step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """The batch that ``rank`` trains on at ``step``; the data-loader state is therefore the step alone."""

    @abstractmethod
    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The scalar training loss of ``model`` on ``batch``."""

    # Pipeline parallelism (``parallel=pp``) needs the three below; a workload that provides them declares
    # ``caps.splits_into_stages`` (the table refuses the others before launch, so these defaults are never reached).
    def pipeline_stage(self, model: nn.Module, stage: int, stages: int) -> nn.Module:
        """Stage ``stage`` of ``stages`` of ``model`` (as ``build_model`` made it): its own parameters, under the
        names they have in ``model``, and the same operations as the model's forward on them."""
        raise ValueError(f"workload {type(self).__name__}: does not split into pipeline stages")

    def stage_io(self, stage: int, stages: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Example input and output of ``stage`` for a micro-batch of ``micro`` samples (meta tensors: shape, dtype
        and whether a gradient flows back through it)."""
        raise ValueError(f"workload {type(self).__name__}: does not split into pipeline stages")

    def loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The loss of the last stage's ``output`` against ``target`` (a micro-batch's mean)."""
        raise ValueError(f"workload {type(self).__name__}: does not split into pipeline stages")
