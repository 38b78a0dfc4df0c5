"""When a fault fires: a pure function of its settings and seed, the same on every rank and before any run.

The injectors fire at these steps; the projection's parity check predicts from the same plan before running.
Private generator: the run's torch, numpy and random generators stay untouched.
"""

from __future__ import annotations

import random

from resilience.workloads.base import stream_seed


def fault_plan(fault: str, seed: int, at_step: int | list[int], steps: int, probability: float | None, count: int,
               checkpoint_steps_only: bool = False, ckpt_every: int | None = None) -> list[int]:
    """The steps at which fault ``fault`` fires: ``at_step`` alone (or each step of a list: a schedule, which the
    injector never mixes with a probability), or with ``probability`` every step from ``at_step`` on (only
    checkpoint steps with ``checkpoint_steps_only``) drawn from ``seed``, ``count`` at most."""
    if isinstance(at_step, list):
        return list(at_step)
    if probability is None:
        return [at_step]
    rng = random.Random(stream_seed(seed, fault, "plan"))
    candidates = range(at_step, steps)
    if checkpoint_steps_only:
        candidates = [s for s in candidates if ckpt_every and s % ckpt_every == 0]
    return [s for s in candidates if rng.random() < probability][:count]
