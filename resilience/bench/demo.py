"""``python -m resilience.bench.demo``: the demo experiment that ``make run`` runs.

A fault-free reference run, then the same run with rank 1 killed (SIGKILL) at step 13, recovered from the
step-10 checkpoint; the two final states must be bit-identical.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from resilience.bench.experiment import run_experiment

COMMON = ["strategy=sync", "steps=30", "checkpoint.every=5", "world_size=2", "seed=0"]


def run(run_dir: Path, *overrides: str) -> dict:
    return run_experiment(run_dir, [*COMMON, *overrides], echo=True)


def main() -> None:
    base = Path("results/demo") / time.strftime("%Y-%m-%d_%H-%M-%S")
    ref = run(base / "reference", "fault=none")
    hit = run(base / "kill", "fault=kill", "fault.rank=1", "fault.at_step=13")
    same = ref["final_state_sha256"] == hit["final_state_sha256"]
    print(f"\nreference: {ref['final_state_sha256']}\nrecovered: {hit['final_state_sha256']}")
    print(f"bit-exact after recovery: {'yes' if same else 'NO'}; recovery took {hit['recovery_time_s']:.2f} s, "
          f"{hit['lost_steps']} steps lost; results in {base}")
    sys.exit(0 if same and hit["status"] == "ok" else 1)


if __name__ == "__main__":
    main()
