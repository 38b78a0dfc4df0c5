"""What each technique restores: every strategy, ours and the libraries', killed under the real loop (train=real),
each part of the job's state named exact or lost from the step it first differs, and the samples' ledger.

    python -m resilience.bench.job_state [--strategies sync,replica] [--out results/job_state] [OVERRIDE ...]

One fault-free reference (``strategy=none``) and one run per strategy with three kills (``--kill``); minutes on 2
cores. Prints the Markdown table and writes it with the rows' JSON under ``--out``; each
row's command line reproduces it. Extra ``OVERRIDE``s go to every run (``train.precision=fp16``, ``workload=...``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import time
from pathlib import Path

from resilience import compat
from resilience.bench import lineup
from resilience.bench.experiment import run_afresh, write_table
from resilience.record.fsio import atomic_write_json
from resilience.state.parts import JOB_PARTS, MODEL, OPTIMIZER, RANK_PARTS

PARTS = (MODEL, OPTIMIZER, *JOB_PARTS, *RANK_PARTS)
# 16 steps of 4 per epoch (256 samples, 2 ranks, batches of 8, 2 micro-batches), a checkpoint every 3: the kill in
# step 6's save falls back to step 3, the kill at step 10 loads step 9 (mid-epoch), the kill at step 13 loads step
# 12, an epoch's end
REAL = ["train=real", "workload.dropout=0.1", "steps=16", "checkpoint.every=3"]
KILLS = ["fault=kill", "fault.at_step=[6,10,13]", "fault.phase=[during_checkpoint,before_optimizer_step,before_forward]"]
TIMEOUT_S = 600


def strategies() -> tuple[str, ...]:
    """Every strategy that recovers a killed rank (from a checkpoint or in place), as shipped in conf/, and the
    negative controls."""
    return tuple(name for name, o in compat.options("strategy").items()
                 if (o.caps.saves or o.caps.recovers_in_place) and o.settings.get("patches", "all") == "all")


def command(strategy: str, kill: list[str], extra: list[str], index: Path) -> list[str]:
    if not compat.options("strategy")[strategy].caps.saves:  # no save to be killed in: killed before a forward
        kill = [k.replace("during_checkpoint", "before_forward") for k in kill]
    return [*REAL, f"strategy={strategy}", *kill, *extra, "reference.check=run", f"reference.index={index}"]


def run(run_dir: Path, overrides: list[str]) -> dict:
    """Run one row; keep its verdicts and its command line in ``<run dir>/bench.json`` (the table is rendered from
    every row under ``--out``, so a row run again alone replaces only itself)."""
    out, code = run_afresh(run_dir, overrides, timeout_s=TIMEOUT_S)
    out = out or {"status": f"harness error (exit {code})"}
    shutil.rmtree(run_dir / "ckpt", ignore_errors=True)  # the events hold the verdict; checkpoints fill disks
    kept = {k: out.get(k) for k in ("status", "reference", "state_parts", "ledger", "faults_injected", "recoveries")}
    atomic_write_json(run_dir / "bench.json", {**kept, "command": overrides})
    return kept


def rows(out: Path) -> list[str]:
    """The table's rows: every strategy of conf/ with a row under ``out``, in conf/'s order."""
    found = [(name, out / name / "bench.json") for name in compat.options("strategy")]
    return [row(name, json.loads(path.read_text())) for name, path in found if path.exists()]


def cell(result: dict, part: str) -> str:
    parts = result.get("state_parts") or {}
    if part not in parts:
        return "n/a"
    v = parts[part]
    return "exact" if v["exact"] else "not checked" if v["exact"] is None else f"lost at {v['first_diff_step']}"


def row(strategy: str, result: dict) -> str:
    ledger = result.get("ledger")
    once = "n/a" if not ledger else "exactly once" if ledger["exactly_once"] else (
        f"{ledger.get('skipped', '?')} skipped, {ledger.get('repeated', '?')} repeated")
    reference = result.get("reference") or {}
    end = {True: "yes", False: "NO"}.get(reference.get("matches"), f"not checked ({reference.get('why', '-')})")
    cells = [cell(result, p) if result.get("status") == "ok" else "-" for p in PARTS]
    shown = [shlex.quote(o) for o in result["command"] if not o.startswith("reference.index=")]  # this machine's
    return (f"| {strategy} | {result.get('status')} | {end} | " + " | ".join(cells) +
            f" | {once} | `python -m resilience {' '.join(shown)}` |")


def table(rows: list[str]) -> str:
    head = "| strategy | status | final state exact | " + " | ".join(PARTS) + " | ledger | reproducer |"
    return "\n".join([head, "|" + "---|" * (len(PARTS) + 5), *rows])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m resilience.bench.job_state", description=__doc__.split("\n\n")[0])
    ap.add_argument("--strategies", default=",".join(strategies()),
                    help="comma-separated strategy options (default: every one that recovers a killed rank)")
    ap.add_argument("--kill", default=" ".join(KILLS),
                    help="the faults' settings, space-separated (default: three kills, one during a save, one "
                         "whose recovery loads an epoch's end)")
    ap.add_argument("--out", type=Path, default=Path("results/job_state"))
    ap.add_argument("overrides", nargs="*", help="settings for every run (Hydra overrides)")
    args = ap.parse_args(argv)
    chosen = args.strategies.split(",")
    if (error := lineup.unknown_strategies(args.strategies)):
        print(error, file=sys.stderr)
        return 2
    index = (args.out / "references").resolve()
    t0 = time.monotonic()
    for i, strategy in enumerate(chosen, 1):
        print(f"[{time.monotonic() - t0:6.0f} s] {i}/{len(chosen)} {strategy}", flush=True)
        run(args.out / strategy, command(strategy, args.kill.split(), args.overrides, index))
        print(row(strategy, json.loads((args.out / strategy / "bench.json").read_text())), flush=True)
    write_table(args.out / "job_state.md", table(rows(args.out)), t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
