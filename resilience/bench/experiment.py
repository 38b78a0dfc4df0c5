"""Run one experiment as a user would (``python -m resilience ...`` in a child process) and read its result.

Used by the demo, the coverage table and the benchmarks, which all compare whole runs side by side.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def run_experiment(run_dir: Path, overrides: list[str], echo: bool = False, timeout_s: float = 900) -> dict:
    """Run to completion and return ``result.json``; a harness failure (exit status 1 or 2) raises."""
    cmd = [sys.executable, "-m", "resilience", *overrides, f"hydra.run.dir={run_dir}"]
    if echo:
        print("$ python -m resilience " + " ".join(cmd[3:]), flush=True)
    done = subprocess.run(cmd, stdout=None if echo else subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"python -m resilience {' '.join(cmd[3:])} exited {done.returncode}: "
                           f"{(done.stderr or '')[-800:]}")
    return json.loads((Path(run_dir) / "result.json").read_text())
