"""The settings a rank resolves on the machine that runs it (``device``, ``backend``, ``threads_per_rank``), and the
error every setting's check raises: apart from ``resilience.config`` and its Hydra, which a rank never needs
(a replacement's cold start pays for every import)."""

from __future__ import annotations

import os
import runpy
from importlib.util import find_spec
from pathlib import Path

from omegaconf import DictConfig, open_dict


class ConfigError(ValueError):
    """A setting has a value that is not allowed; the message names both."""


def on_this_node(cfg: DictConfig, local_ranks: int) -> DictConfig:
    """``device``, ``backend`` and ``threads_per_rank`` given a value on the machine that runs the ranks: ``auto``
    is CUDA where a device is, its backend, and this machine's cores shared by its ``local_ranks``. The local
    supervisor resolves them for its ranks; a config prepared for torchrun across nodes keeps ``auto``, and each
    rank resolves it on its own node at start (a CPU login node must not decide for GPU nodes)."""
    device, backend, threads = cfg.device, cfg.backend, cfg.threads_per_rank
    if device == "auto":
        device = "cuda" if cuda_available() else "cpu"
    if device == "cuda" and not cuda_available():
        raise ConfigError("device=cuda: no CUDA device is available here; use device=cpu or device=auto")
    if backend == "auto":
        backend = "nccl" if device == "cuda" else "gloo"
    if backend == "nccl" and device != "cuda":
        raise ConfigError("backend=nccl: needs device=cuda; use backend=gloo on CPU")
    if backend == "nccl" and local_ranks > (gpus := _gpu_count()):
        raise ConfigError(f"backend=nccl: {local_ranks} ranks on this node's {gpus} GPU(s), and NCCL refuses two "
                          "ranks on one device; use backend=gloo (ranks then share the GPUs) or fewer ranks")
    if threads == "auto":
        threads = max(1, (os.cpu_count() or 1) // max(1, local_ranks))
    with open_dict(cfg):
        cfg.device, cfg.backend, cfg.threads_per_rank = device, backend, threads
    return cfg


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def cuda_available() -> bool:
    """``torch.cuda.is_available()``, without importing torch (~0.7 s) where the answer is known from the installed
    build: a torch built without CUDA or ROCm (``torch/version.py`` says ``cuda = None``, ``hip = None``) has no
    CUDA device, whatever the machine holds. A CUDA build asks torch itself (drivers, visible devices)."""
    spec = find_spec("torch")
    version = Path(spec.origin).parent / "version.py" if spec and spec.origin else None
    if version is not None and version.is_file():
        build = runpy.run_path(str(version))  # plain assignments, no torch import
        if build.get("cuda") is None and build.get("hip") is None:
            return False
    import torch

    return torch.cuda.is_available()
