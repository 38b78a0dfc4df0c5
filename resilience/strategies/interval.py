"""When a checkpoint is due: a fixed interval (``checkpoint.every=N``), or one chosen from what the run measures
(``checkpoint.every=auto``, the ``checkpoint.auto`` block of conf/config.yaml).

``auto`` times the first checkpoints at ``first`` steps apart, then chooses the interval from the measured stall
C (the loop's pause per checkpoint), the measured step time and the failure rate M it is given, and chooses again
after every checkpoint as the cost changes:

* ``optimal``: the maximiser of the projection's closed-form goodput (``resilience.projection.intervals``): the
  interval the report's scale section calls optimal;
* ``young``: sqrt(2 C M) (Young 1974); ``daly``: its higher-order form (Daly 2006);
* ``checkfreq``: the most frequent interval whose checkpoints cost at most ``budget`` of the training time
  (CheckFreq, FAST'21: "<= 3.5%"); with the other rules ``budget`` is a cap they are lengthened to meet.

Every rank must checkpoint at the same steps (a save is collective), so the ranks agree on the costs before each
choice: the largest stall and step time of any rank, one all-reduce per checkpoint. Each choice is a
``ckpt_interval`` event (the step, the interval, the reason with its figures); the result lists them
(``checkpoint_intervals``). A restarted attempt starts from the last choice in the run's event log, so a recovery
does not calibrate again.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from resilience.projection.intervals import daly_interval, optimal_interval, young_interval
from resilience.record.events import read_events
from resilience.settings.checks import require_choice, require_int, require_number

RULES = ("optimal", "young", "daly", "checkfreq")
RECENT = 5    # the stalls a choice takes the median of: the cost as it is now, one slow save does not swing it
STEPS = 50    # the step times likewise


class Interval:
    """A fixed interval: a checkpoint after every ``every``-th step; the final state is not checkpointed."""

    def __init__(self, every: int) -> None:
        self.every = require_int("checkpoint.every", every, 1)

    def due(self, step: int, total_steps: int) -> bool:
        return step % self.every == 0 and 0 < step < total_steps

    def check(self) -> None:
        """Before launch, for a strategy that saves: raise ``ValueError`` naming a missing setting."""

    def attach(self, rt) -> None:
        """Bind to the rank (once per attempt, before the load)."""

    def saved(self, step: int, stall_s: float | None) -> None:
        """The checkpoint of ``step`` stalled the loop ``stall_s`` (None: it was skipped); every rank calls it."""


@dataclass(frozen=True)
class Costs:
    stall_s: float
    step_s: float
    mtbf_s: float


class AutoInterval(Interval):
    """``checkpoint.every=auto``: see the module docstring."""

    def __init__(self, rule: str = "optimal", mtbf_s: float | None = None, mtbf_steps: float | None = None,
                 budget: float | None = None, first: int = 5, calibration: int = 2, max_every: int = 10_000) -> None:
        super().__init__(require_int("checkpoint.auto.first", first, 1))
        self.rule = require_choice("checkpoint.auto.rule", rule, RULES)
        self.mtbf_s = None if mtbf_s is None else require_number("checkpoint.auto.mtbf_s", mtbf_s, above=0)
        self.mtbf_steps = None if mtbf_steps is None else require_number("checkpoint.auto.mtbf_steps", mtbf_steps,
                                                                          above=0)
        self.budget = None if budget is None else require_number("checkpoint.auto.budget", budget, above=0)
        if self.rule == "checkfreq" and self.budget is None:
            raise ValueError("checkpoint.auto.rule=checkfreq: give checkpoint.auto.budget (the overhead cap, "
                             "e.g. 0.035)")
        self.calibration = require_int("checkpoint.auto.calibration", calibration, 1)
        self.max_every = require_int("checkpoint.auto.max_every", max_every, 1)
        self.rt = None
        self.next_due: int | None = None  # set by the attempt's first step (due)
        self.stalls: list[float] = []
        self.steps: list[float] = []
        self.chosen = False
        self.saves = 0  # this attempt's
        self._clock: tuple[int, float] | None = None  # (the step of the last due() call, when)
        self._stall_at: dict[int, float] = {}

    def check(self) -> None:
        """Before launch, for a strategy that saves (a run that never checkpoints, its reference, needs no M)."""
        if (self.mtbf_s is None) == (self.mtbf_steps is None):
            raise ValueError("checkpoint.every=auto: give the failure rate as exactly one of checkpoint.auto.mtbf_s "
                             "or checkpoint.auto.mtbf_steps (a number > 0)")

    def attach(self, rt) -> None:
        self.rt = rt
        earlier = [e for e in read_events(rt.run_dir) if e["kind"] == "ckpt_interval"]
        if earlier:  # a restart: every rank reads the same log, so they go on from the same choice
            self.every, self.chosen = int(earlier[-1]["interval"]), True
        self.next_due, self._clock, self.saves = None, None, 0

    def due(self, step: int, total_steps: int) -> bool:
        if self.next_due is None:  # the attempt's first step ended: it went on from step - 1 (the loaded one)
            self.next_due = step - 1 + self.every
        self._time_step(step)
        return step == self.next_due and 0 < step < total_steps

    def _time_step(self, step: int) -> None:
        """Called at the end of every step (and again for a due one): the step's time, its save's stall taken
        off (a plain step is what an interval multiplies)."""
        now = time.monotonic()
        if self._clock is not None and step == self._clock[0]:
            return
        if self._clock is not None and step == self._clock[0] + 1:
            self.steps = (self.steps + [now - self._clock[1] - self._stall_at.pop(self._clock[0], 0.0)])[-STEPS:]
        self._clock = (step, now)

    def saved(self, step: int, stall_s: float | None) -> None:
        if stall_s is not None:
            self._stall_at[step] = stall_s
            self.stalls = (self.stalls + [stall_s])[-RECENT:]
        self.saves += 1  # alike on every rank (the agreement below is a collective), unlike the timings
        if not self.chosen and self.saves < self.calibration:
            self.next_due = step + self.every
            return
        costs = self._agreed()
        if costs.stall_s <= 0 or costs.step_s <= 0:  # no rank has timed both yet (the agreed figures say so alike)
            self.next_due = step + self.every
            return
        every, reason = self.choose(costs)
        if every != self.every or not self.chosen:
            if self.rt.rank == 0:
                self.rt.events.emit("ckpt_interval", step=step, interval=every, reason=reason,
                                    stall_s=costs.stall_s, step_s=costs.step_s, mtbf_s=costs.mtbf_s, fsync=True)
        self.every, self.chosen, self.next_due = every, True, step + every

    def _agreed(self) -> Costs:
        """The costs every rank chooses from: the largest of any rank's (a save waits for the slowest)."""
        mine = torch.tensor([statistics.median(self.stalls) if self.stalls else 0.0,
                             statistics.median(self.steps) if self.steps else 0.0], dtype=torch.float64,
                            device=self.rt.device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # the default group: every rank saves
        stall_s, step_s = (float(x) for x in mine.cpu())
        mtbf_s = self.mtbf_s if self.mtbf_s is not None else self.mtbf_steps * step_s
        return Costs(stall_s, step_s, mtbf_s)

    def choose(self, c: Costs) -> tuple[int, str]:
        """The interval in steps for ``c``, and why, in one line with its figures."""
        if self.rule == "checkfreq":
            seconds = c.stall_s / self.budget
        else:
            seconds = float({"optimal": optimal_interval, "young": young_interval,
                             "daly": daly_interval}[self.rule](c.stall_s, c.mtbf_s))
        every = max(1, round(seconds / c.step_s))
        why = f"{self.rule}: C {c.stall_s:.4f} s, M {c.mtbf_s:.3g} s -> {seconds:.3f} s / step {c.step_s:.4f} s"
        least = c.stall_s / (self.budget * c.step_s) if self.budget is not None else 0.0  # within the overhead cap
        if every < least * (1 - 1e-9):  # (the tolerance: float division, not a real shortfall)
            every, why = math.ceil(least * (1 - 1e-9)), f"{why}; lengthened to budget {self.budget:g}"
        if every > self.max_every:
            every, why = self.max_every, f"{why}; capped at max_every"
        return every, f"{why} = {every} steps"


def interval_of(every, auto) -> Interval:
    """``checkpoint.every`` (an integer, or ``auto`` with its ``checkpoint.auto`` settings) as an ``Interval``."""
    if isinstance(every, str) and every == "auto":
        return AutoInterval(**dict(auto or {}))
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"checkpoint.every={every}: must be an integer >= 1, or auto")
    return Interval(every)
