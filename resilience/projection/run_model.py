"""The run-level model of goodput, and its measurement: what a run's events say each cost was.

``python -m resilience.projection.parity [--out DIR] [--quick] [--reuse]`` is the out-of-sample validation
(:mod:`resilience.projection.parity`: costs fitted on some runs predict others); this module holds what it builds
on: the model (pure functions), the measurement of one run (:func:`measure`) and the experiments (:class:`RunSpec`,
gpt_tiny, 2 ranks, ``strategy=sync``, ``fault=kill`` with ``fault.probability=p``: faults at a known rate). The
model and its assumptions are in docs/projection.md, "Validation against measured runs".

Both sides use the definitions of ``resilience/record/metrics.py``: goodput = (sum of the durations of the steps
that survived, each step once) / (wall time from the supervisor's ``launch`` to ``supervisor_end``); ETTR = the
same over the first step's start to the last step's end. The prediction decomposes that wall time (seconds)::

    W = T_start + N t_w + n_c C + K (R + l t_w) + T_end,      G = N t_d / W,      ETTR = N t_d / (W - T_start - T_end)

N steps of wall time t_w each (the step's own duration t_d plus the loop's overhead around it), n_c = floor((N-1)
/ every) blocking checkpoints of stall C (the final state is not saved), K faults, each costing R (fault ->
detection -> restart -> load -> first step of the next attempt) plus the replay of l lost steps, the start-up
T_start (launch -> first step) and the tear-down T_end (last step -> supervisor_end). From the rate: K = E[min(
Binomial(n, p), count)] over the n candidate steps, l = the mean of (s mod every) over them (a kill before step
s + 1 loses the steps since the checkpoint at or before s). From the seeded plan (known before the run): its K and
lost steps. This is the closed form of :mod:`resilience.projection.goodput` to first order in the failure rate,
with two differences that the injector imposes: a planned fault fires once, at a *new* step, so failures strike
only during first-time compute (never during checkpoints, recoveries or replays: no e^{-lam R} factor), and the run
is finite (start-up, tear-down, an exact checkpoint count). :func:`predict_closed_form` is the unmodified closed
form (failures in wall time, M = t_w / p), for comparison.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from resilience.proc import child
from injectors.plan import fault_plan
from resilience.record.events import read_events
from resilience.record.query import fault_windows, first, productive_step_times, recovery_seconds, step_start
from resilience.projection.goodput import predicted_goodput

REPO = Path(__file__).resolve().parents[2]
AT_STEP = 1  # the first candidate step of the plan (fault.at_step)
FAULT_RANK = 1
LABEL = "measured vs model"


# ---------------------------------------------------------------------------------------------------------------
# The model (pure functions)

@dataclass(frozen=True)
class RunCosts:
    """The measured costs of one run that the prediction uses, all in seconds (see the module docstring)."""

    steps: int            # N: steps of the run
    every: int            # checkpoint.every
    step_s: float         # t_d: mean duration of a productive step (its sum over N steps is goodput's numerator)
    step_wall_s: float    # t_w: wall time per step (t_d plus the loop overhead between steps)
    stall_s: float        # C: training-visible time of one blocking checkpoint
    startup_s: float      # T_start: launch -> first step
    teardown_s: float     # T_end: last step -> supervisor_end
    recovery_s: float     # R: fault -> first step of the next attempt (detect + restart + load)


def checkpoints_in_run(steps: int, every: int) -> int:
    """Checkpoints a run writes: at every multiple of ``every`` below ``steps`` (the final state is not saved)."""
    return (steps - 1) // every


def predicted_wall_s(costs: RunCosts, faults: float, lost_steps: float) -> float:
    """Expected wall time with ``faults`` faults losing ``lost_steps`` steps in all (both may be fractional)."""
    c = costs
    return (c.startup_s + c.teardown_s + c.steps * c.step_wall_s + checkpoints_in_run(c.steps, c.every) * c.stall_s
            + faults * c.recovery_s + lost_steps * c.step_wall_s)


def predicted_run_goodput(costs: RunCosts, faults: float, lost_steps: float) -> float:
    """Goodput as metrics.py defines it (productive step time / wall time) for that many faults and lost steps."""
    return costs.steps * costs.step_s / predicted_wall_s(costs, faults, lost_steps)


def predicted_run_ettr(costs: RunCosts, faults: float, lost_steps: float) -> float:
    """ETTR as metrics.py defines it: the same productive time over the first step's start to the last step's end
    (the wall time without start-up and tear-down)."""
    window = predicted_wall_s(costs, faults, lost_steps) - costs.startup_s - costs.teardown_s
    return costs.steps * costs.step_s / window


def fault_candidates(steps: int, at_step: int = AT_STEP) -> range:
    """Steps at which a ``fault.probability`` plan may fire (``before_forward``: s steps done, s in [at, N))."""
    return range(at_step, steps)


def lost_steps_at(step: int, every: int) -> int:
    """Steps replayed after a kill before step ``step`` + 1: those since the checkpoint at or before ``step``."""
    return step % every


def binomial_pmf(n: int, p: float) -> np.ndarray:
    """P(K = k) for k = 0..n, K ~ Binomial(n, p)."""
    k = np.arange(n + 1)
    if p <= 0 or p >= 1:
        return (k == (0 if p <= 0 else n)).astype(float)
    log_comb = np.array([math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) for i in k])
    return np.exp(log_comb + k * math.log(p) + (n - k) * math.log1p(-p))


def binomial_quantile(n: int, p: float, q: float) -> int:
    """The smallest k with P(K <= k) >= q."""
    return int(np.searchsorted(np.cumsum(binomial_pmf(n, p)), q - 1e-12))


def expected_faults(probability: float, candidates: int, count: int) -> float:
    """E[min(Binomial(candidates, probability), count)]: each candidate fires with ``probability``, at most
    ``count`` in all."""
    if probability <= 0 or candidates <= 0:
        return 0.0
    k = np.arange(candidates + 1)
    return float(np.sum(np.minimum(k, count) * binomial_pmf(candidates, probability)))


@dataclass(frozen=True)
class RatePrediction:
    goodput: float     # at the expected fault count (expected useful time / expected wall time)
    low: float         # 10% quantile of the run's goodput over the fault count's distribution
    high: float        # 90% quantile
    faults: float      # expected fault count
    lost_per_fault: float
    faults_low: float = 0.0   # the fault count at the 10% quantile (it gives ``high``)
    faults_high: float = 0.0  # at the 90% quantile (it gives ``low``)


def predict_from_rate(costs: RunCosts, probability: float, count: int, at_step: int = AT_STEP,
                      band: tuple[float, float] = (0.1, 0.9)) -> RatePrediction:
    """Goodput predicted from the injected rate alone: the plan is random, so also a band from its fault count."""
    cands = fault_candidates(costs.steps, at_step)
    lost = float(np.mean([lost_steps_at(s, costs.every) for s in cands])) if len(cands) else 0.0
    k_mean = expected_faults(probability, len(cands), count)
    mean = predicted_run_goodput(costs, k_mean, k_mean * lost)
    if probability <= 0:
        return RatePrediction(mean, mean, mean, 0.0, lost)
    # More faults, lower goodput: the goodput quantiles are the fault count's quantiles in reverse.
    k_hi, k_lo = (min(binomial_quantile(len(cands), probability, q), count) for q in band)
    return RatePrediction(mean, predicted_run_goodput(costs, k_lo, k_lo * lost),
                          predicted_run_goodput(costs, k_hi, k_hi * lost), k_mean, lost, k_hi, k_lo)


def predict_from_plan(costs: RunCosts, plan: Sequence[int]) -> float:
    """Goodput predicted from the seeded plan itself (known before the run): its fault count and lost steps."""
    return predicted_run_goodput(costs, len(plan), sum(lost_steps_at(s, costs.every) for s in plan))


def predict_closed_form(costs: RunCosts, probability: float) -> float:
    """The projection's closed form as it stands: failures in wall time at rate p / t_w, also during checkpoints,
    recoveries and replays (``predicted_goodput``), applied to the training phase; start-up and tear-down added."""
    interval = costs.every * costs.step_wall_s
    if probability <= 0:
        g_train = interval / (interval + costs.stall_s)
    else:
        g_train = float(predicted_goodput(interval, costs.step_wall_s / probability, costs.stall_s, costs.stall_s,
                                          costs.recovery_s))
    train_wall = costs.steps * costs.step_wall_s / g_train
    return costs.steps * costs.step_s / (costs.startup_s + costs.teardown_s + train_wall)


# ---------------------------------------------------------------------------------------------------------------
# Measurement (from events.jsonl)

def measure(run_dir: str | Path) -> dict[str, Any]:
    """The costs, faults and goodput of one finished run, from its event log (rank 0 and the supervisor)."""
    run_dir = Path(run_dir)
    events = read_events(run_dir)
    result = json.loads((run_dir / "result.json").read_text())
    if result["status"] != "ok":
        raise RuntimeError(f"{run_dir}: status {result['status']}, expected ok")
    every, steps = int(result["checkpoint_every"]), int(result["steps"])
    launch = first([e for e in events if e["rank"] is None], "launch")
    end = first(events, "supervisor_end")
    step_ends = [e for e in events if e["rank"] == 0 and e["kind"] == "step_end"]
    recoveries, lost, faults = _fault_costs(events)
    final = [e for e in step_ends if e["attempt"] == result["attempts"] - 1]
    return {
        "run": run_dir.name, "every": every, "steps": steps, "seed": result["seed"],
        **_step_costs(step_ends, every),
        "stall_metric_s": result["ckpt_stall_s"] or 0.0,
        "startup_s": step_start(step_ends[0]) - launch["t_mono"],
        "teardown_s": end["t_mono"] - final[-1]["t_mono"],
        "recoveries_s": recoveries, "faults": faults, "lost_steps": lost,
        "wall_s": result["wall_time_s"], "measured_goodput": result["goodput"], "measured_ettr": result["ettr"],
    }


def _step_costs(step_ends: list[dict], every: int) -> dict[str, float]:
    """Productive step time (each step once, as in metrics' goodput), the wall time from one loop start to the
    next, and the checkpoint's cost as the loop sees it (the extra of a gap with a checkpoint; result.json's
    stall, from the events, stays beside it as ``stall_metric_s``)."""
    last = productive_step_times(step_ends)
    plain, ckpt_gaps = [], []  # loop-start to loop-start, without and with a checkpoint in between
    for a, b in zip(step_ends, step_ends[1:]):
        if a["attempt"] == b["attempt"] and b["step"] == a["step"] + 1:
            (ckpt_gaps if a["step"] % every == 0 else plain).append(step_start(b) - step_start(a))
    step_wall_s = float(np.mean(plain))
    return {"step_s": sum(last.values()) / len(last), "step_wall_s": step_wall_s,
            "stall_s": float(np.mean(ckpt_gaps)) - step_wall_s if ckpt_gaps else 0.0}


def _fault_costs(events: list[dict]) -> tuple[list[float], list[int], int]:
    """Per injected fault, from its recovery window: the recovery (the fault to the restarted rank's first loop
    start: detect, restart and load, the replay left to the lost steps) and the steps lost; and how many fired."""
    faults = fault_windows(events)
    lost = [window.lost_steps if window else fault["step"] for fault, window in faults]
    return recovery_seconds(faults), lost, len(faults)  # every recovery, interrupted or not


def costs_of(m: dict[str, Any], recovery_s: float) -> RunCosts:
    return RunCosts(steps=m["steps"], every=m["every"], step_s=m["step_s"], step_wall_s=m["step_wall_s"],
                    stall_s=m["stall_s"], startup_s=m["startup_s"], teardown_s=m["teardown_s"],
                    recovery_s=recovery_s)


# ---------------------------------------------------------------------------------------------------------------
# Running the set

@dataclass(frozen=True)
class RunSpec:
    every: int
    probability: float     # 0: fault=none
    seed: int
    steps: int

    @property
    def name(self) -> str:
        return f"every{self.every}_p{self.probability:g}_seed{self.seed}_n{self.steps}"

    @property
    def count(self) -> int:
        return self.steps  # generous: never the binding limit

    def overrides(self) -> list[str]:
        common = ["workload=gpt_tiny", "strategy=sync", "world_size=2", f"steps={self.steps}",
                  f"checkpoint.every={self.every}", f"seed={self.seed}", f"recovery.max_restarts={self.steps}",
                  f"log_every={self.steps}"]
        if self.probability <= 0:
            return [*common, "fault=none"]
        return [*common, "fault=kill", f"fault.rank={FAULT_RANK}", f"fault.at_step={AT_STEP}",
                f"fault.probability={self.probability}", f"fault.count={self.count}", f"fault.seed={self.seed}"]

    def plan(self) -> list[int]:
        """The steps the seeded plan kills at: the injector's own plan function, before the run."""
        if self.probability <= 0:
            return []
        return fault_plan("kill", self.seed, AT_STEP, self.steps, self.probability, self.count)



def run_one(spec: RunSpec, run_dir: Path, timeout_s: float = 240) -> None:
    """``python -m resilience`` for one spec in its own process group (``resilience.proc.child``)."""
    if run_dir.exists():
        shutil.rmtree(run_dir)  # the checkpoint directory must start empty
    done = child.run(child.experiment_command(spec.overrides(), run_dir), timeout_s=timeout_s, cwd=REPO)
    if done.timed_out:
        raise RuntimeError(f"{spec.name}: ran over {timeout_s} s")
    if done.returncode != 0:
        raise RuntimeError(f"{spec.name}: exit {done.returncode}: {done.stderr[-800:]}")
