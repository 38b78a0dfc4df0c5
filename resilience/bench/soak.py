"""Nothing grows over a long run: hundreds of saves in one run per strategy, each rank's resident memory, open file
descriptors and the host's /dev/shm bytes read at every save, and a fitted slope per save with its 95% interval.

    python -m resilience.bench.soak [--strategies async,dcp_async] [--saves 200] [--out results/soak] [OVERRIDE ...]

A strategy is flat where every interval contains 0 (or the growth is under ``--tolerance`` of the first reading over
the whole run); otherwise the row names what grows: a finding about that strategy or library (DCP's async_save
leaks are reported upstream: pytorch#170163). The first ``--warmup`` saves are left out of the fit: allocators and
a library's first buffers settle there. The readings are taken from outside the ranks (/proc), when the rank's
``ckpt_stall_end`` of each save appears in the event log.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from resilience.bench import lineup
from resilience.bench.experiment import write_table
from resilience.ckpt.shm_store import SHM_DIR
from resilience.proc import child
from resilience.proc.child import Child
from resilience.record.events import EVENTS_FILE
from resilience.record.fsio import atomic_write_json

ASYNC = ["async", "dcp_async", "dcp_async_staged", "dcp_async_process", "torchsnapshot", "nvrx_async",
         "dlrover_flash"]
METRICS = ("rss_mb", "fds", "shm_mb")
POLL_S = 0.05


@dataclass(frozen=True)
class Slope:
    """Least-squares growth per save, with its 95% interval (normal approximation: n is in the hundreds)."""

    per_save: float
    half_width: float
    first: float

    @property
    def contains_zero(self) -> bool:
        return abs(self.per_save) <= self.half_width

    def growth_over(self, saves: int) -> float:
        return self.per_save * saves


def fit(values: list[float]) -> Slope:
    n = len(values)
    if n < 3:
        raise ValueError(f"a slope needs at least 3 readings, got {n}")
    xs = range(n)
    mx, my = (n - 1) / 2, statistics.fmean(values)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, values)) / sxx
    residual = sum((y - (my + b * (x - mx))) ** 2 for x, y in zip(xs, values))
    se = math.sqrt(residual / (n - 2) / sxx)
    return Slope(b, 1.96 * se, values[0])


def _proc(pid: int) -> tuple[float, int]:
    """Resident memory (MB) and open file descriptors of ``pid``."""
    rss_kb = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                  if line.startswith("VmRSS:"))
    return rss_kb / 1024, len(os.listdir(f"/proc/{pid}/fd"))


def _shm_mb() -> float:
    total = 0
    for p in SHM_DIR.iterdir():
        try:
            total += p.stat().st_blocks * 512  # what the segment holds, not its sparse size
        except OSError:
            pass
    return total / 2**20


def soak(strategy: str, run_dir: Path, saves: int, overrides: list[str], timeout_s: float) -> dict:
    """One run of ``saves`` saves; readings per rank at each save."""
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = child.experiment_command([f"strategy={strategy}", f"steps={saves}", "checkpoint.every=1",
                                    "checkpoint.keep=2", "fault=none", "detector=[process_exit]", *overrides], run_dir)
    readings: dict[int, list[dict]] = {}
    pids: dict[int, int] = {}
    offset, deadline = 0, time.monotonic() + timeout_s
    log = run_dir.parent / f"{run_dir.name}.log"
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out, Child(cmd, stdout=out, stderr=out) as run:
        while run.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(POLL_S)
            path = run_dir / EVENTS_FILE
            if not path.exists():
                continue
            with path.open() as f:
                f.seek(offset)
                chunk = f.read()
            lines = chunk.split("\n")
            offset += len(chunk) - len(lines[-1])  # a torn last line is read again next time
            for line in lines[:-1]:
                e = _parse(line)
                if e is None:
                    continue
                if e["kind"] == "run_start":
                    pids[e["rank"]] = e["pid"]
                elif e["kind"] == "ckpt_stall_end" and e.get("rank") in pids:
                    try:
                        rss, fds = _proc(pids[e["rank"]])
                    except (OSError, StopIteration):
                        continue
                    readings.setdefault(e["rank"], []).append(
                        {"step": e["step"], "rss_mb": rss, "fds": fds, "shm_mb": _shm_mb()})
        finished = run.proc.poll() is not None
    return {"strategy": strategy, "finished": finished, "exit": run.proc.returncode, "readings": readings,
            "command": cmd}


def _parse(line: str) -> dict | None:
    try:
        return json.loads(line)
    except ValueError:
        return None


def verdict(found: dict, warmup: int, tolerance: float) -> dict[str, str]:
    """Per metric: "flat", or the growth per save and over the run, rank by rank, where it grows."""
    said = {}
    for metric in METRICS:
        grows = []
        for rank, rows in sorted(found["readings"].items()):
            values = [r[metric] for r in rows[warmup:]]
            if len(values) < 3:
                grows.append(f"rank {rank}: {len(values)} readings")
                continue
            s = fit(values)
            total = s.growth_over(len(values))
            if not s.contains_zero and abs(total) > tolerance * max(abs(s.first), 1e-9):
                grows.append(f"rank {rank}: {s.per_save:+.3g}/save [{s.per_save - s.half_width:+.3g}, "
                             f"{s.per_save + s.half_width:+.3g}] ({total:+.3g} over {len(values)})")
        said[metric] = "; ".join(grows) if grows else "flat"
    return said


def table(rows: list[tuple[str, dict, dict[str, str]]], warmup: int) -> str:
    head = ["| strategy | saves read (per rank) | RSS (MB) | open fds | /dev/shm (MB) |", "|---|---|---|---|---|"]
    body = []
    for strategy, found, said in rows:
        n = ", ".join(str(len(r)) for _, r in sorted(found["readings"].items())) or "0"
        ended = "" if found["finished"] and found["exit"] == 0 else f" (run exit {found['exit']})"
        body.append(f"| {strategy} | {n}{ended} | " + " | ".join(said[m] for m in METRICS) + " |")
    return "\n".join([*head, *body, "", f"Fitted over the saves after the first {warmup}; 'flat': the slope's 95% "
                      "interval contains 0, or the growth over the run is within the tolerance of the first reading."])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m resilience.bench.soak", description=__doc__.split("\n\n")[0])
    lineup.bench_arguments(ap, ASYNC, "results/soak")
    ap.add_argument("--saves", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20, help="saves left out of the fit (default 20)")
    ap.add_argument("--tolerance", type=float, default=0.01, help="growth over the run, as a share of the first "
                                                                   "reading, that still counts as flat (default 0.01)")
    ap.add_argument("--timeout-min", type=float, default=15.0, help="per strategy (default 15)")
    args = ap.parse_args(argv)  # every run: workload=gpt_small world_size=2 seed=0, then the overrides
    if (strategies := lineup.strategies_given(args)) is None:
        return 2
    if args.saves <= args.warmup + 3:
        print(f"error: --saves={args.saves}: must exceed --warmup ({args.warmup}) by more than 3", file=sys.stderr)
        return 2
    overrides = ["workload=gpt_small", "world_size=2", "seed=0", *args.overrides]
    started, rows = time.monotonic(), []
    for strategy in strategies:
        print(f"[{time.monotonic() - started:5.0f} s] {strategy}: {args.saves} saves ...", flush=True)
        found = soak(strategy, args.out / strategy, args.saves, overrides, args.timeout_min * 60)
        atomic_write_json(args.out / f"{strategy}.json", found)
        shutil.rmtree(args.out / strategy / "ckpt", ignore_errors=True)
        said = verdict(found, args.warmup, args.tolerance)
        rows.append((strategy, found, said))
        print(f"    {said}", flush=True)
    write_table(args.out / "soak.md", table(rows, args.warmup), started)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
