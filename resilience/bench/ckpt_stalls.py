"""``python -m resilience.bench.ckpt_stalls``: every checkpoint's stall, the first included, and memory per strategy.

For each workload (default ``dlrm_emb`` and ``gpt_small``; 2 ranks) it runs one fault-free experiment per strategy
(default ``sync``, ``async``, ``inmemory``), interleaved, and takes from the events each checkpoint's stall: from
``ckpt_begin`` to ``ckpt_stall_end``, the slower rank's. It prints them per checkpoint with the ratio to ``sync``'s
stall of the same checkpoint (goal for ``async``: <= 5% at every checkpoint, the first included: its buffers are
reserved before it; the part spent waiting for the previous persist is shown apart), the host memory the run
took (peak PSS of its processes, as ``result.json`` has it) and the ``/dev/shm`` files its processes map (peak,
sampled here every 0.5 s). The final state hashes must all agree.

``measure(...)`` returns the figures (for ``resilience.bench.speed``); ``main`` prints them.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from resilience.bench.experiment import run_experiment
from resilience.record.events import read_events
from resilience.record.memory import MemorySampler
from resilience.record.query import stalls

STRATEGIES = ("sync", "async", "inmemory")


def slowest_stalls(run_dir: Path) -> tuple[list[float], list[float]]:
    """Each checkpoint's stall in seconds (the slower rank's), in step order, and the part of it spent waiting for
    the previous checkpoint's persist (``when_busy=wait``: the disk is slower than the checkpoint interval)."""
    events = read_events(run_dir)
    worst: dict[int, float] = defaultdict(float)
    waited: dict[int, float] = defaultdict(float)
    for s in stalls(events):
        worst[s.step] = max(worst[s.step], s.seconds)
    for e in events:
        if e["kind"] == "ckpt_persist_waited":
            waited[e["step"]] = max(waited[e["step"]], e["duration_s"])
    return [worst[s] for s in sorted(worst)], [waited[s] for s in sorted(worst)]


def one_run(run_dir: Path, workload: str, strategy: str, steps: int, every: int) -> dict[str, Any]:
    sampler = MemorySampler(shm=True).start()
    try:
        result = run_experiment(run_dir, [f"workload={workload}", f"strategy={strategy}", "fault=none",
                                          f"steps={steps}", f"checkpoint.every={every}", "world_size=2", "seed=0",
                                          "detector=[process_exit]"], timeout_s=900)
    finally:
        sampler.stop()
    if result["status"] != "ok":
        raise RuntimeError(f"{run_dir}: status {result['status']}")
    stall, waited = slowest_stalls(run_dir)
    return {"stalls_s": stall, "persist_wait_s": waited, "host_peak_bytes": result.get("host_memory_peak_bytes"),
            "shm_peak_bytes": sampler.shm_peak, "sha": result["final_state_sha256"]}


def measure(workloads: tuple[str, ...] = ("dlrm_emb", "gpt_small"), strategies: tuple[str, ...] = STRATEGIES,
            steps: int = 16, every: int = 5, out: Path | None = None) -> dict[str, Any]:
    """{workload: {strategy: {stalls_s, ratio_to_sync (per checkpoint), max_ratio_to_sync, first_over_rest,
    host_peak_bytes, shm_peak_bytes, sha}}, plus ``same_final_state`` per workload and the load average."""
    out = out or Path("results/ckpt_stalls") / time.strftime("%Y-%m-%d_%H-%M-%S")
    load0, figures = os.getloadavg(), {}
    for workload in workloads:
        runs = {s: one_run(out / f"{workload}-{s}", workload, s, steps, every) for s in strategies}
        base = runs.get("sync")
        for r in runs.values():
            rest = r["stalls_s"][1:]
            r["first_over_rest"] = r["stalls_s"][0] / (sum(rest) / len(rest)) if rest else None
            if base is not None:
                r["ratio_to_sync"] = [a / b for a, b in zip(r["stalls_s"], base["stalls_s"])]
                r["max_ratio_to_sync"] = max(r["ratio_to_sync"])
        figures[workload] = {**runs, "same_final_state": len({r["sha"] for r in runs.values()}) == 1}
    return {"workloads": figures, "steps": steps, "every": every, "loadavg": [load0, os.getloadavg()]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m resilience.bench.ckpt_stalls", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", nargs="+", default=["dlrm_emb", "gpt_small"])
    ap.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.every < 1 or args.steps <= args.every:
        ap.error(f"--steps={args.steps} --every={args.every}: every >= 1 and steps > every")
    r = measure(tuple(args.workloads), tuple(args.strategies), args.steps, args.every, args.out)
    print("| workload | strategy | stall s per checkpoint | of which waiting for the previous persist | / sync's, per "
          "checkpoint | first / rest | host peak MB | /dev/shm peak MB |\n|---|---|---|---|---|---|---|---|")
    for workload, runs in r["workloads"].items():
        for strategy, f in runs.items():
            if strategy == "same_final_state":
                continue
            ratios = ", ".join(f"{x:.1%}" for x in f.get("ratio_to_sync", []))
            first = "-" if f["first_over_rest"] is None else f"{f['first_over_rest']:.2f}"
            host = "-" if f["host_peak_bytes"] is None else f"{f['host_peak_bytes'] / 1e6:,.0f}"
            print(f"| {workload} | {strategy} | {', '.join(f'{s:.3f}' for s in f['stalls_s'])} | "
                  f"{', '.join(f'{s:.3f}' for s in f['persist_wait_s'])} | {ratios} | {first} "
                  f"| {host} | {f['shm_peak_bytes'] / 1e6:,.0f} |")
        print(f"| {workload} | final state the same for all | {'yes' if runs['same_final_state'] else 'NO'} |")
    print("load average (1, 5, 15 min) before / after: "
          + " / ".join(", ".join(f"{x:.2f}" for x in la) for la in r["loadavg"]))


if __name__ == "__main__":
    main()
