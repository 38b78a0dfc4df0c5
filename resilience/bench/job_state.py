"""What each technique restores: every strategy, ours and the libraries', killed under the real loop (train=real),
each part of the job's state named exact or lost from the step it first differs, and the samples' ledger.

    python -m resilience.bench.job_state [--strategies sync,replica] [--out results/job_state] [OVERRIDE ...]

One fault-free reference (``strategy=none``) and one run per strategy with ``fault=kill`` (its step and phase from
``--kill``); minutes on 2 cores. Prints the Markdown table and writes it with the rows' JSON under ``--out``; each
row's command line reproduces it. Extra ``OVERRIDE``s go to every run (``train.precision=fp16``, ``workload=...``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from resilience import compat
from resilience.proc import child
from resilience.record.fsio import atomic_write_bytes, atomic_write_json
from resilience.state.parts import JOB_PARTS, MODEL, OPTIMIZER, RANK_PARTS

PARTS = (MODEL, OPTIMIZER, *JOB_PARTS, *RANK_PARTS)
REAL = ["train=real", "workload.dropout=0.1", "steps=16"]
TIMEOUT_S = 600


def strategies() -> tuple[str, ...]:
    """Every strategy that recovers a killed rank (from a checkpoint or in place), as shipped in conf/, and the
    negative controls."""
    return tuple(name for name, o in compat.options("strategy").items()
                 if (o.caps.saves or o.caps.recovers_in_place) and o.settings.get("patches", "all") == "all")


def command(strategy: str, kill: list[str], extra: list[str], index: Path) -> list[str]:
    return [*REAL, f"strategy={strategy}", *kill, *extra, "reference.check=run", f"reference.index={index}"]


def run(run_dir: Path, overrides: list[str]) -> dict:
    shutil.rmtree(run_dir, ignore_errors=True)
    done = child.run(child.experiment_command(overrides, run_dir), timeout_s=TIMEOUT_S)
    result = run_dir / "result.json"
    if not result.exists():
        return {"status": f"harness error (exit {done.returncode})"}
    out = json.loads(result.read_text())
    shutil.rmtree(run_dir / "ckpt", ignore_errors=True)  # the events hold the verdict; checkpoints fill disks
    return out


def cell(result: dict, part: str) -> str:
    parts = result.get("state_parts") or {}
    if part not in parts:
        return "n/a"
    v = parts[part]
    return "exact" if v["exact"] else "not checked" if v["exact"] is None else f"lost at {v['first_diff_step']}"


def row(strategy: str, result: dict, overrides: list[str]) -> str:
    ledger = result.get("ledger")
    once = "n/a" if not ledger else "exactly once" if ledger["exactly_once"] else (
        f"{ledger.get('skipped', '?')} skipped, {ledger.get('repeated', '?')} repeated")
    verdict = (result.get("reference") or {}).get("matches")
    end = {True: "yes", False: "NO"}.get(verdict, "-")
    cells = [cell(result, p) if result.get("status") == "ok" else "-" for p in PARTS]
    repro = "`python -m resilience " + " ".join(overrides) + "`"
    return f"| {strategy} | {result.get('status')} | {end} | " + " | ".join(cells) + f" | {once} | {repro} |"


def table(rows: list[str]) -> str:
    head = "| strategy | status | final state exact | " + " | ".join(PARTS) + " | ledger | reproducer |"
    return "\n".join([head, "|" + "---|" * (len(PARTS) + 5), *rows])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m resilience.bench.job_state", description=__doc__.split("\n\n")[0])
    ap.add_argument("--strategies", default=",".join(strategies()),
                    help="comma-separated strategy options (default: every one that recovers a killed rank)")
    ap.add_argument("--kill", default="fault=kill,fault.at_step=12,fault.phase=before_forward",
                    help="the fault's settings, comma-separated (default: a kill before step 13's forward)")
    ap.add_argument("--out", type=Path, default=Path("results/job_state"))
    ap.add_argument("overrides", nargs="*", help="settings for every run (Hydra overrides)")
    args = ap.parse_args(argv)
    chosen = args.strategies.split(",")
    unknown = sorted(set(chosen) - set(compat.options("strategy")))
    if unknown:
        print(f"error: --strategies={args.strategies}: {', '.join(unknown)} unknown; strategies from "
              f"{', '.join(compat.options('strategy'))}", file=sys.stderr)
        return 2
    index = (args.out / "references").resolve()
    rows, results = [], {}
    t0 = time.monotonic()
    for i, strategy in enumerate(chosen, 1):
        overrides = command(strategy, args.kill.split(","), args.overrides, index)
        print(f"[{time.monotonic() - t0:6.0f} s] {i}/{len(chosen)} {strategy}", flush=True)
        results[strategy] = run(args.out / strategy, overrides)
        rows.append(row(strategy, results[strategy], overrides))
        print(rows[-1], flush=True)
    text = table(rows)
    atomic_write_bytes(args.out / "job_state.md", (text + "\n").encode())
    atomic_write_json(args.out / "job_state.json", {s: {k: r.get(k) for k in ("status", "reference", "state_parts",
                                                                             "ledger")} for s, r in results.items()})
    print(text)
    print(f"written: {args.out / 'job_state.md'} ({time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
