"""``python -m resilience.bench.jit_overhead``: what just-in-time checkpointing costs while nothing fails, against
``strategy=none`` (no checkpoint at all): fault-free runs of each, alternated run by run so that the host's moments
fall on both.

    python -m resilience.bench.jit_overhead [--repeats 7] [--steps 60] [--out results/jit_overhead] [OVERRIDE ...]

Per run: the median step time (``result.json``'s ``step_time_s``: rank 0's loop iterations) and the training time
(rank 0's first step's start to its last step's end). Then, per figure, each strategy's median with its interval
(``reports.stats``: the exact 95% interval of a median from 6 runs; below that the runs' range at its own level) and
the ratio jit / none with its interval (95% from 7 runs a side, else at the level it reaches, stated), and the
verdict: "no measurable difference" where the two medians' 95% intervals overlap. Gupta et al. (EuroSys'24) claim a
"nearly zero" steady-state cost; here the only per-step work is each rank keeping its own RNG streams and data
position in shared memory, which only a loop with such parts does: add ``train=real`` as an override to measure
that. Run on an idle machine: every run says whether its host was quiet
(``validity``); a busy host's runs are printed, and counted.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from reports.stats import MIN_N_RATIO, difference, interval_text, level_text, median_interval, ratio_estimate
from resilience.bench.experiment import run_afresh
from resilience.record.events import read_events
from resilience.record.query import step_start

PAIR = ("none", "jit")  # the baseline first
FIGURES = {"step_s": "median step time", "train_s": "training time"}


def measure(run_dir: Path, strategy: str, steps: int, extra: list[str]) -> dict:
    overrides = [f"strategy={strategy}", "fault=none", f"steps={steps}", "reference.check=none", *extra]
    r, code = run_afresh(run_dir, overrides, timeout_s=1800)
    if code != 0 or r is None or r.get("status") != "ok":
        raise SystemExit(f"error: the {strategy} run failed (exit {code}); see {run_dir}")
    events = read_events(run_dir)
    ends = [e for e in events if e["kind"] == "step_end" and e["rank"] == 0]
    train_s = max(e["t_mono"] for e in ends) - min(step_start(e) for e in ends)
    # jit's own record of its one steady-state cost (rank 0; only a loop with per-rank parts has any)
    kept_s = sum(e["duration_s"] for e in events if e["kind"] == "jit_parts_kept" and e["rank"] == 0)
    shutil.rmtree(run_dir / "ckpt", ignore_errors=True)
    return {"step_s": r["step_time_s"], "train_s": train_s, "kept_s": kept_s / len(ends),
            "validity": r["validity"]["verdict"]}


def summary(runs: dict[str, list[dict]]) -> list[str]:
    """Per figure: each strategy's median and interval, the ratio jit / none and its interval, the verdict."""
    lines = []
    for key, label in FIGURES.items():
        base, jit = ([m[key] for m in runs[s]] for s in PAIR)
        mb, mj = median_interval(base), median_interval(jit)
        said = [f"{s} {m.median:.4f} s {interval_text(m.n, m.low, m.high, m.exact, m.level)}"
                for s, m in zip(PAIR, (mb, mj))]
        ratio = mj.median / mb.median
        est = ratio_estimate(jit, base)
        bounds = (f"[{est.low:.3f}, {est.high:.3f}] at {level_text(est.level)}" if est is not None
                  else "no interval at this n")
        lines.append(f"{label}: {'; '.join(said)}; ratio jit/none {ratio:.3f} {bounds}: {difference(mj, mb)}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m resilience.bench.jit_overhead", description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=MIN_N_RATIO,
                    help=f"runs of each (default {MIN_N_RATIO}: the fewest whose ratio has a 95%% interval; 6 "
                         f"give each median one)")
    ap.add_argument("--steps", type=int, default=60, help="steps per run (default 60)")
    ap.add_argument("--out", type=Path, default=Path("results/jit_overhead"))
    ap.add_argument("overrides", nargs="*", help="settings for every run (Hydra overrides, e.g. train=real)")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.steps < 2:
        print(f"error: --repeats={args.repeats} --steps={args.steps}: need at least 1 run and 2 steps", file=sys.stderr)
        return 2
    runs: dict[str, list[dict]] = {s: [] for s in PAIR}
    for i in range(args.repeats):
        for strategy in PAIR if i % 2 == 0 else PAIR[::-1]:
            m = measure(args.out / f"{strategy}_{i}", strategy, args.steps, args.overrides)
            runs[strategy].append(m)
            kept = f", own parts kept {m['kept_s'] * 1e3:.3f} ms a step" if strategy == "jit" else ""
            print(f"{strategy:5s} run {i + 1}: step {m['step_s'] * 1e3:8.2f} ms, training {m['train_s']:8.3f} s{kept} "
                  f"({m['validity']})", flush=True)
    busy = sum(m["validity"] != "valid" for ms in runs.values() for m in ms)
    for line in summary(runs):
        print(line)
    if busy:
        print(f"{busy} of {2 * args.repeats} runs measured on a busy host (validity): rerun on an idle machine")
    return 0


if __name__ == "__main__":
    sys.exit(main())
