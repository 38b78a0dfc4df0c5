"""What a rank process knows about itself, handed to every role (strategy, injector, detector) it hosts.

The runtime is frozen: it is built once per rank process from the roles, after each role has said which service it
provides (``Injector.checkpoint_fs``, ``CheckpointStrategy.node_memory``, ``Detector.rejection_report``), so no
role writes into another role's object and every reader finds a typed service or ``None``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import IO, Callable, Protocol

import torch
from torch import nn

from resilience.settings.identity import RunIdentity
from resilience.record.events import EventLog
from resilience.runtime.pipeline import Layout


# A rank exits with this code when a detector inside it asked for a restart (a rollback, say): a requested
# exit, not a fault (sysexits' EX_TEMPFAIL).
RECOVERY_EXIT = 75
# A rank exits with this code when the state it must start from exists nowhere (``replica`` with every replica lost
# at once): no restart can mend that, so the supervisor ends the run instead of spending its budget.
NOTHING_TO_RECOVER_EXIT = 76
# A rank exits with this code after it saved on a preemption's notice (checkpoint.on_notice): the job is ending and a
# new one goes on with the run (resilience.rank.notice).
NOTICE_EXIT = 77
# A rank exits with this code when it left its node on a maintenance notice (fault=drain): the supervisor gives its
# rank to a spare, a move that spends no restart budget (resilience.rank.handover).
DRAIN_EXIT = 78
# None of these is a fault for the detectors that watch exits.
REQUESTED_EXITS = (RECOVERY_EXIT, NOTHING_TO_RECOVER_EXIT, NOTICE_EXIT, DRAIN_EXIT)

# A phase hook: (phase, step) -> None. The training loop and the strategies call it at each named point.
PhaseHook = Callable[[str, int], None]
# The phase a strategy that replays a lost pipeline stage (swift_log) calls the hook with at each replayed step,
# before its optimizer step: a fault there strikes the recovery itself (injectors.base).
REPLAY_PHASE = "during_replay"


def _no_hook(phase: str, step: int) -> None:
    return None


class CheckpointFileSystem(Protocol):
    """The checkpoint I/O layer: DCP's ``FileSystem`` (a disk fault provides one whose streams are slowed or fail)."""

    def create_stream(self, path: str | Path, mode: str) -> AbstractContextManager[IO[bytes]]: ...


class NodeMemory(Protocol):
    """What the nodes of a run hold in memory for recovery (the in-memory strategy's areas)."""

    def destroy(self, node: int) -> None:
        """Wipe everything node ``node`` holds, as the loss of that machine would."""


class AgentService(Protocol):
    """What a strategy runs in the supervisor process, beside the elastic agent, so that it outlives the ranks
    (DLRover's checkpoint saver, as ``dlrover-run``'s agent hosts it)."""

    role: str | None  # the role name the agent must give its workers (their ROLE_NAME); None: any

    def start(self, run_id: str, run_dir: Path) -> None:
        """Before the first ranks start; ``run_id`` is the rendezvous run id the ranks see as TORCHELASTIC_RUN_ID,
        ``run_dir`` the run directory (for the service's own files)."""

    def before_restart(self) -> None:
        """After the failed attempt's ranks are stopped, before the next ones start."""

    def close(self) -> None:
        """The run is over (whatever the outcome): finish what is in flight and release what it holds."""


class RejectionReport(Protocol):
    """Told of every committed checkpoint a load passed over, and why (the strategies always check)."""

    def __call__(self, step: int, path: Path, reason: str) -> None: ...


class ProcessGroup(Protocol):
    """The rank's process group (``resilience.rank.group.RankGroup``)."""

    generation: int
    timeout: timedelta  # of every collective, and of the wait for a replacement

    @property
    def in_place(self) -> bool: ...

    def rejoin(self, error: BaseException) -> int:
        """Re-form the group with a replacement after ``error``; return the new generation (or re-raise)."""

    def shrink(self, error: BaseException) -> list[int]:
        """Form a group of the survivors only after ``error``; return the ranks being replaced (or re-raise)."""

    def replacements_ready(self, failed: list[int]) -> bool:
        """Whether the replacements of ``failed`` are forming the full group."""

    def regrow(self) -> None:
        """Leave the survivors' group and form the full one with the replacements."""


class ModelWrap(Protocol):
    """Wraps the bare model for the current group (DDP with the run's gradient reduction)."""

    def __call__(self, module: nn.Module) -> nn.Module: ...


@dataclass(frozen=True)
class RankRuntime:
    """The identity and services of one rank process. ``attempt`` follows the event log (a rank that re-forms its
    group in place moves on to the new generation without a new process)."""

    rank: int
    world_size: int
    device: torch.device
    run_dir: Path
    ckpt_dir: Path
    events: EventLog
    # Whose checkpoints this rank may load (None: a unit test's runtime, any run's).
    identity: RunIdentity | None = None
    fault_hook: PhaseHook = field(default=_no_hook)
    # Recovery instructions for this attempt: load no checkpoint newer than this step (a rollback).
    load_max_step: int | None = None
    # Services provided by roles (None: nobody provides one; plain files, nothing in node memory, no extra check).
    ckpt_fs: CheckpointFileSystem | None = None
    node_memory: NodeMemory | None = None
    ckpt_rejected: RejectionReport | None = None
    group: ProcessGroup | None = None
    wrap_model: ModelWrap | None = None
    # The workload's model factory (a strategy that rebuilds a sharded model over a re-formed group builds it on
    # the meta device and overwrites every byte).
    build_model: Callable[[], nn.Module] | None = None
    # The pipeline stage this rank holds and its groups (``parallel=pp``, ``pp_dp``); None: not pipelined, the rank
    # runs the whole model.
    layout: Layout | None = None

    @property
    def attempt(self) -> int:
        return self.events.attempt
