"""``python -m resilience.bench.sharded [--out DIR] [--workload gpt_small]``: checkpoint save and load time per
shard count, a load resharded from 4 ranks to 2 against a load on the size that wrote it, and the shrunk run's
throughput and loss against the fault-free run (docs/sharded.md).

Runs, all ``parallel=fsdp`` with ``strategy=sync``, ``steps=20``, ``checkpoint.every=5``, seed 0, one after the
other on this host (so their times are comparable with each other, not with another host):

- ``ref-w4``: fault-free on 4 ranks (the loss the shrunk run is compared with);
- ``kill-w2`` and ``kill-w4``: rank 1 killed at step 13 on 2 and 4 ranks, restarted from the step-10 checkpoint at
  the same size (the same-size load; the save time per shard count);
- ``shrink-w4``: a node of 2 ranks lost at step 13 (``fault=node_loss fault.ranks_per_node=2``), ``recovery=shrink``
  restarts the 2 survivors, which load the 4-shard step-10 checkpoint resharded to 2 shards.

Printed and written to ``<out>/sharded_bench.json``: per run the median checkpoint stall, the recovery load time
(``recovery_load_s``: the slowest rank's load), the step rate before and after the fault, and the final loss.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from resilience.record.events import read_events
from resilience.record.query import stalls

COMMON = ("parallel=fsdp", "strategy=sync", "steps=20", "checkpoint.every=5", "seed=0", "detector=[process_exit]")
KILL = ("fault=kill", "fault.rank=1", "fault.at_step=13", "fault.phase=before_forward")
RUNS = {
    "ref-w4": ("world_size=4", "fault=none"),
    "kill-w2": ("world_size=2", *KILL),
    "kill-w4": ("world_size=4", *KILL),
    "shrink-w4": ("world_size=4", "fault=node_loss", "fault.ranks_per_node=2", "fault.rank=1", "fault.at_step=13",
                  "recovery=shrink"),
}


def run(out: Path, name: str, workload: str) -> Path:
    run_dir = out / name
    if not (run_dir / "result.json").exists():
        cmd = [sys.executable, "-m", "resilience", f"workload={workload}", *COMMON, *RUNS[name],
               f"hydra.run.dir={run_dir}"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=1800)
    return run_dir


def step_rates(events: list[dict]) -> tuple[list[int], dict[int, float | None]]:
    """The world size of each attempt and its steps per second, between the attempt's first and last step on
    rank 0 (checkpoint stalls included): the throughput before a fault and after it, at the reduced size too."""
    rate = {}
    for attempt in sorted({e["attempt"] for e in events if e["kind"] == "step_end"}):
        ends = [e["t_mono"] for e in events if e["kind"] == "step_end" and e["rank"] == 0 and e["attempt"] == attempt]
        rate[attempt] = (len(ends) - 1) / (ends[-1] - ends[0]) if len(ends) > 2 else None
    return [e["world_size"] for e in events if e["kind"] == "run_start" and e["rank"] == 0], rate


def figures(run_dir: Path) -> dict:
    """What this benchmark reports of one run, from its result.json and events."""
    result = json.loads((run_dir / "result.json").read_text())
    events = read_events(run_dir)
    saves = [s.seconds for s in stalls(events) if s.rank == 0]
    starts, rate = step_rates(events)
    return {"world_sizes": starts, "ckpt_stall_s_median": statistics.median(saves) if saves else None,
            "ckpt_bytes": result.get("ckpt_bytes"), "recovery_load_s": result.get("recovery_load_s"),
            "steps_per_s_by_attempt": rate, "final_loss": result.get("final_loss"),
            "final_state_sha256": result.get("final_state_sha256"), "noisy": result.get("validity")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/bench/sharded"))
    parser.add_argument("--workload", default="gpt_small")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    found = {name: figures(run(args.out, name, args.workload)) for name in RUNS}
    same, reshard = found["kill-w2"]["recovery_load_s"], found["shrink-w4"]["recovery_load_s"]
    summary = {
        "runs": found,
        "save_s_by_shards": {2: found["kill-w2"]["ckpt_stall_s_median"], 4: found["kill-w4"]["ckpt_stall_s_median"]},
        "load_s_same_size_w2": same, "load_s_resharded_4_to_2": reshard,
        "reshard_over_same_size": reshard / same if same and reshard else None,
        "loss_delta_shrink_vs_fault_free": found["shrink-w4"]["final_loss"] - found["ref-w4"]["final_loss"],
    }
    (args.out / "sharded_bench.json").write_text(json.dumps(summary, indent=2, default=str))
    for name, f in found.items():
        print(f"{name:10s} worlds {f['world_sizes']}  save {f['ckpt_stall_s_median']:.2f} s  load "
              f"{f['recovery_load_s'] or 0:.2f} s  steps/s {f['steps_per_s_by_attempt']}  loss {f['final_loss']:.4f}")
    print(f"load on 2 ranks: same size {same:.2f} s, resharded from 4 {reshard:.2f} s "
          f"(x{summary['reshard_over_same_size']:.2f}); loss delta of the shrunk run "
          f"{summary['loss_delta_shrink_vs_fault_free']:+.4f} (not bit-exact by design: fewer ranks, smaller batch)")


if __name__ == "__main__":
    main()
