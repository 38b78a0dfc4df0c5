"""When the whole job dies: every checkpointing strategy, ours and the libraries', through a job killed at a step,
a job killed inside a save, and a preemption with notice without and with a save on it; each followed by a new job
with ``resume=`` that must end on the fault-free run's state, every part of it (train=real).

    python -m resilience.bench.job_loss [--strategies sync,async] [--out results/job_loss] [OVERRIDE ...]

Prints a Markdown table (one row per strategy, one column per way of dying: the resumed run bit-exact or not, the
steps lost, the step it resumed from) and writes it under ``--out`` with each case's JSON; each case's first
command line reproduces it (the resume is the same line with ``resume=<its run dir>``). About 15 s a case on 2
cores: minutes per strategy.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from resilience import compat
from resilience.bench import lineup
from resilience.bench.experiment import write_table
from resilience.ckpt.shm_store import SHM_DIR
from resilience.proc import child
from resilience.proc.child import Child
from resilience.proc.orphans import in_sessions
from resilience.record.events import read_events
from resilience.record.fsio import atomic_write_json
from resilience.record.query import last_job
from resilience.supervise.supervisor import rank_pids

# 12 steps, a checkpoint every 4: the kill at step 6 goes back to step 4; the kill inside step 8's save too
TRAINING = ["train=real", "workload.dropout=0.1", "workload=gpt_tiny", "world_size=2", "steps=12",
            "checkpoint.every=4", "seed=0", "detector=[process_exit]"]
CASES = {  # column -> the fault's settings
    "job_kill at a step": ["fault=job_kill", "fault.at_step=6"],
    "job_kill in a save": ["fault=job_kill", "fault.at_step=8", "fault.phase=during_checkpoint"],
    "preempt: no save": ["fault=preempt", "fault.at_step=6", "fault.grace_s=20"],
    # our supervisor's agent gives the ranks timeouts.shutdown_s after its own SIGTERM: the grace period, as a user
    # sets it for the notice the scheduler gives (docs/resume.md)
    "preempt: save on notice": ["fault=preempt", "fault.at_step=6", "fault.grace_s=20", "checkpoint.on_notice=true",
                                "timeouts.shutdown_s=20"],
}
TIMEOUT_S = 300
LEFT_GRACE_S = 5.0


def case(run_dir: Path, overrides: list[str]) -> dict:
    """The first job, then its resume; what the resumed run says, kept in ``<run dir>/bench.json``."""
    shutil.rmtree(run_dir, ignore_errors=True)
    shm_before = set(os.listdir(SHM_DIR))
    run_dir.mkdir(parents=True)
    # the first job's output to a file, not a pipe: what outlives the job must not keep its command from ending
    with (run_dir / "first_job.log").open("w") as log, Child(child.experiment_command(overrides, run_dir),
                                                              stdout=log, stderr=subprocess.STDOUT) as first:
        first.wait(TIMEOUT_S)
    # what the dead job left running on this host (its ranks each led a session): the resumed job's supervisor
    # ends it when it ends, as it ends its own
    left = _left(rank_pids(run_dir))
    said = run_dir / "result.json"
    second = child.run(child.experiment_command([*overrides, f"resume={run_dir}"]), timeout_s=TIMEOUT_S)
    result = json.loads(said.read_text()) if said.exists() else {}
    restart = (result.get("job_restarts") or [{}])[0]
    parts = result.get("state_parts") or {}
    out = {"first_exit": first.proc.returncode, "processes_left": left, "resume_exit": second.returncode,
           "status": result.get("status"),
           "matches": (result.get("reference") or {}).get("matches"), "lost_steps": restart.get("lost_steps"),
           "loaded_step": restart.get("loaded_step"), "died_at_step": restart.get("died_at_step"),
           "notice": result.get("notice"),  # over both jobs' events: a first job killed in its save wrote no result
           "parts_lost": sorted(p for p, v in parts.items() if v["exact"] is False),
           "shm_left": sorted(set(os.listdir(SHM_DIR)) - shm_before), "command": overrides,
           # what the dead job left and the resumed one removed: the library's leak, recorded though cleaned
           "shm_removed": sorted(f for e in last_job(read_events(run_dir)) if e["kind"] == "shm_leftovers_removed"
                                 for f in e["files"])}
    shutil.rmtree(run_dir / "ckpt", ignore_errors=True)  # the verdicts are kept; checkpoints fill disks
    atomic_write_json(run_dir / "bench.json", out)
    return out


def _left(sessions: set[int]) -> list[str]:
    """The processes of ``sessions`` still alive 5 s on (a fork server exits a moment after the last of its users)."""
    deadline = time.monotonic() + LEFT_GRACE_S
    while (found := in_sessions(sessions)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return sorted(found.values())


def verdict(r: dict) -> str:
    if r["resume_exit"] != 0 or r["status"] != "ok":
        return f"resume failed (exit {r['resume_exit']}, {r['status']})"
    exact = {True: "bit-exact", False: "NOT bit-exact", None: "not checked"}[r["matches"]]
    lost = f" ({', '.join(r['parts_lost'])} lost)" if r["parts_lost"] else ""
    fitted = "" if not (r["notice"] or {}).get("step") else (
        f"; saved {r['notice']['saved_s']:.2f} s after the SIGTERM" if r["notice"]["fitted"] else "; save NOT in time")
    if fitted and r["notice"]["fitted"] and r["loaded_step"] != r["notice"]["step"]:
        fitted += ", but the saved step did not outlive the job"
    shm = f"; /dev/shm left: {len(r['shm_left'])}" if r["shm_left"] else ""
    if r.get("shm_removed"):
        shm += f"; /dev/shm: {len(r['shm_removed'])} left by the dead job, removed by the resume"
    procs = f"; {len(r['processes_left'])} process(es) outlived the job" if r.get("processes_left") else ""
    return f"{exact}{lost}, {r['lost_steps']} lost (from step {r['loaded_step']}){fitted}{shm}{procs}"


def table(out: Path) -> str:
    head = "| strategy | " + " | ".join(CASES) + " |"
    lines = [head, "|" + "---|" * (len(CASES) + 1)]
    for strategy in compat.options("strategy"):
        found = [out / strategy / _slug(c) / "bench.json" for c in CASES]
        if any(p.exists() for p in found):
            cells = [verdict(json.loads(p.read_text())) if p.exists() else "-" for p in found]
            lines.append(f"| {strategy} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _slug(name: str) -> str:
    return name.replace(" ", "_").replace(":", "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m resilience.bench.job_loss", description=__doc__.split("\n\n")[0])
    ap.add_argument("--strategies", default=",".join(lineup.checkpointing()),
                    help="comma-separated strategy options (default: every one that writes checkpoints)")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated columns to run (default: all: "
                                                             f"{', '.join(CASES)})")
    ap.add_argument("--out", type=Path, default=Path("results/job_loss"))
    ap.add_argument("overrides", nargs="*", help="settings for every run (Hydra overrides)")
    args = ap.parse_args(argv)
    chosen, cases = args.strategies.split(","), args.cases.split(",")
    if set(cases) - set(CASES):
        print(f"error: --cases={args.cases}: each one of {', '.join(CASES)}", file=sys.stderr)
        return 2
    if (error := lineup.unknown_strategies(args.strategies)):
        print(error, file=sys.stderr)
        return 2
    index = f"reference.index={(args.out / 'references').resolve()}"
    t0 = time.monotonic()
    for strategy in chosen:
        for name, fault in ((c, CASES[c]) for c in cases):
            overrides = [*TRAINING, f"strategy={strategy}", *fault, *args.overrides, "reference.check=run", index]
            r = case(args.out / strategy / _slug(name), overrides)
            shown = " ".join(shlex.quote(o) for o in overrides if not o.startswith("reference.index="))
            print(f"[{time.monotonic() - t0:6.0f} s] {strategy} / {name}: {verdict(r)}\n    python -m resilience "
                  f"{shown}", flush=True)
    write_table(args.out / "job_loss.md", table(args.out), t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
