"""What a rank process knows about itself, handed to every role (strategy, injector, detector) it hosts."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from resilience.events import EventLog

# A phase hook: (phase, step) -> None. The training loop and the strategies call it at each named point.
PhaseHook = Callable[[str, int], None]


def _no_hook(phase: str, step: int) -> None:
    return None


@dataclass
class RankRuntime:
    """The identity and services of one rank in one attempt."""

    rank: int
    world_size: int
    attempt: int
    device: torch.device
    run_dir: Path
    ckpt_dir: Path
    events: EventLog
    fault_hook: PhaseHook = field(default=_no_hook)
    # The checkpoint I/O layer (a DCP ``FileSystem``-like object); a disk fault replaces it. None: plain files.
    ckpt_fs: Any = None
    # What a node holds in memory for recovery (the in-memory strategy's areas): ``destroy(node)`` wipes one node.
    node_memory: Any = None
    # Recovery instructions for this attempt: load no checkpoint newer than this step (a rollback), and
    # accept a checkpoint only if this check passes: ``ckpt_verifier(dirs, entry) -> bool``.
    load_max_step: int | None = None
    ckpt_verifier: Any = None
    # The process group (``resilience.group.RankGroup``) and how to wrap the bare model for it (DDP with the
    # run's reduction): a strategy that re-forms the group in place wraps the model again.
    group: Any = None
    wrap_model: Any = None
