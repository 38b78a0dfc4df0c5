"""A warm spare: a rank process started ahead of any failure, which becomes the replacement of a failed rank.

A replacement started after the failure pays for the interpreter, torch, DDP's first construction (it imports
``torch._dynamo``, ~0.9 s here) and building the model and optimizer (seconds for a 1 GB embedding model) before it
can receive any state. A spare pays all of that while the job trains, then waits on the supervisor's store; when a
rank fails the supervisor hands the spare the rank and the generation, and the recovery is left with joining the
group and the state transfer. Production jobs keep spare nodes for the same reason. ``supervisor.spares=N`` keeps
N spares (``strategy=replica`` only); each one used is replaced by a new one in the background.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from resilience.rank.group import STORE_ENV
from resilience.rank.orphan import die_with_parent
from resilience.rank.process import configure_determinism, redirect_output
from resilience.roles import Roles, build_roles

SPARE_ENV = "RB_SPARE"  # the spare's number; absent in a rank process started for a rank


def assign_key(spare: int) -> str:
    return f"spare{spare}/assign"


@dataclass
class Prepared:
    """What a spare built before it had a rank (on CPU; with CUDA the rank builds on its device itself)."""

    roles: Roles
    model: torch.nn.Module | None
    optimizer: torch.optim.Optimizer | None


def wait_as_spare(cfg: DictConfig) -> Prepared:
    """Prepare everything that does not depend on the rank, wait to be assigned one, set the rank's environment."""
    spare = int(os.environ[SPARE_ENV])
    redirect_output(Path(cfg.run_dir), f"spare{spare}", f"spare {spare}")
    configure_determinism(torch.device("cpu"), int(cfg.threads_per_rank))
    importlib.import_module("torch._dynamo")  # DDP's constructor imports it: pay for it now, not in the recovery

    roles = build_roles(cfg)
    die_with_parent(lambda: roles.strategy.clean_up_run(Path(cfg.run_dir)))
    model = optimizer = None
    if cfg.device == "cpu":
        model = roles.workload.build_model()
        optimizer = roles.workload.build_optimizer(model)
    host, port = os.environ[STORE_ENV].rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(days=7))
    print(f"spare {spare} ready", file=sys.stderr, flush=True)
    store.wait([assign_key(spare)])  # the supervisor's store going away ends the wait with an error: we exit
    rank, generation = store.get(assign_key(spare)).decode().split()
    os.environ.update(RANK=rank, LOCAL_RANK=rank, TORCHELASTIC_RESTART_COUNT=generation)
    del os.environ[SPARE_ENV]
    return Prepared(roles, model, optimizer)
