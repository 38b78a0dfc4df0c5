"""The injector interface and the trigger that every fault shares.

A fault fires at planned (rank, step, phase) points, the same plan on every rank, computed from the fault's seed
without communication and without touching the global torch, numpy or random generators. Its ``fault_injected``
record is written *before* the destructive action (a SIGKILLed process cannot log afterwards; fsynced first too,
except from a striker, which syncs it after acting so that a busy disk does not delay the strike), and
the records are also what make each planned point fire only once per run: restarted ranks pass the same steps
again, find the records in the event log, and do not fire again. A fault that ``takes_step_list`` may be planned at
several steps (``fault.at_step=[7,15,22]``, with one ``fault.phase`` or one per step): each fires once, in whichever
attempt reaches it first, so one run meets several failures and recoveries.

Lifecycle on a rank: ``attach(rt)`` (identity, event log) -> ``hook_reduction(ddp)`` (with ``hooks_reduction``) ->
``arm(state)`` (hooks into the model, if any) ->
``__call__(phase, step)`` at every phase of every step -> ``cleanup()`` when the rank leaves, also on a crash.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from torch.nn.parallel import DistributedDataParallel

from resilience.caps import InjectorCaps, Named
from resilience.settings.checks import require_int
from injectors.plan import fault_plan
from resilience.record.events import read_events
from resilience.runtime.rank import REPLAY_PHASE, CheckpointFileSystem, RankRuntime
from resilience.state.train import TrainState
from resilience.workloads.base import Workload

PHASES = ("before_forward", "before_optimizer_step", "during_checkpoint")
# REPLAY_PHASE is reached only by a strategy that replays a lost pipeline stage (swift_log): a fault there strikes the
# recovery itself (fault.at_step=[5,7] fault.phase=[during_replay,before_forward]: the kill at 7 starts a replay of
# the steps since the checkpoint, killed again at 5). Not among the training's phases.


class Injector(Named, ABC):
    """Fires on rank ``rank`` when training reaches ``at_step`` at ``phase``.

    With ``probability`` set, every step from ``at_step`` on is a candidate that fires with that probability
    (drawn from ``seed``), up to ``count`` times in all: faults at a known rate. With ``takes_step_list``,
    ``at_step`` may be a list of steps and ``phase`` one phase per step: a schedule of several faults.
    """

    hooks_reduction: bool = False  # True: it registers the DDP comm hook (and calls resilience.runtime.reduce itself)
    # True: fault.at_step may list several steps. Off by default: a fault that acts from its step on (a slow disk, a
    # straggler) or ends the job has no second firing to plan.
    takes_step_list: bool = False
    caps = InjectorCaps(when={"phase=during_checkpoint": {"needs_checkpoint": "fault.phase=during_checkpoint"}})

    def __init__(self, rank: int = 0, at_step: int | Sequence[int] = 0, phase: str | Sequence[str] = "before_forward",
                 probability: float | None = None, count: int = 1, seed: int = 0) -> None:
        self.rank = require_int("fault.rank", rank, 0)
        self.count = require_int("fault.count", count, 1)
        self.seed = require_int("fault.seed", seed, 0)
        if probability is not None and not (isinstance(probability, (int, float)) and 0 < probability <= 1):
            raise ValueError(f"fault.probability={probability}: must be a number in (0, 1], or null")
        self.probability = probability
        self.listed = _is_list(at_step)  # a schedule of several faults: the plan is the list itself
        self.at_steps = self._listed_steps(at_step) if self.listed else [require_int("fault.at_step", at_step, 0)]
        self.phases = self._phases(phase)
        self.at_step, self.phase = self.at_steps[0], self.phases[0]  # the first: what one-step faults read
        # A save is needed as soon as one of the faults strikes during one (resilience.compat reads it).
        self.caps = self.caps.under(phase="during_checkpoint" if "during_checkpoint" in self.phases else self.phase)
        if REPLAY_PHASE in self.phases:  # (a list may strike in a save too: both hold)
            self.caps = replace(self.caps, strikes_replay=True)
        self.plan: list[int] = list(self.at_steps)
        self.rt: RankRuntime | None = None
        self.fired: set[int] = set()

    def _listed_steps(self, at_step: Sequence[Any]) -> list[int]:
        """``fault.at_step`` as a list: allowed only where the fault takes one, alone, strictly increasing, >= 1."""
        steps, shown = list(at_step), f"fault.at_step={_shown(at_step)}"
        if not self.takes_step_list:
            raise ValueError(f"{shown}: fault={self.name} fires at one step; give one integer (a list of steps is "
                             f"taken by fault=kill and fault=node_loss)")
        if self.probability is not None:
            raise ValueError(f"{shown}: a list of steps is a schedule of its own and fault.probability="
                             f"{self.probability} draws one; give one step with fault.probability, or "
                             f"fault.probability=null with the list")
        if not steps or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in steps) or any(
                a >= b for a, b in zip(steps, steps[1:])):
            raise ValueError(f"{shown}: must be an integer >= 0, or a non-empty list of strictly increasing "
                             f"integers >= 1")
        return steps

    def _phases(self, phase: str | Sequence[str] | None) -> list[str]:
        """One phase per planned step: ``fault.phase`` for every one, or a list with one phase per listed step."""
        if not _is_list(phase):
            if phase not in (*PHASES, REPLAY_PHASE):
                raise ValueError(f"fault.phase={phase}: must be one of {', '.join((*PHASES, REPLAY_PHASE))}")
            return [phase] * len(self.at_steps)
        phases, shown = list(phase), f"fault.phase={_shown(phase)}"
        if not self.listed:
            raise ValueError(f"{shown}: one phase per fault needs a list of steps (fault.at_step=[...], as many as "
                             f"phases); with one step give one of {', '.join(PHASES)}")
        if len(phases) != len(self.at_steps):
            raise ValueError(f"{shown}: {len(phases)} phases for {len(self.at_steps)} steps in fault.at_step="
                             f"{_shown(self.at_steps)}; give one phase, or one per step")
        if any(p not in (*PHASES, REPLAY_PHASE) for p in phases):
            raise ValueError(f"{shown}: each must be one of {', '.join((*PHASES, REPLAY_PHASE))}")
        return phases

    def validate(self, world_size: int, steps: int, ckpt_every: int | None) -> None:
        """Check the plan against the run (``ckpt_every`` is None when the strategy never checkpoints: the table
        of rules refuses a fault that needs a checkpoint then, resilience.compat)."""
        if self.rank >= world_size:
            raise ValueError(f"fault.rank={self.rank}: must be in [0, {world_size - 1}] for world_size={world_size}")
        if self.listed:
            self._validate_list(steps, ckpt_every)
        elif self.phase == "during_checkpoint" and ckpt_every is not None:
            if self.at_step % ckpt_every or not 0 < self.at_step < steps:
                raise ValueError(f"fault.at_step={self.at_step}: with fault.phase=during_checkpoint it must be a "
                                 f"checkpoint step (a multiple of checkpoint.every={ckpt_every} below steps={steps})")
        elif self.at_step >= steps:
            raise ValueError(f"fault.at_step={self.at_step}: must be in [0, {steps - 1}] for steps={steps}")
        self.plan = self._make_plan(steps, ckpt_every)

    def _validate_list(self, steps: int, ckpt_every: int | None) -> None:
        shown = f"fault.at_step={_shown(self.at_steps)}"
        if self.at_steps[-1] >= steps:
            raise ValueError(f"{shown}: every step must be in [1, {steps - 1}] for steps={steps}")
        for step, phase in zip(self.at_steps, self.phases):
            # A save happens only at a multiple of checkpoint.every: a during-save fault elsewhere would never fire.
            if phase == "during_checkpoint" and ckpt_every is not None and step % ckpt_every:
                phases = self.phase if len(set(self.phases)) == 1 else _shown(self.phases)
                raise ValueError(f"{shown} fault.phase={phases}: step {step} strikes during_checkpoint, "
                                 f"so it must be a checkpoint step (a multiple of checkpoint.every={ckpt_every})")

    def check_workload(self, workload: Workload) -> None:
        """Before launch: raise ``ValueError`` naming the setting if this fault cannot act on ``workload``'s model
        (what the rank would otherwise find only when the fault fires)."""

    def _make_plan(self, steps: int, ckpt_every: int | None) -> list[int]:
        """The steps at which this fault fires; a pure function of the settings and the seed."""
        return fault_plan(self.name, self.seed, self.at_steps if self.listed else self.at_step, steps,
                          self.probability, self.count, self.phase == "during_checkpoint", ckpt_every)

    def targets(self) -> set[int]:
        """The ranks this fault acts on."""
        return {self.rank}

    def checkpoint_fs(self, rank: int) -> CheckpointFileSystem | None:
        """The service this fault provides to rank ``rank``'s runtime: the checkpoint I/O layer (None: plain)."""
        return None

    def attach(self, rt: RankRuntime) -> None:
        """Bind to a rank; points already recorded in this run's event log (by any earlier attempt or job) never
        fire again."""
        self.rt = rt
        self.fired = {e.get("plan_index", 0) for e in read_events(rt.run_dir)
                      if e["kind"] == "fault_injected" and e.get("fault") == self.name}
        self._steps = {step: i for i, step in enumerate(self.plan)}
        self._mine = rt.rank in self.targets()

    def arm(self, state: TrainState) -> None:
        """Install hooks into the training state (model, optimizer) if the fault needs them."""

    def hook_reduction(self, ddp: DistributedDataParallel) -> None:
        """With ``hooks_reduction``: register the DDP comm hook (on every DDP wrapper the rank builds)."""

    def cleanup(self) -> None:
        """Undo whatever the injector set up; called when the rank leaves, also after an exception."""

    def __call__(self, phase: str, step: int) -> None:
        """The phase hook: a few comparisons when it does not fire."""
        index = self.due(phase, step)
        if index is not None:
            self.fire(step, index)

    def due(self, phase: str, step: int) -> int | None:
        """The planned point this rank meets at (``phase``, ``step``) and has not fired yet, or None."""
        if not self._mine or step not in self._steps:
            return None
        index = self._steps[step]
        return None if phase != self._phase_of(index) or index in self.fired else index

    def fire(self, step: int, index: int) -> None:
        """Mark planned point ``index`` fired, then strike."""
        self.fired.add(index)
        self.strike(step, index)

    def strike(self, step: int, index: int) -> None:
        """Record planned point ``index``'s firing, then act: from the phase hook, or a moment later from a striker
        child (``fault=trace``, ``injectors.striker``, which calls ``record`` and ``act_on``)."""
        self.record(step, index, self._plan_detail(step))
        self._act(step)

    def _phase_of(self, index: int) -> str:
        """The phase of planned point ``index``: its own in a list, else the one phase (a probability's draws)."""
        return self.phases[index] if self.listed else self.phase

    def record(self, step: int, index: int, detail: dict[str, Any], fsync: bool = True) -> None:
        """Write (and fsync, unless a striker syncs it after its action) the ground-truth record of one firing,
        before its action."""
        self.rt.events.emit("fault_injected", step=step, fault=self.name, phase=self._phase_of(index),
                            plan_index=index, target_rank=self.rank, seed=self.seed, fsync=fsync, **detail)

    def sync_records(self) -> None:
        """The records written without fsync, on disk."""
        self.rt.events.sync()

    @abstractmethod
    def _plan_detail(self, step: int) -> dict[str, Any]:
        """Everything needed to reproduce the fault, for its record."""

    @abstractmethod
    def _act(self, step: int) -> None:
        """The destructive action itself."""


def _is_list(value: Any) -> bool:
    """A list of settings (a Python list, or the ListConfig Hydra passes for ``[7,15,22]``), not a string."""
    return isinstance(value, Sequence) and not isinstance(value, str)


def _shown(values: Sequence[Any]) -> str:
    """A list as it is written on the command line: ``[7,15,22]``."""
    return f"[{','.join(map(str, values))}]"
