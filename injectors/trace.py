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

How the exponential gaps are drawn (``fault.arrivals``), on either clock: ``poisson`` (the default) independently, a
Poisson process; ``stratified`` in blocks of ``BLOCK`` gaps, one from each of ``BLOCK`` equal-probability strata of
the exponential, in a seeded order (``stratified_block``): a declared variance reduction for the bench, which
keeps each gap's marginal exponential of the same mean but makes a block span close to its expected time, so
the count of failures in a window scatters far less than a Poisson count's sqrt(K) (docs/projection.md, "The
failure trace").
"""

from __future__ import annotations

import math
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
# llama3: the trace's; one kind alone: the trace bench's fit runs, each recovery of one kind struck as the trace strikes
MIXES = {"llama3": {"node_loss": 315, "kill": 91}, "kill": {"kill": 1}, "node_loss": {"node_loss": 1}}
STRIKES = ("anywhere", "boundary")
CLOCKS = ("steps", "wall")
ARRIVAL_DRAWS = ("poisson", "stratified")
# Stratified gaps per block. A whole block's time scatters by about one mean whatever its size (the last stratum's
# tail); a window's partial blocks at either end (their gaps a random subset of the strata) by up to ~sqrt(BLOCK) / 2
# means: over a window of K expected arrivals the count's variance is ~1.1 K / BLOCK + BLOCK / 3 (simulated), least
# near BLOCK = sqrt(3.3 K): 11-16 for the ~40-80 failures a technique meets in make trace. 16: at K = 70 the count
# scatters by ~3.2 failures (4.5%) against a Poisson count's sqrt(70) = 8.4 (12%); at K = 35, 2.8 against 2.7 at 8.
BLOCK = 16


class Trace(Injector):
    """Failures at seeded exponential arrivals, kinds drawn from ``mix``: on the step clock from ``at_step`` on, a
    ``Kill`` and a ``NodeLoss`` with listed steps do the work; on the wall clock the supervisor strikes them."""

    # the wall clock's failures are struck from our supervisor, which knows each attempt's rank processes
    caps = replace(Injector.caps, when={**Injector.caps.when, "clock=wall": {"strikes_from_supervisor": True}})

    def __init__(self, mtbf_steps: float = 40.0, mix: str = "llama3", ranks_per_node: int = 1,
                 strike: str = "anywhere", clock: str = "steps", mtbf_s: float | None = None,
                 arrivals: str = "poisson", **trigger: Any) -> None:
        super().__init__(**trigger)
        self.mtbf_steps = require_number("fault.mtbf_steps", mtbf_steps, above=0)
        self.clock = require_choice("fault.clock", clock, CLOCKS)
        self.arrivals = require_choice("fault.arrivals", arrivals, ARRIVAL_DRAWS)
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
        self.kinds = draw(self.mix, self.mtbf_steps, self.seed, self.at_step, steps, self.arrivals)
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


def draw(mix: str, mtbf_steps: float, seed: int, first: int, steps: int,
         how: str = "poisson") -> dict[int, str]:
    """The trace: step -> kind, arrivals from ``first`` at exponential gaps of mean ``mtbf_steps`` drawn as ``how``
    says (``times``; a failure rounded onto a step that already has one is dropped), each kind drawn by the mix's
    weights. A pure function of its arguments (private generators), for the bench to predict from before the run."""
    rng = random.Random(stream_seed(seed, "trace", "plan"))
    kinds, weights = zip(*MIXES[mix].items())
    out: dict[int, str] = {}
    strata = random.Random(stream_seed(seed, "trace", "plan", "stratified"))
    for t in times(how, mtbf_steps, rng, strata, start=float(first)):
        step = int(round(t))
        if step >= steps:
            return out
        kind = rng.choices(kinds, weights)[0]
        out.setdefault(step, kind)
    raise AssertionError("times() has no end")


def arrivals(mix: str, mtbf_s: float, seed: int, how: str = "poisson") -> Iterator[tuple[float, str]]:
    """The wall clock's trace, without end: (seconds after the first training step's start, kind), at exponential
    gaps of mean ``mtbf_s`` drawn as ``how`` says (``times``), each kind drawn by the mix's weights. A pure function
    of its arguments (private generators, streams of their own), for the bench to predict from before the run."""
    rng = random.Random(stream_seed(seed, "trace", "wall"))
    kinds, weights = zip(*MIXES[mix].items())
    for t in times(how, mtbf_s, rng, random.Random(stream_seed(seed, "trace", "wall", "stratified"))):
        yield t, rng.choices(kinds, weights)[0]


def draw_wall(mix: str, mtbf_s: float, seed: int, until_s: float,
              how: str = "poisson") -> list[tuple[float, str]]:
    """The wall clock's arrivals before ``until_s`` seconds after the first training step's start."""
    return list(takewhile(lambda a: a[0] < until_s, arrivals(mix, mtbf_s, seed, how)))


def times(how: str, mean: float, rng: random.Random, strata: random.Random, start: float = 0.0) -> Iterator[float]:
    """Arrival times after ``start`` at exponential gaps of mean ``mean``, without end. ``poisson``: each gap from
    ``rng`` when the caller asks for the next time, between its kind draws on the same generator (so a seed gives
    the values it always gave); ``stratified``: ``stratified_times`` on ``strata``, a generator of its own, so that
    the kinds are drawn from ``rng`` one per arrival and nothing else."""
    if how == "stratified":
        yield from stratified_times(strata, mean, start)
        return
    t = start  # summed from the start, as always: the same floats, so the same rounded steps
    while True:
        t += rng.expovariate(1.0 / mean)
        yield t


def stratified_times(rng: random.Random, mean: float, start: float, n: int = BLOCK) -> Iterator[float]:
    """Arrival times after ``start`` at stratified gaps (``stratified_block``), blocks of ``n``. The blocks begin a
    seeded uniform fraction of a block's expected span before ``start``, and the arrivals before it are dropped:
    begun at a block's start, as if a failure had just struck, a process this regular puts its first failure a whole
    gap after the start on average and ~0.4 fewer than W / M in a window of W (a Poisson process is memoryless: it
    may begin anywhere); begun at a random phase, the count's mean is W / M within ~0.1."""
    t = start - rng.random() * n * mean
    while True:
        for gap in stratified_block(rng, mean, n):
            t += gap
            if t > start:
                yield t


def stratified_block(rng: random.Random, mean: float, n: int = BLOCK) -> list[float]:
    """``n`` exponential gaps of mean ``mean``, gap = -mean x ln(1 - (i + u) / n) with u uniform, one for each
    stratum i of 0 .. n - 1 in a seeded random order. A gap is a uniformly chosen stratum and a uniform point in it,
    so its marginal is still exponential of mean ``mean``; the block, one gap per stratum, spans n x mean to within
    about one mean (the last stratum's tail), where n independent gaps scatter by sqrt(n) means. The order is
    shuffled so that no position in a block is long or short on average."""
    order = rng.sample(range(n), n)
    # ln(n) - ln(n - i - u): the same quantile, and n - i - u > 0 for u < 1 (1 - (i + u) / n may round to 0)
    return [mean * (math.log(n) - math.log(n - i - rng.random())) for i in order]


def strike_fraction(seed: int, step: int) -> float:
    """Where in step ``step`` its failure strikes, as a fraction of the step's time in [0, 1): a pure function of
    the trace's seed and the step (the bench predicts from it)."""
    return random.Random(stream_seed(seed, "trace", "strike", step)).random()
