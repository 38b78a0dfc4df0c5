"""A failure trace: failures at seeded arrivals with a mean of ``mtbf_steps`` steps between them (a compressed
MTBF), each of a kind drawn from a published mix, for the projection to be checked against a measured run
(``python -m resilience.bench.trace``; docs/projection.md, "The failure trace").

The mix is the Llama 3 405B 54-day table (Dubey et al., 2024, Table 5) as the projection maps it to recovery
kinds (docs/projection.md, "Data and calibration": 315 node replacements, 91 restarts, 7 hangs, 6 silent data
corruptions), restricted to the crash kinds, which recover by a restart whatever the technique: a node
replacement is ``fault=node_loss`` (the node's ranks and what its memory held for recovery), a restart
``fault=kill`` (one rank's process). Hangs and corruptions (13 of 419) need a detector's timeout or a rollback of
their own and are left out of the trace (say so where it is used). The plan is drawn once, from ``seed``, the same
on every rank; each failure fires once, in whichever attempt reaches its step (as a listed ``fault.at_step``).

Where in its step a failure strikes (``strike``): ``anywhere`` (the default) strikes a seeded fraction of a step's
time after the step's start (``strike_fraction``; a step's time is the median gap between the attempt's latest step
starts), from a forked child that holds none of the rank's locks (``injectors.striker``), so failures land anywhere
in a step's compute whatever the rank's threads are doing, as crashes in wall time do;
``boundary`` strikes at the step's start, as a listed ``fault=kill`` does. The difference is what a checkpoint's
lag of a few milliseconds races: at the boundary right after a checkpoint every such failure meets it, in wall
time only a few milliseconds of every interval do (docs/projection.md, "The failure trace").

Which clock the arrivals are on (``clock``): ``steps`` (the default) plans them by step, as above, so a failure
strikes only in a training step, never in a recovery; ``wall`` plans them in seconds, ``mtbf_s`` apart on average,
over the run's whole wall clock from its first training step's start, recoveries included, as real failures arrive
and as the projection's closed form models them (``arrivals``). Those are struck from the supervisor, on whatever
process the fault's rank has at that moment, training or restarting (``injectors.wall_striker``); the rank side of
this injector then does nothing (``strike`` and ``mtbf_steps`` are the step clock's).
"""

from __future__ import annotations

import random
import statistics
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import replace
from itertools import takewhile
from typing import Any

from injectors.base import Injector
from injectors.kill import Kill
from injectors.node_loss import NodeLoss
from injectors.striker import Striker
from resilience.settings.checks import require_choice, require_int, require_number
from resilience.workloads.base import stream_seed

# Table 5 of the Llama 3 report, as the projection maps it (the crash kinds): the kind's weight and its fault.
MIXES = {"llama3": {"node_loss": 315, "kill": 91}}
STRIKES = ("anywhere", "boundary")
CLOCKS = ("steps", "wall")


class Trace(Injector):
    """Failures at seeded exponential arrivals, kinds drawn from ``mix``: on the step clock from ``at_step`` on, a
    ``Kill`` and a ``NodeLoss`` with listed steps do the work; on the wall clock the supervisor strikes them."""

    # the wall clock's failures are struck from our supervisor, which knows each attempt's rank processes
    caps = replace(Injector.caps, when={**Injector.caps.when, "clock=wall": {"strikes_from_supervisor": True}})

    def __init__(self, mtbf_steps: float = 40.0, mix: str = "llama3", ranks_per_node: int = 1,
                 strike: str = "anywhere", clock: str = "steps", mtbf_s: float | None = None,
                 **trigger: Any) -> None:
        super().__init__(**trigger)
        self.mtbf_steps = require_number("fault.mtbf_steps", mtbf_steps, above=0)
        self.clock = require_choice("fault.clock", clock, CLOCKS)
        if clock == "wall":
            if mtbf_s is None:
                raise ValueError("fault.mtbf_s=null: fault.clock=wall needs the MTBF in seconds (a number > 0)")
            self.mtbf_s: float | None = require_number("fault.mtbf_s", mtbf_s, above=0)
        elif mtbf_s is not None:
            raise ValueError(f"fault.mtbf_s={mtbf_s}: only with fault.clock=wall (fault.clock=steps plans by "
                             f"fault.mtbf_steps); give fault.mtbf_s=null or fault.clock=wall")
        else:
            self.mtbf_s = None
        self.caps = self.caps.under(clock=clock)
        if mix not in MIXES:
            raise ValueError(f"fault.mix={mix}: must be one of {', '.join(MIXES)}")
        if strike not in STRIKES:
            raise ValueError(f"fault.strike={strike}: must be one of {', '.join(STRIKES)}")
        self.mix, self.strike = mix, strike
        self.ranks_per_node = require_int("ranks_per_node", ranks_per_node, 1)
        self.parts: list[Injector] = []
        self.kinds: dict[int, str] = {}  # step -> the fault's kind
        self.starts: deque[float] = deque(maxlen=9)  # when this attempt's latest steps started
        self.striker = Striker()

    def validate(self, world_size: int, steps: int, ckpt_every: int | None) -> None:
        super().validate(world_size, steps, ckpt_every)
        if world_size % self.ranks_per_node:
            raise ValueError(f"ranks_per_node={self.ranks_per_node}: must divide world_size={world_size}")
        if self.clock == "wall":  # nothing planned by step: the supervisor strikes (injectors.wall_striker)
            self.kinds, self.plan, self.parts = {}, [], []
            return
        self.kinds = draw(self.mix, self.mtbf_steps, self.seed, self.at_step, steps)
        self.plan = sorted(self.kinds)
        self.parts = []
        for fault, cls in (("kill", Kill), ("node_loss", NodeLoss)):
            listed = [s for s in self.plan if self.kinds[s] == fault]
            if listed:
                extra = {"ranks_per_node": self.ranks_per_node} if cls is NodeLoss else {}
                part = cls(rank=self.rank, at_step=listed, phase=self.phase, seed=self.seed, **extra)
                part.validate(world_size, steps, ckpt_every)
                self.parts.append(part)

    def targets(self) -> set[int]:
        return set().union(*(p.targets() for p in self.parts)) if self.parts else {self.rank}

    def node_ranks(self) -> list[int]:
        """The ranks of the simulated node that holds ``fault.rank``: what a node loss takes."""
        first = self.rank // self.ranks_per_node * self.ranks_per_node
        return list(range(first, first + self.ranks_per_node))

    def attach(self, rt) -> None:
        self.rt = rt
        for p in self.parts:
            p.attach(rt)

    def arm(self, state) -> None:
        for p in self.parts:
            p.arm(state)

    def cleanup(self) -> None:
        self.striker.stop()  # the rank leaves before its failure struck (it fires in no later attempt)
        for p in self.parts:
            p.cleanup()

    def __call__(self, phase: str, step: int) -> None:
        if phase == "before_forward":
            self.starts.append(time.monotonic())
        for p in self.parts:
            index = p.due(phase, step)
            if index is None:
                continue
            if self.strike == "boundary":
                p.fire(step, index)
                continue
            p.fired.add(index)  # set now: the step is not met again in this attempt
            self.striker.start(self.delay_s(step), p, step, index)

    def delay_s(self, step: int) -> float:
        """How long after the start of ``step`` its failure strikes: its seeded fraction of a step's time (the
        median gap between the attempt's latest step starts, a checkpoint's gap among them; 0 before the second)."""
        gaps = [b - a for a, b in zip(self.starts, list(self.starts)[1:])]
        return strike_fraction(self.seed, step) * statistics.median(gaps) if gaps else 0.0

    def _plan_detail(self, step: int) -> dict[str, Any]:  # the parts record their own firings
        raise AssertionError("a trace's failures are recorded by its parts")

    def _act(self, step: int) -> None:
        raise AssertionError("a trace's failures are acted by its parts")


def draw(mix: str, mtbf_steps: float, seed: int, first: int, steps: int) -> dict[int, str]:
    """The trace: step -> kind, arrivals at exponential gaps of mean ``mtbf_steps`` from ``first`` (a failure
    rounded onto a step that already has one is dropped), each kind drawn by the mix's weights. A pure function of
    its arguments (a private generator), for the bench to predict from before the run."""
    rng = random.Random(stream_seed(seed, "trace", "plan"))
    kinds, weights = zip(*MIXES[mix].items())
    out: dict[int, str] = {}
    t = float(first)
    while True:
        t += rng.expovariate(1.0 / mtbf_steps)
        step = int(round(t))
        if step >= steps:
            return out
        kind = rng.choices(kinds, weights)[0]
        out.setdefault(step, kind)


def arrivals(mix: str, mtbf_s: float, seed: int) -> Iterator[tuple[float, str]]:
    """The wall clock's trace, without end: (seconds after the first training step's start, kind), at exponential
    gaps of mean ``mtbf_s``, each kind drawn by the mix's weights. A pure function of its arguments (a private
    generator, a stream of its own), for the bench to predict from before the run."""
    rng = random.Random(stream_seed(seed, "trace", "wall"))
    kinds, weights = zip(*MIXES[mix].items())
    t = 0.0
    while True:
        t += rng.expovariate(1.0 / mtbf_s)
        yield t, rng.choices(kinds, weights)[0]


def draw_wall(mix: str, mtbf_s: float, seed: int, until_s: float) -> list[tuple[float, str]]:
    """The wall clock's arrivals before ``until_s`` seconds after the first training step's start."""
    return list(takewhile(lambda a: a[0] < until_s, arrivals(mix, mtbf_s, seed)))


def strike_fraction(seed: int, step: int) -> float:
    """Where in step ``step`` its failure strikes, as a fraction of the step's time in [0, 1): a pure function of
    the trace's seed and the step (the bench predicts from it)."""
    return random.Random(stream_seed(seed, "trace", "strike", step)).random()
