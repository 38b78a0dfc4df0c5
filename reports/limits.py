"""``python -m reports.limits LIMITS_JSON ENVIRONMENT_JSON``: the machine's physical limits and its environment.

Limits (disk write/read and memory copy bandwidth, the cost of starting a rank) come from
``python -m resilience.bench.probe --dir <LIMITS_JSON's folder> --out LIMITS_JSON --refresh``: measured now, for
this results directory, never reused from elsewhere; ``snapshot`` names the folder. When it fails, LIMITS_JSON is
``{"probed": false, "reason": ...}`` and the report says "not probed". ``RB_PROBE_MB`` sets the MiB of each disk
sample (default 1024; the test suite's pipelines take 128: their figures are not the point). The environment (CPU, GPU, memory, library
versions, ``torch.utils.collect_env``: resilience/record/environment.py) is read here, on the machine that runs the
cells.

The pipeline keeps one snapshot folder per run that measures cells, ``<results>/probe/<UTC time>/``
(:func:`snapshot_dir`); each cell's ``done.json`` names the snapshot it ran under (``probe``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from resilience.proc import child
from resilience.record.environment import capture as environment  # torch.utils.collect_env and the benchmark's needs
from resilience.record.fsio import atomic_write_json

SIZE_VAR = "RB_PROBE_MB"  # MiB per disk sample of the probe (its default: 1024)

PROBE_MODULE = "resilience.bench.probe"
PROBE_TIMEOUT_S = 600
PROBE_DIR = "probe"


def snapshot_dir(results: Path, cells_to_run: bool, max_age_s: float, now: float | None = None) -> Path:
    """The probe snapshot folder of this pipeline run: ``results/probe/<stamp>``.

    A new one (stamped ``now``, UTC) when cells are about to run and the newest snapshot is older than
    ``max_age_s`` (0: at every such start), or when there is none; otherwise the newest, so that a pipeline with
    nothing to measure keeps the snapshot its cells ran under.
    """
    now = time.time() if now is None else now
    taken = sorted(p.parent for p in (results / PROBE_DIR).glob("*/limits.json"))
    if taken and not (cells_to_run and now - (taken[-1] / "limits.json").stat().st_mtime > max_age_s):
        return taken[-1]
    return results / PROBE_DIR / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))


def probe_limits(out: Path) -> dict[str, Any]:
    """Run the probe into ``out``; if it fails, write (and return) ``{"probed": false, ...}``."""
    # --dir: the file system the runs' checkpoints go to (the results directory).
    cmd = [sys.executable, "-m", PROBE_MODULE, "--dir", str(out.parent), "--out", str(out), "--refresh"]
    if os.environ.get(SIZE_VAR):  # smaller disk samples (the test suite's pipelines): limits' probe_bytes says so
        cmd += ["--size-mb", os.environ[SIZE_VAR]]
    print("$ " + " ".join(cmd), flush=True)
    done = child.run(cmd, timeout_s=PROBE_TIMEOUT_S, echo=True)
    code = "timeout" if done.timed_out else done.returncode
    if code == 0 and out.exists():
        limits = json.loads(out.read_text())
        limits.setdefault("probed", True)
    else:
        limits = {"probed": False, "reason": f"{PROBE_MODULE} failed (exit {code}); see the probe log"}
    limits["snapshot"] = out.parent.name
    atomic_write_json(out, limits)
    return limits


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m reports.limits LIMITS_JSON ENVIRONMENT_JSON", file=sys.stderr)
        return 2
    size = os.environ.get(SIZE_VAR, "")
    if size and not (size.isdigit() and int(size) >= 1):
        print(f"error: {SIZE_VAR}={size}: must be a whole number of MiB >= 1", file=sys.stderr)
        return 2
    limits_path, env_path = Path(args[0]), Path(args[1])
    limits_path.parent.mkdir(parents=True, exist_ok=True)
    env_path.parent.mkdir(parents=True, exist_ok=True)
    limits = probe_limits(limits_path)
    print(f"limits: {json.dumps(limits, sort_keys=True)}", flush=True)
    env = environment()
    atomic_write_json(env_path, env)
    print(f"environment: {json.dumps(env, sort_keys=True)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
