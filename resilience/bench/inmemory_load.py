"""``python -m resilience.bench.inmemory_load``: recovery load time, in-memory snapshot against sync's disk load.

For each workload it runs real experiments (2 ranks, detector ``process_exit`` only) in which rank 1 is killed
once 12 steps are done (``checkpoint.every=5``: both strategies reload step 10), with ``strategy=sync`` and with
``strategy=inmemory`` (plus, with ``--node-loss``, an in-memory run whose killed rank also loses its node's
memory, so it loads its peer copy). From the ``ckpt_loaded`` events of the restarted attempt it takes the load's
critical path, from the moment the last rank starts loading to the moment the last rank is done (a rank that
starts early would only wait for its peer in the load's first collective: start-up skew, not load time), and
prints the median with the source, the bytes, the speed-up over sync and whether the final state is sync's
(``measure(...)`` returns the same figures, for ``resilience.bench.speed``).
The target is a load from memory >= 5x faster than sync's. Sync's checkpoint was just written, so its "disk"
load mostly reads the page cache: the comparison is the harder one for memory.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

from resilience.record.events import read_events
from resilience.record.query import load_window, loads
from resilience.bench.experiment import run_experiment

STEPS, EVERY, FAULT_STEP = 14, 5, 12  # rank 1 dies once 12 steps are done: both strategies reload step 10


def one_run(out: Path, workload: str, strategy: str, fault: str, index: int, no_peer: bool) -> dict:
    run_dir = out / f"{workload}-{strategy}-{fault}-{index}"
    extra = ["strategy.ranks_per_node=2"] if no_peer and strategy == "inmemory" and fault == "kill" else []
    result = run_experiment(run_dir, [f"workload={workload}", f"strategy={strategy}", f"fault={fault}", "fault.rank=1",
                                      f"fault.at_step={FAULT_STEP}", *extra, f"steps={STEPS}",
                                      f"checkpoint.every={EVERY}", "world_size=2", "seed=0", "detector=[process_exit]"],
                            timeout_s=900)
    loaded = [e for e in loads(read_events(run_dir)) if e["attempt"] > 0]
    if result["status"] != "ok" or len(loaded) != 2:
        raise RuntimeError(f"{run_dir}: status {result['status']}, {len(loaded)} ckpt_loaded events")
    start, end = load_window(loaded)
    return {"load_s": end - start, "bytes": loaded[0]["bytes"],
            "source": "/".join(sorted({e["source"] for e in loaded})), "sha": result["final_state_sha256"]}


def measure(workloads: tuple[str, ...] = ("dlrm_emb",), repeats: int = 3, node_loss: bool = False,
            no_peer: bool = False, out: Path | None = None) -> dict[str, Any]:
    """{workload: {"strategy/fault": {load_s (median), loads_s, source, bytes, speedup_over_sync, same_final_state}}}
    and the load average before and after. Interleaved (sync, inmemory, sync, ...): on a shared machine both see the
    same background load."""
    out = out or Path("results/inmemory_bench") / time.strftime("%Y-%m-%d_%H-%M-%S")
    configs = [("sync", "kill"), ("inmemory", "kill")] + ([("inmemory", "node_loss")] if node_loss else [])
    load0, figures = os.getloadavg(), {}
    for workload in workloads:
        runs: dict[tuple[str, str], list[dict]] = {c: [] for c in configs}
        for i in range(repeats):
            for strategy, fault in configs:
                runs[strategy, fault].append(one_run(out, workload, strategy, fault, i, no_peer))
        base = statistics.median(r["load_s"] for r in runs["sync", "kill"])
        ref = runs["sync", "kill"][0]["sha"]
        figures[workload] = {f"{s}/{f}": {
            "load_s": statistics.median(r["load_s"] for r in done), "loads_s": [r["load_s"] for r in done],
            "source": done[0]["source"], "bytes": done[0]["bytes"],
            "speedup_over_sync": base / statistics.median(r["load_s"] for r in done),
            "same_final_state": all(r["sha"] == ref for r in done)} for (s, f), done in runs.items()}
    return {"workloads": figures, "loadavg": [load0, os.getloadavg()]}


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m resilience.bench.inmemory_load",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", nargs="+", default=["dlrm_emb"])
    ap.add_argument("--repeats", type=int, default=3, help="runs per configuration; the median load time is shown")
    ap.add_argument("--node-loss", action="store_true", help="also an in-memory run that loads from the peer copy")
    ap.add_argument("--no-peer", action="store_true", help="kill runs on one simulated node: no peer copy, half the "
                    "/dev/shm (2x the state per rank instead of 4x; the load path is the same)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    r = measure(tuple(args.workloads), args.repeats, args.node_loss, args.no_peer, args.out)
    print("| workload | strategy/fault | loaded from | MB | load s (median) | runs | x faster than sync | "
          "final state = sync's |")
    print("|---|---|---|---|---|---|---|---|")
    for workload, rows in r["workloads"].items():
        for name, f in rows.items():
            print(f"| {workload} | {name} | {f['source']} | {f['bytes'] / 1e6:.1f} | {f['load_s']:.3f} | "
                  f"{', '.join(format(x, '.3f') for x in f['loads_s'])} | {f['speedup_over_sync']:.1f} | "
                  f"{'yes' if f['same_final_state'] else 'NO'} |", flush=True)
    print("load average (1, 5, 15 min) before / after: "
          + " / ".join(", ".join(f"{x:.2f}" for x in la) for la in r["loadavg"]))


if __name__ == "__main__":
    main()
