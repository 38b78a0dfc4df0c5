"""Run one experiment as a user would (``python -m resilience ...`` in a child process) and read its result.

Used by the demo, the coverage table and the benchmarks, which all compare whole runs side by side. The child runs
in its own session and its whole process group ends with it (``resilience.proc.child``): no rank outlives a timeout.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from resilience.proc import child
from resilience.record.fsio import atomic_write_bytes


def run_experiment(run_dir: Path, overrides: list[str], echo: bool = False, timeout_s: float = 900) -> dict:
    """Run to completion and return ``result.json``; a harness failure (exit status 1 or 2) or a timeout raises."""
    if echo:
        print("$ python -m resilience " + " ".join([*overrides, f"hydra.run.dir={run_dir}"]), flush=True)
    done = child.run(child.experiment_command(overrides, run_dir), timeout_s=timeout_s, echo=echo)
    if done.returncode != 0:
        why = f"ran over {timeout_s} s" if done.timed_out else f"exited {done.returncode}"
        raise RuntimeError(f"python -m resilience {' '.join(overrides)} {why}: {done.stderr[-800:]}")
    return json.loads((Path(run_dir) / "result.json").read_text())


def run_afresh(run_dir: Path, overrides: list[str], timeout_s: float = 900) -> tuple[dict | None, int]:
    """Run in an emptied ``run_dir``; its ``result.json`` (None where it wrote none) and the exit status, for benches
    that count a failed run among their rows rather than stop at it."""
    shutil.rmtree(run_dir, ignore_errors=True)
    done = child.run(child.experiment_command(overrides, run_dir), timeout_s=timeout_s)
    result = Path(run_dir) / "result.json"
    return (json.loads(result.read_text()) if result.exists() else None), done.returncode


def run_or_reuse(run_dir: Path, overrides: list[str], reuse: bool, timeout_s: float = 900) -> tuple[dict | None, int]:
    """``run_afresh``, or with ``reuse`` the result a finished run in ``run_dir`` holds (to score it again, or to go
    on with a bench that stopped): a run that wrote no result, or one that failed, runs again from nothing."""
    result = Path(run_dir) / "result.json"
    if reuse and result.exists() and (found := json.loads(result.read_text())).get("status") == "ok":
        return found, 0
    return run_afresh(run_dir, overrides, timeout_s=timeout_s)


def write_table(path: Path, text: str, started: float) -> None:
    """A bench's Markdown table: written (atomically), printed, and where it went with the bench's time."""
    atomic_write_bytes(path, (text + "\n").encode())
    print(text)
    print(f"written: {path} ({time.monotonic() - started:.0f} s)")
