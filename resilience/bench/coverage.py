"""``python -m resilience.bench.coverage``: which detector catches which fault, how fast, and whom it blames.

Runs every fault of the library once with every detector enabled (3 ranks, so that a majority can name the odd
replica out) plus a fault-free run, and prints one row per (fault, detector) that fired, with the misses listed
as such. Writes ``results/coverage/coverage.csv`` (atomically). Honest by construction: a row is what the event
log of that run says, nothing else.
"""

from __future__ import annotations

import argparse
import csv
import io
import time
from pathlib import Path

from resilience.bench import lineup
from resilience.bench.experiment import run_experiment
from resilience.record.fsio import atomic_write_bytes

BASE = ["steps=30", "checkpoint.every=5", "world_size=3", "seed=0", "timeouts.heartbeat_s=3",
        "timeouts.collective_s=20", "recovery=restart"]
FLIP = ["fault.rank=1", "fault.at_step=13"]

# The settings a fault of conf/fault runs with, a row each: (row name, overrides, detectors left out). A fault not
# named here runs once, as its YAML sets it; which faults run is conf/fault's (resilience.bench.lineup).
SETTINGS: dict[str, list[tuple[str, list[str], tuple[str, ...]]]] = {
    "kill": [("kill", ["fault.at_step=13"], ())],
    "node_loss": [("node_loss", ["fault.at_step=13"], ())],
    "hang": [("hang stall", ["fault.mode=stall", "fault.at_step=13"], ()),
             ("hang stall, no heartbeat", ["fault.mode=stall", "fault.at_step=13", "timeouts.collective_s=5"],
              ("heartbeat", "nvrx_heartbeat")),  # neither heartbeat: who else sees the stall
             ("hang sigstop", ["fault.mode=sigstop", "fault.at_step=13"], ()),
             ("hang gil", ["fault.mode=gil", "fault.at_step=13"], ())],
    "bitflip": [(f"bitflip {target} {bit}", FLIP + [f"fault.target={target}", f"fault.bit={bit}"], ())
                for target, bit in [("weights", "exponent"), ("weights", "mantissa"), ("optimizer", "exponent"),
                                    ("optimizer", "mantissa"), ("grads_post", "exponent"), ("grads_pre", "exponent"),
                                    ("activations", "exponent")]],
    "slow_disk": [("slow_disk 20 MB/s", ["fault.mbps=20", "fault.at_step=8"], ())],
    "straggler": [("straggler x3", ["fault.factor=3", "fault.at_step=8"], ())],
}


def scenarios() -> list[tuple[str, list[str], list[str]]]:
    """(row name, overrides, detectors): every fault of conf/fault that leaves a record (the default, none, first),
    with every detector of conf/detector."""
    every = lineup.detectors()
    return [(name, [f"fault={fault}", *overrides], [d for d in every if d not in without])
            for fault in lineup.faults() for name, overrides, without in SETTINGS.get(fault, [(fault, [], ())])]


def rows_for(name: str, result: dict, detectors: list[str]) -> list[dict]:
    fired = result["detections"]
    if not result["fault_injected"]:
        return [{"fault": name, "detector": "(any)", "detected": result["false_alarms"] > 0,
                 "latency_s": None, "blamed_rank": None, "correct_rank": None,
                 "note": f"{result['false_alarms']} false alarm(s)"}]
    out = []
    for det in detectors:
        hit = fired.get(det)
        out.append({"fault": name, "detector": det, "detected": hit is not None,
                    "latency_s": round(hit["latency_s"], 3) if hit else None,
                    "blamed_rank": hit["blamed_rank"] if hit else None,
                    "correct_rank": (hit["blamed_rank"] == result["fault_rank"]) if hit else None,
                    "note": "" if hit else "missed"})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/coverage", help="directory for the runs and coverage.csv")
    ap.add_argument("--only", nargs="*", help="scenario names to run (default: all)")
    args = ap.parse_args(argv)
    root = Path(args.out) / time.strftime("%Y-%m-%d_%H-%M-%S")
    rows: list[dict] = []
    for i, (name, overrides, detectors) in enumerate(scenarios()):
        if args.only and name not in args.only:
            continue
        print(f"[coverage] {name} ...", flush=True)
        result = run_experiment(root / f"{i:02d}", [*BASE, *overrides, f"detector=[{','.join(detectors)}]"])
        rows += rows_for(name, result, detectors)
        caught = [r for r in rows if r["fault"] == name and r["detected"]]
        print("[coverage]   " + (", ".join(f"{r['detector']} {r['latency_s']} s (rank {r['blamed_rank']})"
                                          for r in caught if r["latency_s"] is not None) or
                                 ("no false alarm" if name == "none" else "MISSED by every detector")), flush=True)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_bytes(Path(args.out) / "coverage.csv", buf.getvalue().encode())
    print_table(rows)


def print_table(rows: list[dict]) -> None:
    print(f"\n{'fault':30s} {'detector':20s} {'detected':8s} {'latency_s':>9s} {'blamed':>6s} {'right':>5s}")
    for r in rows:
        if r["detected"] or r["detector"] in ("(any)", "process_exit", "heartbeat", "replica_fingerprint",
                                              "nonfinite", "collective_timeout"):
            lat = "-" if r["latency_s"] is None else f"{r['latency_s']:.3f}"
            print(f"{r['fault']:30s} {r['detector']:20s} {'yes' if r['detected'] else 'no':8s} {lat:>9s} "
                  f"{str(r['blamed_rank']):>6s} {str(r['correct_rank']):>5s}  {r['note']}")


if __name__ == "__main__":
    main()
