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

from resilience.bench.experiment import run_experiment
from resilience.record.fsio import atomic_write_bytes

ALL = ["process_exit", "heartbeat", "collective_timeout", "nonfinite", "loss_spike", "grad_norm",
       "replica_fingerprint", "straggler", "gpu_health", "ckpt_integrity"]
BASE = ["steps=30", "checkpoint.every=5", "world_size=3", "seed=0", "timeouts.heartbeat_s=3",
        "timeouts.collective_s=20", "recovery=restart"]
FLIP = ["fault=bitflip", "fault.rank=1", "fault.at_step=13"]

# (row name, overrides, detectors): the fault library of the injector issue
SCENARIOS: list[tuple[str, list[str], list[str]]] = [
    ("none", ["fault=none"], ALL),
    ("kill", ["fault=kill", "fault.at_step=13"], ALL),
    ("node_loss", ["fault=node_loss", "fault.at_step=13"], ALL),
    ("hang stall", ["fault=hang", "fault.mode=stall", "fault.at_step=13"], ALL),
    ("hang stall, no heartbeat", ["fault=hang", "fault.mode=stall", "fault.at_step=13", "timeouts.collective_s=5"],
     [d for d in ALL if d != "heartbeat"]),
    ("hang sigstop", ["fault=hang", "fault.mode=sigstop", "fault.at_step=13"], ALL),
    ("hang gil", ["fault=hang", "fault.mode=gil", "fault.at_step=13"], ALL),
    ("bitflip weights exponent", FLIP + ["fault.target=weights", "fault.bit=exponent"], ALL),
    ("bitflip weights mantissa", FLIP + ["fault.target=weights", "fault.bit=mantissa"], ALL),
    ("bitflip optimizer exponent", FLIP + ["fault.target=optimizer", "fault.bit=exponent"], ALL),
    ("bitflip optimizer mantissa", FLIP + ["fault.target=optimizer", "fault.bit=mantissa"], ALL),
    ("bitflip grads_post exponent", FLIP + ["fault.target=grads_post", "fault.bit=exponent"], ALL),
    ("bitflip grads_pre exponent", FLIP + ["fault.target=grads_pre", "fault.bit=exponent"], ALL),
    ("bitflip activations exponent", FLIP + ["fault.target=activations", "fault.bit=exponent"], ALL),
    ("slow_disk 20 MB/s", ["fault=slow_disk", "fault.mbps=20", "fault.at_step=8"], ALL),
    ("straggler x3", ["fault=straggler", "fault.factor=3", "fault.at_step=8"], ALL),
]


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
    for i, (name, overrides, detectors) in enumerate(SCENARIOS):
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
