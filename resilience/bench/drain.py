"""A node's maintenance with notice against the same node lost without it: the node's rank moved to a warm spare
at a step boundary (``fault=drain``), beside a replica recovery from a spare after a node loss, and a restart from
the newest checkpoint after the same loss. Each run must end on the fault-free run's state.

    python -m resilience.bench.drain [--repeats 3] [--out results/drain] [OVERRIDE ...]

Per case and repeat: bit-exact or not, the steps rolled back, ``stopped``: the longest time no rank trained after
the fault (the union of every rank's step intervals has a hole there: detection, start-up, group, load or heal),
and ``downtime``: stopped + the replay of the rolled-back steps at the run's median step time. Prints a Markdown
table of medians (each repeat's figures beside) and writes it under ``--out`` with each run's directory. About
15 s a run on 2 cores.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from resilience.bench.experiment import run_afresh, write_table
from resilience.record.events import read_events

TRAINING = ["workload=gpt_tiny", "world_size=2", "steps=20", "checkpoint.every=5", "seed=0",
            "detector=[process_exit]", "fault.rank=1", "fault.at_step=13", "reference.check=run"]
CASES = {  # row -> its settings; the same node (rank 1's), at the same step
    "drain: moved to a spare with notice": ["strategy=replica", "supervisor.spares=1", "fault=drain",
                                            "fault.notice_s=30"],
    "node loss: replica heals a spare": ["strategy=replica", "supervisor.spares=1", "fault=node_loss"],
    "node loss: restart from checkpoint": ["strategy=sync", "fault=node_loss", "recovery=restart"],
}
TIMEOUT_S = 300


def stopped_s(events: list[dict], t0: float) -> float | None:
    """The longest hole after ``t0`` in the union of every rank's step intervals (``step_end`` minus its
    ``duration_s``): the time no rank trained. None when no step ended after ``t0``."""
    spans = sorted((e["t_mono"] - e["duration_s"], e["t_mono"]) for e in events if e["kind"] == "step_end")
    covered, hole = None, None
    for start, end in spans:
        if covered is not None and start > covered and end > t0:
            hole = max(hole or 0.0, start - max(covered, t0))
        covered = end if covered is None else max(covered, end)
    return hole


def measure(run_dir: Path, overrides: list[str]) -> dict:
    result, code = run_afresh(run_dir, overrides, timeout_s=TIMEOUT_S)
    if result is None:
        return {"exit": code, "matches": None}
    events = read_events(run_dir)
    fault = next(e for e in events if e["kind"] == "fault_injected")
    hole = stopped_s(events, fault["t_mono"])
    lost = result.get("lost_steps") or 0
    step = result.get("step_time_s") or 0.0
    return {"exit": code, "status": result["status"], "matches": (result.get("reference") or {}).get("matches"),
            "lost_steps": lost, "stopped_s": hole, "downtime_s": None if hole is None else hole + lost * step,
            "moved": (result.get("drain") or {}).get("moved")}


def table(rows: dict[str, list[dict]]) -> str:
    lines = ["| case | bit-exact | steps rolled back | stopped s (median; each) | downtime s (median; each) |",
             "|---|---|---|---|---|"]
    for name, runs in rows.items():
        exact = sum(r["matches"] is True for r in runs)
        lost = sorted({r.get("lost_steps") for r in runs}, key=str)

        def spread(key: str) -> str:
            got = [r[key] for r in runs if r.get(key) is not None]
            each = ", ".join(f"{v:.2f}" for v in got)
            return f"{statistics.median(got):.2f} ({each})" if got else "-"
        lines.append(f"| {name} | {exact} of {len(runs)} | {', '.join(map(str, lost))} | {spread('stopped_s')} | "
                     f"{spread('downtime_s')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m resilience.bench.drain", description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("results/drain"))
    ap.add_argument("overrides", nargs="*", help="settings for every run (Hydra overrides)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        print(f"error: --repeats={args.repeats}: must be at least 1", file=sys.stderr)
        return 2
    started = time.monotonic()
    index = f"reference.index={(args.out / 'references').resolve()}"
    rows: dict[str, list[dict]] = {name: [] for name in CASES}
    for i in range(args.repeats):  # cases interleaved: a slow spell of the host falls on every case alike
        for n, (name, settings) in enumerate(CASES.items()):
            r = measure(args.out / f"case{n}_{i}", [*TRAINING, *settings, index, *args.overrides])
            rows[name].append(r)
            print(f"[drain bench] {name} #{i + 1}: {r}", flush=True)
    write_table(args.out / "drain.md", table(rows), started)
    return 0 if all(r["matches"] is True for runs in rows.values() for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
