"""What quantized checkpoints cost in accuracy, and what each strategy writes per checkpoint (Check-N-Run, NSDI'22).

    python -m resilience.bench.convergence_gap [--seeds 0,1,2] [--restores 1,3,10] [--steps 60] [--every 5]
        [--bits 8] [--base-every 4] [--sizes sync,async,incremental,quantized] [--out results/convergence_gap]
        [OVERRIDE ...]

1. The convergence gap of ``strategy=quantized``: for each seed, its fault-free run (no restore: it ends on the
   fault-free state bit for bit) and, for each R of ``--restores``, a run whose rank 1 is killed R times, at steps
   spread over the run, each a few steps after a checkpoint, so that every restart restores a quantized checkpoint
   and trains on from the approximation. The gap is the run's final loss minus the fault-free run's (the same
   batch: a function of seed and step); per R: mean, standard deviation, min and max over the seeds.
2. Bytes per checkpoint, on the same training, of each strategy of ``--sizes`` (one fault-free run each, the first
   seed): the mean over the run's checkpoints (``ckpt_durable.bytes``, rank 0), a chain's bases and increments
   apart, and the ratio of each mean to sync's.

The default training is ``workload=dlrm_emb`` at its full size (1.1 GB of tables and Adagrad state; ~20-40 min on an
idle 2-core host, most of it the restarts); OVERRIDEs apply to every run (``workload.rows=2000`` for a quick look).
Each run's checkpoints are removed when it ends. Writes ``<out>/convergence_gap.md`` and ``<out>/convergence_gap.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from resilience.bench.experiment import run_afresh, write_table
from resilience.record.events import read_events

TRAINING = ["workload=dlrm_emb", "world_size=2", "detector=[process_exit]", "reference.check=none",
            "checkpoint.keep_after_run=false"]
STRATEGY_SETTINGS = {"incremental": ("base_every",), "quantized": ("base_every", "bits")}


def kill_steps(restores: int, steps: int, every: int) -> list[int]:
    """``restores`` kill steps spread over the run, each ``max(1, every // 2)`` steps after a distinct checkpoint
    (so that its restart restores that checkpoint); ValueError where the run has too few checkpoints."""
    after = max(1, every // 2)
    checkpoints = [c for c in range(every, steps, every) if c + after < steps]
    if restores < 1 or restores > len(checkpoints):
        raise ValueError(f"--restores {restores}: the run has {len(checkpoints)} checkpoints with a step after them "
                         f"(--steps {steps}, --every {every}); raise --steps or lower --every")
    if restores == 1:
        picked = [checkpoints[len(checkpoints) // 2]]
    else:
        picked = [checkpoints[round(i * (len(checkpoints) - 1) / (restores - 1))] for i in range(restores)]
    return [c + after for c in picked]


def strategy_overrides(strategy: str, args: argparse.Namespace) -> list[str]:
    keys = STRATEGY_SETTINGS.get(strategy, ())
    return [f"strategy={strategy}", *(f"strategy.{k}={getattr(args, k)}" for k in keys)]


def run(run_dir: Path, overrides: list[str], timeout_s: float) -> dict[str, Any] | None:
    """One run; its result (None where it failed, said on the console)."""
    result, code = run_afresh(run_dir, overrides, timeout_s=timeout_s)
    shutil.rmtree(run_dir / "ckpt", ignore_errors=True)
    if code != 0 or result is None or result.get("status") != "ok":
        status = (result or {}).get("status")
        print(f"  FAILED: {run_dir} (exit {code}, status {status})", flush=True)
        return None
    return result


def restores_of(run_dir: Path) -> int:
    """How many loads of the run restored quantized rows (rank 0's ``ckpt_loaded_inexact``)."""
    return sum(1 for e in read_events(run_dir) if e["kind"] == "ckpt_loaded_inexact" and e["rank"] == 0)


def checkpoint_bytes(run_dir: Path) -> dict[str, Any]:
    """Bytes per checkpoint of a run (rank 0's ``ckpt_durable``): mean over all, and over each kind of link."""
    durable = [e for e in read_events(run_dir) if e["kind"] == "ckpt_durable" and e["rank"] == 0]
    out: dict[str, Any] = {"count": len(durable), "mean": statistics.fmean(e["bytes"] for e in durable)
                           if durable else None}
    for link in ("base", "increment"):
        sizes = [e["bytes"] for e in durable if e.get("link") == link]
        out[link] = statistics.fmean(sizes) if sizes else None
        out[f"{link}s"] = len(sizes)
    return out


def spread(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0, "mean": None, "stdev": None, "min": None, "max": None}
    return {"n": len(values), "mean": statistics.fmean(values),
            "stdev": statistics.stdev(values) if len(values) > 1 else 0.0, "min": min(values), "max": max(values)}


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def gap_table(gaps: dict[int, dict[str, Any]], bits: int) -> str:
    lines = ["| restores | seeds | final-loss gap, mean | stdev | min | max |", "|---|---|---|---|---|---|"]
    for r, s in gaps.items():
        lines.append(f"| {r} | {s['n']} | {_f(s['mean'], '+.5f')} | {_f(s['stdev'], '.5f')} | "
                     f"{_f(s['min'], '+.5f')} | {_f(s['max'], '+.5f')} |")
    return f"strategy=quantized (bits={bits}): final loss after R restores minus the fault-free run's\n\n" + \
        "\n".join(lines)


def size_table(sizes: dict[str, dict[str, Any]]) -> str:
    sync = (sizes.get("sync") or {}).get("mean")
    lines = ["| strategy | checkpoints | bytes per checkpoint (mean) | base | increment | sync's / this |",
             "|---|---|---|---|---|---|"]
    for name, s in sizes.items():
        ratio = f"{sync / s['mean']:.2f}x" if sync and s.get("mean") else "-"
        lines.append(f"| {name} | {s.get('count', '-')} | {_f(s.get('mean'), ',.0f')} | "
                     f"{_f(s.get('base'), ',.0f')} ({s.get('bases', 0)}) | "
                     f"{_f(s.get('increment'), ',.0f')} ({s.get('increments', 0)}) | {ratio} |")
    return "Bytes per checkpoint, fault-free, the first seed\n\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m resilience.bench.convergence_gap",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2; at least 3 for a spread)")
    ap.add_argument("--restores", default="1,3,10",
                    help="comma-separated numbers of restores (default 1,3,10; '' for the bytes alone)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=5, help="checkpoint.every (default 5)")
    ap.add_argument("--bits", type=int, default=8, choices=(8, 16))
    ap.add_argument("--base-every", dest="base_every", type=int, default=4)
    ap.add_argument("--sizes", default="sync,async,incremental,quantized",
                    help="strategies whose bytes per checkpoint are compared ('' for none)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    ap.add_argument("--out", type=Path, default=Path("results/convergence_gap"))
    ap.add_argument("overrides", nargs="*", help="settings for every run (Hydra overrides)")
    args = ap.parse_args(argv)
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
        restores = [int(r) for r in args.restores.split(",") if r]  # '': the sizes alone
        plans = {r: kill_steps(r, args.steps, args.every) for r in restores}
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    started = time.monotonic()
    common = [*TRAINING, f"steps={args.steps}", f"checkpoint.every={args.every}", *args.overrides]
    quantized = strategy_overrides("quantized", args)
    final: dict[int, dict[int, float]] = {r: {} for r in restores}
    for seed in seeds if restores else []:
        print(f"seed {seed}: fault-free", flush=True)
        free = run(args.out / f"seed{seed}-free", [*common, *quantized, f"seed={seed}", "fault=none"], args.timeout)
        if free is None:
            continue
        for r, at in plans.items():
            print(f"seed {seed}: {r} restore(s), kills before steps {at}", flush=True)
            hit = run(args.out / f"seed{seed}-restores{r}",
                      [*common, *quantized, f"seed={seed}", "fault=kill", "fault.rank=1",
                       f"fault.at_step=[{','.join(map(str, at))}]", "fault.phase=before_forward",
                       f"recovery.max_restarts={r}"], args.timeout)
            if hit is None:
                continue
            restored = restores_of(args.out / f"seed{seed}-restores{r}")
            if hit.get("recoveries") != r or restored != r:
                print(f"  {hit.get('recoveries')} of {r} faults recovered, {restored} quantized restores: left out",
                      flush=True)
                continue
            final[r][seed] = hit["final_loss"] - free["final_loss"]
    gaps = {r: spread(list(final[r].values())) for r in restores}

    sizes: dict[str, dict[str, Any]] = {}
    for name in [s for s in args.sizes.split(",") if s]:
        print(f"bytes per checkpoint: {name}", flush=True)
        run_dir = args.out / f"size-{name}"
        if run(run_dir, [*common, *strategy_overrides(name, args), f"seed={seeds[0]}", "fault=none"],
               args.timeout) is not None:
            sizes[name] = checkpoint_bytes(run_dir)

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "convergence_gap.json").write_text(json.dumps(
        {"settings": {**vars(args), "out": str(args.out)}, "kills": plans, "gaps": gaps,
         "final_loss_gaps": final, "sizes": sizes}, indent=2, default=str))
    parts = [gap_table(gaps, args.bits)] if restores else []
    write_table(args.out / "convergence_gap.md", "\n\n".join([*parts, size_table(sizes)]) + "\n\n"
                f"settings: {' '.join(common)}; base_every={args.base_every}, bits={args.bits}", started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
