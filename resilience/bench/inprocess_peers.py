"""``python -m resilience.bench.inprocess_peers``: NVIDIA Resiliency Extension's in-process restart against our
process restart, after the same faults, in one table.

Rank 1 of a gpt_tiny run on 2 ranks (sync checkpoints every 5 steps) fails at step 13, in one of two ways:
``exception`` (it raises inside the step; its process lives) and ``SIGKILL`` (its process dies). Each fault is
recovered by ``recovery=restart`` (the supervisor stops and starts every rank's process) and by
``recovery=nvrx_inprocess`` (NVRx restarts every rank's training in its process; after a kill it falls back to the
supervisor's restart). The ways run interleaved, one repeat of each before the next, so that a change of the host's
load spreads over all of them. Printed per (fault, way): the median restart cost (fault record to training again,
the checkpoint loaded), the recovery time (to training past the fault's step) and its parts from the events
(detection; the restart, to the new attempt's start; load; replay),
who recovered the run, how many runs ended bit-exact with the fault-free reference, the host's load during them.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from resilience.bench.experiment import run_experiment
from resilience.bench.hang_peers import table
from resilience.bench.replica_peers import spread

BASE = ["workload=gpt_tiny", "world_size=2", "steps=30", "checkpoint.every=5", "seed=0", "strategy=sync"]
FAULTS = {"exception": ["fault=kill", "fault.signal=exception", "fault.rank=1", "fault.at_step=13"],
          "SIGKILL": ["fault=kill", "fault.signal=SIGKILL", "fault.rank=1", "fault.at_step=13"]}
WAYS = {"restart": ["recovery=restart"], "nvrx_inprocess": ["recovery=nvrx_inprocess"],
        "nvrx_as_shipped": ["recovery=nvrx_inprocess", "recovery.patches=none"]}
DEFAULT_WAYS = ("restart", "nvrx_inprocess")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="default results/inprocess_peers/<timestamp>")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--faults", nargs="+", default=list(FAULTS), choices=list(FAULTS))
    ap.add_argument("--ways", nargs="+", default=list(DEFAULT_WAYS), choices=list(WAYS),
                    help="nvrx_as_shipped: recovery.patches=none, NVRx without the workaround (docs/recovery_peers.md)")
    ap.add_argument("--overrides", nargs="*", default=[], help="more Hydra overrides for every run")
    args = ap.parse_args(argv)
    root = args.out or Path("results/inprocess_peers") / time.strftime("%Y-%m-%d_%H-%M-%S")
    reference = run_experiment(root / "reference", [*BASE, "fault=none", *args.overrides])
    runs: dict[tuple[str, str], list[dict]] = {(f, w): [] for f in args.faults for w in args.ways}
    for i in range(args.repeats):
        for fault in args.faults:
            for way in args.ways:
                name = f"{fault}-{way}-r{i}"
                runs[(fault, way)].append(run_experiment(root / name, [*BASE, *FAULTS[fault], *WAYS[way],
                                                                       *args.overrides], echo=True))
    print(f"\nrank 1 fails at step 13 of 30 (gpt_tiny, 2 ranks, sync every 5); {args.repeats} runs each, "
          f"median [min, max]; runs in {root}\n")
    print(table([row(fault, way, got, reference["final_state_sha256"]) for (fault, way), got in runs.items()]))


def row(fault: str, way: str, runs: list[dict], ref_hash: str) -> dict:
    def got(key: str, part: str | None = None) -> list[float]:
        values = [r[key] if part is None else (r.get(key) or {}).get(part) for r in runs]
        return [v for v in values if v is not None]

    by = [str((r.get("inprocess") or {}).get("recovered_by") or "process_restart") for r in runs]
    loads = [(r.get("validity") or {}).get("load_max") for r in runs]
    # restart cost: from the fault to training again (the checkpoint loaded), without the replay of lost steps
    to_training = [r["recovery_time_s"] - r["recovery_breakdown_s"]["replay"] for r in runs
                   if r.get("recovery_time_s") is not None and r["recovery_breakdown_s"].get("replay") is not None]
    return {"fault": fault, "way": way, "n": len(runs),
            "fault to training s": spread(to_training),
            "recovery s": spread(got("recovery_time_s")),
            "detect s": spread(got("recovery_breakdown_s", "detect")),
            "restart s": spread(got("recovery_breakdown_s", "restart")),
            "load s": spread(got("recovery_breakdown_s", "load")),
            "replay s": spread(got("recovery_breakdown_s", "replay")),
            "detected by": ", ".join(sorted({str(r.get("detector")) for r in runs})),
            "recovered by": ", ".join(f"{v} {by.count(v)}/{len(by)}" for v in sorted(set(by))),
            "bit-exact": f"{sum(r.get('final_state_sha256') == ref_hash for r in runs)}/{len(runs)}",
            "host load max": spread([v for v in loads if v is not None], "{:.1f}")}


if __name__ == "__main__":
    main()
