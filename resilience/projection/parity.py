"""Out-of-sample validation: costs fitted on one set of measured runs predict the goodput and ETTR of other runs.

``python -m resilience.projection.parity [--out DIR] [--quick] [--reuse]`` runs two disjoint sets of real
experiments (gpt_tiny, 2 ranks, ``strategy=sync``, ``fault=kill`` with ``fault.probability=p``: kills at a known
rate, planned from ``fault.seed`` before the run):

* the **fit** set, at checkpoint intervals 2 and 10 and fault rates 0, 0.05 and 0.1: each run's costs are measured
  from its ``events.jsonl`` (:func:`resilience.projection.run_model.measure`) and pooled into one :class:`Fitted`
  cost model (step time, loop overhead, checkpoint stall, start-up, tear-down, recovery);
* the **held-out** set, at other intervals (3, 5, 20) and other rates (0.03, 0.08): from each run only the outcome
  is read (goodput and ETTR from ``result.json``, the faults that fired); its goodput and ETTR are predicted from
  the fitted costs with the run's interval, length and fault rate, and the error is reported on these runs only.

Two predictions per held-out run: from its **fault schedule** (the seeded plan, known before the run: its fault
count and lost steps) and from the **rate** alone (the expected count, with the 10-90% band of the Binomial count).
The first tests the cost model; the second adds the randomness of a handful of faults (docs/projection.md,
"Out-of-sample validation"). :func:`score` refuses a held-out run that was also fitted.
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from dataclasses import asdict, dataclass
from itertools import zip_longest
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from resilience.projection.run_model import (REPO, RunCosts, RunSpec, lost_steps_at, measure, predict_from_rate,
                                          predicted_run_ettr, predicted_run_goodput, run_one)
from resilience.record.fsio import atomic_write_bytes

LABEL = "held-out runs: measured vs model"

# Seeds were fixed before any run (never chosen by outcome): a plan with fewer or more faults than expected is
# part of the sample. The fit set must hold faults (R is fitted from them); 11 and 13 plan 1 and 9 at 80 steps.
FIT_FULL = [RunSpec(2, 0.0, 10, 80), RunSpec(2, 0.05, 11, 80), RunSpec(10, 0.0, 12, 80), RunSpec(10, 0.1, 13, 80)]
HELD_OUT_FULL = [RunSpec(5, 0.03, 20, 80), RunSpec(5, 0.08, 21, 80), RunSpec(20, 0.03, 22, 80),
                 RunSpec(3, 0.08, 23, 80)]
FIT_QUICK = [RunSpec(2, 0.05, 11, 40), RunSpec(10, 0.1, 13, 40)]
HELD_OUT_QUICK = [RunSpec(5, 0.03, 20, 40), RunSpec(5, 0.08, 21, 40), RunSpec(20, 0.08, 23, 40)]

#: What is read from a held-out run: its outcome, never a cost.
OUTCOME_KEYS = ("run", "faults", "lost_steps", "measured_goodput", "measured_ettr")


@dataclass(frozen=True)
class Fitted:
    """Costs pooled over the fit runs, in units of each run's own step wall time t_w (``*_steps``), and which runs
    they came from. Goodput and ETTR are ratios of times, so a prediction from costs in step units does not move
    when the whole machine runs slower or faster: on a shared machine the step time of one run differs from
    another's by up to 3x (docs/projection.md, "Out-of-sample validation")."""

    runs: tuple[str, ...]
    step_ratio: float       # t_d / t_w: the step's own duration over its loop's wall time
    stall_steps: float      # C / t_w
    startup_steps: float    # T_start / t_w
    teardown_steps: float   # T_end / t_w
    recovery_steps: float   # R / t_w, over every recovery of every fit run
    recoveries: int
    step_wall_s: float      # mean t_w of the fit runs (seconds: for the reader; no prediction uses it)

    def costs(self, spec: RunSpec) -> RunCosts:
        """The cost model applied to a run of ``spec``'s length and checkpoint interval (time unit: one step)."""
        return RunCosts(steps=spec.steps, every=spec.every, step_s=self.step_ratio, step_wall_s=1.0,
                        stall_s=self.stall_steps, startup_s=self.startup_steps, teardown_s=self.teardown_steps,
                        recovery_s=self.recovery_steps)


def fit(measured: Sequence[dict[str, Any]]) -> Fitted:
    """Pool the fit runs' costs in step units: means over runs, R over every recovery of every run."""
    if not measured:
        raise ValueError("fit set: no runs")
    recoveries = [r / m["step_wall_s"] for m in measured for r in m["recoveries_s"]]
    if not recoveries:
        raise ValueError("fit set: no run had a fault, so the recovery cost R cannot be fitted")
    with_ckpt = [m["stall_s"] / m["step_wall_s"] for m in measured if m["every"] < m["steps"]]

    def steps(key: str) -> float:
        return float(np.mean([m[key] / m["step_wall_s"] for m in measured]))

    return Fitted(tuple(m["run"] for m in measured), steps("step_s"), float(np.mean(with_ckpt)) if with_ckpt else 0.0,
                  steps("startup_s"), steps("teardown_s"), float(np.mean(recoveries)), len(recoveries),
                  float(np.mean([m["step_wall_s"] for m in measured])))


def outcome(m: dict[str, Any]) -> dict[str, Any]:
    """The part of a held-out run's measurement that is scored (its costs stay unread)."""
    return {k: m[k] for k in OUTCOME_KEYS}


def check_disjoint(fitted: Fitted, held_out: Sequence[RunSpec]) -> None:
    """A run is either fitted or scored, never both."""
    both = sorted(set(fitted.runs) & {s.name for s in held_out})
    if both:
        raise ValueError(f"held-out runs also in the fit set: {', '.join(both)}")


def score(fitted: Fitted, held_out: Sequence[RunSpec], outcomes: Sequence[dict[str, Any]]) -> pd.DataFrame:
    """One row per held-out run: measured goodput and ETTR, predicted from the plan and from the rate."""
    check_disjoint(fitted, held_out)
    rows = []
    for spec, o in zip(held_out, outcomes, strict=True):
        if o["run"] != spec.name:
            raise ValueError(f"outcome of {o['run']} given for {spec.name}")
        costs, plan = fitted.costs(spec), spec.plan()
        lost = sum(lost_steps_at(s, spec.every) for s in plan)
        rate = predict_from_rate(costs, spec.probability, spec.count)
        lo_k, hi_k = rate.faults_low, rate.faults_high
        rows.append({
            "label": LABEL, "run": spec.name, "every": spec.every, "probability": spec.probability,
            "seed": spec.seed, "steps": spec.steps, "expected_faults": rate.faults, "planned_faults": len(plan),
            "faults": o["faults"], "planned_lost_steps": lost, "lost_steps": sum(o["lost_steps"]),
            "measured_goodput": o["measured_goodput"], "measured_ettr": o["measured_ettr"],
            "goodput_plan": predicted_run_goodput(costs, len(plan), lost),
            "ettr_plan": predicted_run_ettr(costs, len(plan), lost),
            "goodput_rate": rate.goodput, "goodput_rate_low": rate.low, "goodput_rate_high": rate.high,
            "ettr_rate": predicted_run_ettr(costs, rate.faults, rate.faults * rate.lost_per_fault),
            "ettr_rate_low": predicted_run_ettr(costs, hi_k, hi_k * rate.lost_per_fault),
            "ettr_rate_high": predicted_run_ettr(costs, lo_k, lo_k * rate.lost_per_fault),
        })
    frame = pd.DataFrame(rows)
    for what in ("goodput", "ettr"):
        for how in ("plan", "rate"):
            frame[f"{what}_{how}_rel_error"] = frame[f"{what}_{how}"] / frame[f"measured_{what}"] - 1
    return frame


def mare(frame: pd.DataFrame, column: str) -> float:
    """Mean absolute relative error of a ``*_rel_error`` column."""
    return float(frame[column].abs().mean())


def parity_figure(frame: pd.DataFrame, fitted: Fitted):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 6))
    for ax, what, name in zip(axes, ("goodput", "ettr"), ("goodput", "ETTR")):
        measured = frame[f"measured_{what}"]
        cols = [f"{what}_plan", f"{what}_rate_low", f"{what}_rate_high", f"measured_{what}"]
        lo, hi = float(frame[cols].min().min()) - 0.03, float(frame[cols].max().max()) + 0.03
        ax.plot([lo, hi], [lo, hi], color="black", lw=1, label="y = x")
        ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="grey", alpha=0.15,
                        label="within 10%")
        ax.errorbar(frame[f"{what}_rate"], measured,
                    xerr=[frame[f"{what}_rate"] - frame[f"{what}_rate_low"],
                          frame[f"{what}_rate_high"] - frame[f"{what}_rate"]],
                    fmt="^", mfc="none", color="tab:orange", capsize=3, ms=8,
                    label=f"from the rate (10-90% band): MARE {mare(frame, f'{what}_rate_rel_error'):.1%}")
        ax.scatter(frame[f"{what}_plan"], measured, color="tab:blue", s=50, zorder=5,
                   label=f"from the fault schedule: MARE {mare(frame, f'{what}_plan_rel_error'):.1%}")
        for row in frame.itertuples():
            ax.annotate(f"every {row.every}, p {row.probability:g}", (getattr(row, f"{what}_plan"),
                        getattr(row, f"measured_{what}")), fontsize=7, xytext=(4, -10), textcoords="offset points")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_aspect("equal")
        ax.set_xlabel(f"predicted {name} (costs fitted on the other runs)")
        ax.set_ylabel(f"measured {name} (result.json)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"model validation on held-out runs only: gpt_tiny, 2 ranks, sync, kills at rate p\n"
                 f"{len(frame)} held-out runs; costs fitted on {len(fitted.runs)} other runs "
                 f"({', '.join(fitted.runs)})", fontsize=9)
    fig.tight_layout()
    return fig


def write_outputs(frame: pd.DataFrame, fitted: Fitted, out: Path) -> None:
    """``parity.csv`` (held-out rows), ``parity_fit.csv`` (the fitted costs) and ``parity.png`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out / "parity.csv", frame.to_csv(index=False, float_format="%.6g").encode())
    fit_row = {**asdict(fitted), "runs": " ".join(fitted.runs), "label": "fitted costs"}
    atomic_write_bytes(out / "parity_fit.csv", pd.DataFrame([fit_row]).to_csv(index=False).encode())
    buf = io.BytesIO()
    parity_figure(frame, fitted).savefig(buf, format="png", dpi=130)
    atomic_write_bytes(out / "parity.png", buf.getvalue())


def table(frame: pd.DataFrame) -> str:
    cols = {"run": "held-out run", "expected_faults": "E[K]", "faults": "K", "lost_steps": "lost",
            "measured_goodput": "goodput", "goodput_plan": "plan", "goodput_rate": "rate",
            "goodput_rate_low": "lo", "goodput_rate_high": "hi", "measured_ettr": "ETTR", "ettr_plan": "plan",
            "ettr_rate": "rate"}
    return frame[list(cols)].rename(columns=cols).to_string(index=False, float_format=lambda v: f"{v:.3f}")


def _measure_all(specs: Sequence[RunSpec], runs: Path, reuse: bool, timeout_s: float) -> list[dict]:
    measured = []
    for i, spec in enumerate(specs, 1):
        t = time.monotonic()
        if not (reuse and (runs / spec.name / "result.json").exists()):
            run_one(spec, runs / spec.name, timeout_s)
        measured.append(measure(runs / spec.name))
        print(f"[parity] {i}/{len(specs)} {spec.name}: {measured[-1]['faults']} fault(s), goodput "
              f"{measured[-1]['measured_goodput']:.3f} ({time.monotonic() - t:.0f} s)", flush=True)
    return measured


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m resilience.projection.parity",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "results" / "parity", help="output directory")
    parser.add_argument("--quick", action="store_true",
                        help=f"{len(FIT_QUICK)} + {len(HELD_OUT_QUICK)} short runs instead of "
                             f"{len(FIT_FULL)} + {len(HELD_OUT_FULL)}")
    parser.add_argument("--timeout-s", type=float, default=600,
                        help="limit per run (one with 10 restarts took over 240 s on 2 cores at load 40)")
    parser.add_argument("--reuse", action="store_true",
                        help="re-score run directories that already hold a result.json instead of rerunning them")
    args = parser.parse_args(argv)
    fit_specs, held = (FIT_QUICK, HELD_OUT_QUICK) if args.quick else (FIT_FULL, HELD_OUT_FULL)
    out, t0 = args.out.resolve(), time.monotonic()
    # Fit and held-out runs alternate, so that a change of the machine's load meets both sets alike.
    order = [s for pair in zip_longest(fit_specs, held) for s in pair if s is not None]
    measured = dict(zip((s.name for s in order), _measure_all(order, out / "runs", args.reuse, args.timeout_s)))
    fitted = fit([measured[s.name] for s in fit_specs])
    check_disjoint(fitted, held)
    outcomes = [outcome(measured[s.name]) for s in held]
    frame = score(fitted, held, outcomes)
    write_outputs(frame, fitted, out)
    print(f"fitted on {', '.join(fitted.runs)} (in steps of t_w, mean {fitted.step_wall_s:.3f} s): "
          f"t_d {fitted.step_ratio:.3f}, C {fitted.stall_steps:.2f}, T_start {fitted.startup_steps:.1f}, "
          f"T_end {fitted.teardown_steps:.1f}, R {fitted.recovery_steps:.1f} (mean of {fitted.recoveries})")
    print(table(frame))
    for what in ("goodput", "ettr"):
        print(f"{what}: MARE on {len(frame)} held-out runs, from the fault schedule "
              f"{mare(frame, f'{what}_plan_rel_error'):.1%} (worst {frame[f'{what}_plan_rel_error'].abs().max():.1%})"
              f", from the rate {mare(frame, f'{what}_rate_rel_error'):.1%} "
              f"(worst {frame[f'{what}_rate_rel_error'].abs().max():.1%})")
    inside = ((frame["measured_goodput"] >= frame["goodput_rate_low"])
              & (frame["measured_goodput"] <= frame["goodput_rate_high"]))
    print(f"measured goodput inside the rate prediction's 10-90% band: {int(inside.sum())} of {len(frame)}")
    print(f"{len(fit_specs) + len(held)} runs in {time.monotonic() - t0:.0f} s; wrote {out / 'parity.csv'}, "
          f"{out / 'parity_fit.csv'} and {out / 'parity.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
