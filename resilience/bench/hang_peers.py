"""``python -m resilience.bench.hang_peers``: our hang detection against NVIDIA Resiliency Extension's, on the same
hangs, in one table.

For each hang mode (``stall``: the rank's Python loops; ``sigstop``: the process is frozen; ``gil``: a C call holds
the interpreter lock) and each detector (ours: ``heartbeat``, from the training loop's beats to the supervisor's
board; NVRx: ``nvrx_heartbeat``, its rank monitor processes under our supervisor; ``ft_launcher``: the same
monitors under NVRx's own launcher, ``supervisor.launcher=ft_launcher``), rank 1 hangs at step 13 of a gpt_tiny
run on 2 ranks with the same heartbeat timeout; ``process_exit`` follows the hang detector in the list, so the first verdict is the
hang detector's. Printed per (mode, detector): the median detection latency (fault record to ``fault_detected``) with
its range over ``--repeats`` runs, the blamed rank(s), how many runs recovered, how many ended bit-exact.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from resilience.bench.experiment import run_experiment

MODES = ("stall", "sigstop", "gil")
DETECTORS = ("heartbeat", "nvrx_heartbeat", "ft_launcher")
LAUNCHED = {"ft_launcher": ["detector=[nvrx_heartbeat,process_exit]", "supervisor.launcher=ft_launcher"]}
BASE = ["workload=gpt_tiny", "world_size=2", "steps=30", "checkpoint.every=5", "seed=0", "fault=hang",
        "fault.rank=1", "fault.at_step=13"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="default results/hang_peers/<timestamp>")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--heartbeat-s", type=float, default=3.0, help="the timeout both detectors are given")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--detectors", nargs="+", default=list(DETECTORS), choices=DETECTORS)
    args = ap.parse_args(argv)
    root = args.out or Path("results/hang_peers") / time.strftime("%Y-%m-%d_%H-%M-%S")
    reference = run_experiment(root / "reference", ["workload=gpt_tiny", "world_size=2", "steps=30",
                                                    "checkpoint.every=5", "seed=0", "strategy=none"])
    rows = []
    for mode in args.modes:
        for det in args.detectors:
            runs = []
            for i in range(args.repeats):
                runs.append(run_experiment(root / f"{mode}-{det}-r{i}", [
                    *BASE, f"fault.mode={mode}", *LAUNCHED.get(det, [f"detector=[{det},process_exit]"]),
                    f"timeouts.heartbeat_s={args.heartbeat_s}"], echo=True))
            rows.append(_row(mode, det, runs, reference["final_state_sha256"]))
    print(f"\nhang of rank 1 at step 13, heartbeat timeout {args.heartbeat_s} s, {args.repeats} runs each "
          f"(median [min, max]); runs in {root}\n")
    print(table(rows))


def _row(mode: str, det: str, runs: list[dict], ref_hash: str) -> dict:
    lat = [r["detection_latency_s"] for r in runs if r.get("detection_latency_s") is not None]
    return {"mode": mode, "detector": det, "n": len(runs),
            "first verdict by": ", ".join(sorted({str(r.get("detector")) for r in runs})),
            "latency s": f"{statistics.median(lat):.2f} [{min(lat):.2f}, {max(lat):.2f}]" if lat else "-",
            "blamed the hung rank": f"{sum(r.get('detected_rank') == r.get('fault_rank') for r in runs)}/{len(runs)}",
            "recovered": f"{sum(bool(r.get('recovered')) for r in runs)}/{len(runs)}",
            "bit-exact": f"{sum(r.get('final_state_sha256') == ref_hash for r in runs)}/{len(runs)}"}


def table(rows: list[dict]) -> str:
    head = list(rows[0]) if rows else []
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return "\n".join(lines + ["| " + " | ".join(str(r[k]) for k in head) + " |" for r in rows])


if __name__ == "__main__":
    main()
