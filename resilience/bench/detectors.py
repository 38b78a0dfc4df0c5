"""``python -m resilience.bench.detectors``: the detection targets, measured side by side on this machine.

* process exit detected within 1 s, a hang within ``timeouts.heartbeat_s`` + 1 s, each with the right rank;
* ``replica_fingerprint`` at its default ``every`` costs <= 2% of the step on every workload (``gpt_tiny``,
  ``gpt_small``, ``dlrm_emb``): runs with and without it, alternated, and the median *step period* of rank 0 (the time
  between consecutive ``step_end`` events, which includes the detector's check after the step; a step's own
  ``duration_s`` ends before it) compared, beside the coverage each run stated (``fingerprint_coverage``);
* the same ratio measured in one process as CPU time (``time.thread_time``, one torch thread): a step of the
  workload against the detector's own work for it (the touched rows in ``on_backward``, the fingerprint after the
  step; not the all-gather of two integers), which a busy host does not blur as it blurs wall time;
* zero false alarms over fault-free runs of the default detector set.

``--only fingerprint`` runs the fingerprint rows alone, ``--only fingerprint-cpu`` the in-process ones (about 10 min on 2 busy cores with the defaults).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from resilience.bench.experiment import run_experiment
from resilience.record.events import EventLog, read_events
from resilience.runtime.rank import RankRuntime
from resilience.state.train import TrainState

CONF = Path(__file__).resolve().parents[2] / "conf"

BASE = ["workload=gpt_tiny", "world_size=2", "checkpoint.every=10"]
DEFAULT = "process_exit,heartbeat,collective_timeout,nonfinite,straggler,gpu_health,ckpt_integrity"
# Steps per fingerprint run: enough periods for a stable median at each workload's step time.
FP_STEPS = {"gpt_tiny": 100, "gpt_small": 40, "dlrm_emb": 60}


def step_period_s(run_dir: Path) -> float:
    """Median time between rank 0's consecutive ``step_end`` events (the first few, warm-up, left out)."""
    t = [e["t_mono"] for e in read_events(run_dir) if e["kind"] == "step_end" and e["rank"] == 0]
    return statistics.median(b - a for a, b in zip(t[3:], t[4:]))


def coverage(run_dir: Path) -> dict | None:
    return next((e for e in read_events(run_dir) if e["kind"] == "fingerprint_coverage"), None)


def cpu_cost(workload: str, steps: int = 12) -> dict:
    """CPU seconds of a step and of the fingerprint's work for it, in this process (medians after 2 warm-up steps)."""
    torch.set_num_threads(1)
    wl = instantiate(OmegaConf.load(CONF / "workload" / f"{workload}.yaml"), seed=0)
    model = wl.build_model()
    state = TrainState(model, wl.build_optimizer(model))
    det = instantiate(OmegaConf.load(CONF / "detector" / "replica_fingerprint.yaml"))
    with tempfile.TemporaryDirectory() as tmp:
        det.attach(RankRuntime(rank=1, world_size=2, device=torch.device("cpu"), run_dir=Path(tmp),
                               ckpt_dir=Path(tmp), events=EventLog(Path(tmp), 1, 0)), state)
    step_s, check_s = [], []
    for step in range(steps):
        c0 = time.thread_time()
        wl.loss(model, wl.batch(step, 0, torch.device("cpu"))).backward()
        c1 = time.thread_time()
        det.on_backward(step, 0.0, None)
        c2 = time.thread_time()
        state.optimizer.step()
        state.optimizer.zero_grad(set_to_none=True)
        c3 = time.thread_time()
        det.fingerprint(step + 1)
        c4 = time.thread_time()
        step_s.append((c1 - c0) + (c3 - c2))
        check_s.append((c2 - c1) + (c4 - c3))
    return {"step_s": statistics.median(step_s[2:]), "check_s": statistics.median(check_s[2:]),
            "coverage_checks": det.coverage_checks(), "slice_bytes": det.slice_bytes, "every": det.every}


def cpu_rows(workloads: list[str]) -> None:
    print(f"\nreplica_fingerprint in one process, CPU time (one torch thread), median of 10 steps; load "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    print(f"{'workload':10s} {'step ms':>8s} {'check ms':>8s} {'overhead':>9s} {'goal':>6s} {'every':>5s} "
          f"{'slice MB':>8s} {'coverage: checks':>16s} {'steps':>6s}")
    for workload in workloads:
        c = cpu_cost(workload)
        over = 100 * c["check_s"] / c["step_s"] / c["every"]
        print(f"{workload:10s} {c['step_s'] * 1e3:8.2f} {c['check_s'] * 1e3:8.3f} {over:+8.2f}% "
              f"{'MET' if over <= 2 else 'MISSED':>6s} {c['every']:>5} {c['slice_bytes'] / 1e6:8.1f} "
              f"{c['coverage_checks']:>16} {c['coverage_checks'] * c['every']:>6}", flush=True)


def fingerprint_rows(root: Path, workloads: list[str], pairs: int) -> None:
    """The fingerprint's overhead per workload: alternated pairs of runs, printed side by side."""
    rows = []
    for workload in workloads:
        periods: dict[str, list[float]] = {"without": [], "with": []}
        cov = None
        for i in range(pairs):
            for label, dets in (("without", "process_exit"), ("with", "process_exit,replica_fingerprint")):
                run_dir = root / f"fp_{workload}_{label}_{i}"
                run_experiment(run_dir, [f"workload={workload}", "world_size=2", "strategy=none", "seed=0",
                                         f"steps={FP_STEPS[workload]}", f"detector=[{dets}]"])
                periods[label].append(step_period_s(run_dir))
                cov = coverage(run_dir) or cov
        a, b = statistics.median(periods["without"]), statistics.median(periods["with"])
        rows.append((workload, a, b, cov))
        print(f"  {workload}: {b * 1e3:.1f} ms with, {a * 1e3:.1f} ms without (load {os.getloadavg()[0]:.2f})",
              flush=True)
    print(f"\nreplica_fingerprint at its default every, {pairs} alternated pair(s) per workload, median step period "
          f"of rank 0; load now {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    print(f"{'workload':10s} {'without ms':>10s} {'with ms':>8s} {'overhead':>9s} {'goal':>5s} {'every':>5s} "
          f"{'slice MB':>8s} {'coverage: checks':>16s} {'steps':>6s}")
    for workload, a, b, cov in rows:
        over = 100 * (b - a) / a
        c = cov or {}
        print(f"{workload:10s} {a * 1e3:10.1f} {b * 1e3:8.1f} {over:+8.2f}% {'MET' if over <= 2 else 'MISSED':>5s} "
              f"{c.get('every', '-'):>5} {c.get('slice_bytes', 0) / 1e6:8.1f} {c.get('coverage_checks', '-'):>16} "
              f"{c.get('coverage_steps', '-'):>6}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/bench_detectors")
    ap.add_argument("--pairs", type=int, default=3, help="with/without-fingerprint run pairs per workload")
    ap.add_argument("--workloads", nargs="+", default=list(FP_STEPS), choices=list(FP_STEPS))
    ap.add_argument("--clean-runs", type=int, default=10, help="fault-free runs for the false-alarm count")
    ap.add_argument("--only", choices=["fingerprint", "fingerprint-cpu"], help="run only these rows")
    args = ap.parse_args(argv)
    root = Path(args.out) / time.strftime("%Y-%m-%d_%H-%M-%S")

    if args.only is None:
        kill = run_experiment(root / "kill", [*BASE, "seed=0", "steps=30", "fault=kill", "fault.at_step=13"])
        print(f"process exit: detected by {kill['detector']} in {kill['detection_latency_s']:.3f} s "
              f"(target <= 1 s), blamed rank {kill['detected_rank']} (injected {kill['fault_rank']})", flush=True)
        hang = run_experiment(root / "hang", [*BASE, "seed=0", "steps=30", "fault=hang", "fault.at_step=13",
                                              "timeouts.heartbeat_s=2"])
        print(f"hang (stall): detected by {hang['detector']} in {hang['detection_latency_s']:.3f} s "
              f"(target <= 2 + 1 s), blamed rank {hang['detected_rank']} (injected {hang['fault_rank']})", flush=True)

    cpu_rows(args.workloads)
    if args.only == "fingerprint-cpu":
        return
    fingerprint_rows(root, args.workloads, args.pairs)
    if args.only == "fingerprint":
        return
    alarms = 0
    for i in range(args.clean_runs):
        alarms += run_experiment(root / f"clean_{i}", [*BASE, "steps=60", "seed=" + str(i)])["false_alarms"]
    print(f"false alarms over {args.clean_runs} fault-free runs of the default detector set: {alarms}")


if __name__ == "__main__":
    main()
