"""What the job's other parts cost a checkpoint: ``sync`` saving every part against ``sync`` saving model and
optimizer alone (``sync_model_only``), under the same real loop, alternated run by run so that the host's moments
fall on both.

    python -m resilience.bench.part_cost [--repeats 3] [--out results/part_cost] [OVERRIDE ...]

Prints each run's median checkpoint stall and size, then the medians' ratio (whole job / model and optimizer).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
from pathlib import Path

from resilience.bench.experiment import run_afresh

PAIR = ("sync", "sync_model_only")
REAL = ["train=real", "workload.dropout=0.1", "steps=20", "fault=none", "reference.check=none"]


def measure(run_dir: Path, strategy: str, extra: list[str]) -> dict:
    r, code = run_afresh(run_dir, [*REAL, f"strategy={strategy}", *extra], timeout_s=600)
    if code != 0 or r is None:
        raise SystemExit(f"error: the {strategy} run failed (exit {code}); see {run_dir}")
    shutil.rmtree(run_dir / "ckpt", ignore_errors=True)
    return {"stall_s": r["ckpt_stall_s"], "bytes": r["ckpt_bytes"], "validity": r["validity"]["verdict"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m resilience.bench.part_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="runs of each (default 3)")
    ap.add_argument("--out", type=Path, default=Path("results/part_cost"))
    ap.add_argument("overrides", nargs="*", help="settings for every run (Hydra overrides)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        print(f"error: --repeats={args.repeats}: must be an integer >= 1", file=sys.stderr)
        return 2
    runs: dict[str, list[dict]] = {s: [] for s in PAIR}
    for i in range(args.repeats):
        for strategy in PAIR if i % 2 == 0 else PAIR[::-1]:
            m = measure(args.out / f"{strategy}_{i}", strategy, args.overrides)
            runs[strategy].append(m)
            print(f"{strategy:16s} run {i + 1}: stall {m['stall_s'] * 1e3:7.1f} ms, {m['bytes'] / 1e6:6.2f} MB "
                  f"({m['validity']})", flush=True)
    med = {s: statistics.median(m["stall_s"] for m in runs[s]) for s in PAIR}
    size = {s: statistics.median(m["bytes"] for m in runs[s]) for s in PAIR}
    print(f"median stall: whole job {med[PAIR[0]] * 1e3:.1f} ms, model+optimizer {med[PAIR[1]] * 1e3:.1f} ms, "
          f"ratio {med[PAIR[0]] / med[PAIR[1]]:.3f}; size ratio {size[PAIR[0]] / size[PAIR[1]]:.4f} "
          f"(+{(size[PAIR[0]] - size[PAIR[1]]) / 1e3:.1f} kB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
