"""Bring your own model: any ``nn.Module`` that maps token ids (B, T) to next-token logits, trained as a causal LM on
the project's token stream (or the token file of ``train.data=loader``). Model, optimizer, and optionally the LR
scheduler and the dataset, are Hydra ``_target_`` nodes; docs/own_model.md says what a model must meet to be checked
bit for bit."""

from __future__ import annotations

import sys
from pathlib import Path
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.utils.data import Dataset

from resilience.caps import WorkloadCaps
from resilience.workloads.base import Workload, stream_seed
from resilience.workloads.tokens import MarkovTokens

# foreach=False: the per-tensor loop is the reference implementation, identical on every device count.
DEFAULT_OPTIMIZER = {"_target_": "torch.optim.AdamW", "lr": 1.0e-3, "weight_decay": 0.01, "foreach": False}


def add_python_path(python_path: str | list[str] | None) -> list[str]:
    """Put each folder first on ``sys.path``: every process that builds this workload (the command's check, each
    rank, a pipeline cell, a SLURM job) can then import the model's module without PYTHONPATH."""
    folders = [python_path] if isinstance(python_path, str) else list(python_path or [])
    for folder in folders:
        path = Path(str(folder))
        if not path.is_absolute():  # ranks and pipeline jobs may start elsewhere than this shell
            raise ValueError(f"workload.python_path={folder}: must be an absolute path (e.g. $PWD/{folder})")
        if not path.is_dir():
            raise ValueError(f"workload.python_path={folder}: no such folder")
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    return [str(f) for f in folders]


def _node(value: Any, key: str) -> DictConfig:
    if isinstance(value, nn.Module):  # Hydra built it before the workload: outside the private seed
        raise ValueError(f"workload.{key}: was instantiated before the workload; set workload._recursive_: false "
                         f"(conf/workload/user_module.yaml)")
    node = OmegaConf.create(value) if isinstance(value, dict) else value
    if not isinstance(node, DictConfig) or "_target_" not in node:
        raise ValueError(f"workload.{key}={value}: must be a mapping with _target_ (a class or function to call)")
    return node


class ModuleWorkload(Workload):
    """A causal LM over any module whose forward takes token ids (B, T) and returns logits (B, T, >= vocab), or an
    object with ``.logits`` (a Hugging Face model)."""

    caps = WorkloadCaps(reads_tokens=True)

    def __init__(
        self,
        seed: int,
        model: Any,
        optimizer: Any = None,
        python_path: str | list[str] | None = None,
        vocab: int = 256,
        seq_len: int = 64,
        batch_size: int = 8,
        follow_prob: float = 0.8,
        scheduler: Any = None,
        dataset: Any = None,
    ) -> None:
        super().__init__(seed)
        self.python_path = add_python_path(python_path)
        self.model_cfg = _node(model, "model")
        self.optimizer_cfg = _node(optimizer if optimizer is not None else DEFAULT_OPTIMIZER, "optimizer")
        # optional: an LR scheduler (called with the optimizer) and a dataset (called with path, seq_len, samples)
        self.scheduler_cfg = None if scheduler is None else _node(scheduler, "scheduler")
        self.dataset_cfg = None if dataset is None else _node(dataset, "dataset")
        self.caps = replace(self.caps, schedules_lr=self.scheduler_cfg is not None)
        self.tokens = MarkovTokens(seed, vocab, seq_len, batch_size, follow_prob)
        self.vocab, self.seq_len, self.batch_size = vocab, seq_len, batch_size  # what train.data=loader reads
        self.tokens_per_sample = seq_len

    def build_model(self) -> nn.Module:
        # Initialise under a private seed and restore the global generator: the run's RNG stays untouched, and
        # a restarted rank builds the same initial weights as the uninterrupted run.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(stream_seed(self.seed, "init"))
            try:
                model = instantiate(self.model_cfg)
            except ImportError as exc:
                raise ValueError(self._unimportable(exc)) from None
            except Exception as exc:  # Hydra wraps the import failure of a _target_ in its own error
                if "Error locating target" not in str(exc):
                    raise
                raise ValueError(self._unimportable(exc)) from None
        if not isinstance(model, nn.Module):
            raise ValueError(f"workload.model._target_={self.model_cfg._target_}: built a "
                             f"{type(model).__name__}, not a torch.nn.Module")
        return model

    def _unimportable(self, exc: Exception) -> str:
        cause = str(exc.__cause__ or exc).splitlines()[0]
        where = f"workload.python_path={self.python_path}" if self.python_path else "no workload.python_path set"
        return f"workload.model._target_={self.model_cfg._target_}: cannot be imported ({cause}; {where})"

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        optimizer = instantiate(self.optimizer_cfg, model.parameters())
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"workload.optimizer._target_={self.optimizer_cfg._target_}: built a "
                             f"{type(optimizer).__name__}, not a torch.optim.Optimizer (leave _partial_ out: the "
                             f"parameters are its first argument)")
        return optimizer

    def build_scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler | None:
        return None if self.scheduler_cfg is None else instantiate(self.scheduler_cfg, optimizer)

    def build_dataset(self, tokens: Path, samples: int) -> Dataset | None:
        if self.dataset_cfg is None:
            return None
        return instantiate(self.dataset_cfg, path=str(tokens), seq_len=self.seq_len, samples=samples)

    def batch(self, step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        return self.tokens.batch(step, rank, device)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, y = batch
        out = model(x)
        logits = getattr(out, "logits", out)  # a Hugging Face model returns an output object
        if not isinstance(logits, torch.Tensor) or logits.shape[:2] != x.shape or logits.shape[-1] < self.vocab:
            shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise ValueError(f"workload.model: forward returned {shape}; must be logits of shape "
                             f"({x.shape[0]}, {x.shape[1]}, >= workload.vocab={self.vocab})")
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
