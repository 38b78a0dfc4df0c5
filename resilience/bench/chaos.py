"""Crash consistency checked by an outside tool: ckpt-chaos (PyPI, MIT; not a dependency of the suite) kills our
ranks at every file boundary of their saves, resumes, and judges the outcome.

    python -m resilience.bench.chaos [--strategies sync,async] [--modes before,torn,term] [--max-points 12]
    python -m resilience.bench.chaos rank TEMPLATE OUT      # what ckpt-chaos starts, once per rank
    python -m resilience.bench.chaos hash OUT               # the final state's hash, ckpt-chaos's --result-cmd

ckpt-chaos arms only the processes it starts, so it starts the ranks themselves (``--ranks 2``: RANK, WORLD_SIZE,
MASTER_* set as torchrun sets them), not our supervisor: each rank runs the configuration that
``supervisor.launcher=external`` prepares (``TEMPLATE``), moved into ckpt-chaos's fresh output folder ``OUT``.
Its resume is the same command on the same folder: the ranks load the newest complete checkpoint there (a new job
of the run, attempts numbered on), say ``resumed from step N``, and train to the end; the final hash must be the
fault-free run's. Verdicts (ckpt-chaos's): PASS, HARD_FAIL, SILENT_DIVERGENCE, LOST_WORK (resumed from an older
checkpoint than the newest complete one). Table: ``--out``/chaos.md, and docs/resume.md.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

from resilience.bench import lineup
from resilience.bench.experiment import write_table
from resilience.proc import child
from resilience.proc.child import Child
from resilience.proc.orphans import kill_sessions
from resilience.record.events import read_events
from resilience.record.fsio import atomic_write_bytes

# gpt_tiny on 2 ranks, 12 steps, a checkpoint every 4 (steps 4, 8, 12 on disk: keep them all, ckpt-chaos tracks them)
TRAINING = ["workload=gpt_tiny", "world_size=2", "steps=12", "checkpoint.every=4", "checkpoint.keep=10", "seed=0",
            "detector=[process_exit]", "fault=none"]
# the strategies that write files (DLRover's persisted copy through its standalone saver, which a rank starts itself)
WRITERS = ["sync", "async", "dcp_async", "dcp_async_staged", "dcp_async_process", "torchsnapshot", "nvrx_async",
           "dlrover_flash_standalone"]
VERDICTS = ("PASS", "HARD_FAIL", "SILENT_DIVERGENCE", "LOST_WORK")


def prepare(strategy: str, where: Path, overrides: list[str]) -> Path:
    """The rank configuration of ``strategy`` as ``supervisor.launcher=external`` writes it: the template."""
    shutil.rmtree(where, ignore_errors=True)
    cmd = child.experiment_command([*TRAINING, f"strategy={strategy}", "supervisor.launcher=external", *overrides],
                                   where)
    done = child.run(cmd, timeout_s=120)
    if done.returncode != 0:
        raise RuntimeError(f"preparing {strategy} failed (exit {done.returncode}): {done.stderr[-600:]}")
    return where / "config.yaml"


def rank(template: Path, out: Path) -> int:
    """One rank of the run moved into ``out``, in this process (ckpt-chaos arms the process it starts, not its
    children); a second job on the same folder resumes it."""
    cfg = yaml.safe_load(template.read_text())
    run = run_dir(out)
    run.mkdir(parents=True, exist_ok=True)  # what our supervisor, or the external launcher's preparing, makes
    (out / "ckpt").mkdir(parents=True, exist_ok=True)
    before = read_events(run) if (run / "events.jsonl").exists() else []
    cfg["run_dir"], cfg["checkpoint"]["dir"] = str(run), str(out / "ckpt")
    # a job after one that died numbers its attempts on (resilience.settings.identity.job_first_attempt): the ranks
    # read the log before either writes to it (they write only after joining each other)
    job = 1 + max((e["attempt"] for e in before), default=-1)
    cfg.setdefault("job", {})["first_attempt"] = job
    # beside the template, not in ``out``: the only file events there are the ranks' own
    config = template.parent / "jobs" / f"{hashlib.sha256(str(out).encode()).hexdigest()[:16]}.job{job}.yaml"
    config.parent.mkdir(exist_ok=True)
    atomic_write_bytes(config, yaml.safe_dump(cfg, sort_keys=False).encode())  # both ranks: the same bytes
    # ckpt-chaos sets RANK, WORLD_SIZE and MASTER_* as torchrun does, every rank on this host
    os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))
    from resilience.rank.main import main as rank_main
    from resilience.record.quick_exit import exit_code, exit_now

    console = os.dup(1)  # the rank sends its output to its log; the resumed step goes to ckpt-chaos
    try:
        rank_main(["resilience.rank", str(config)])
    except SystemExit as exc:  # as python -m resilience.rank ends (resilience/rank/__main__.py)
        exit_now(exit_code(exc))
    loaded = [e["step"] for e in read_events(run) if e["kind"] == "ckpt_loaded" and e["attempt"] >= job]
    os.write(console, f"resumed from step {loaded[0] if loaded else 0}\n".encode())
    exit_now(0)
    return 0


def run_dir(out: Path) -> Path:
    """The run's directory beside ckpt-chaos's output folder, not in it: there, only the checkpoints' files are
    crash points (not the event log's and the rank logs' writes)."""
    return out.with_name(out.name + ".run")


def final_hash(out: Path) -> str:
    """Rank 0's final state hash of the last attempt that ended (ckpt-chaos compares it with the fault-free run's)."""
    ends = [e for e in read_events(run_dir(out)) if e["kind"] == "run_end" and e["rank"] == 0]
    return ends[-1]["final_state_sha256"] if ends else "no run_end"


def chaos(strategy: str, work: Path, modes: str, max_points: int, overrides: list[str]) -> dict:
    """ckpt-chaos over one strategy; its verdict counts and where its runs are."""
    template = prepare(strategy, work / "template", overrides)
    me = [sys.executable, "-m", "resilience.bench.chaos"]
    # rank 0 crashes: ckpt-chaos 0.1.8's --crash-rank 1 never crashes (its rank reads CKPT_CHAOS_CRASH_RANK, which
    # its runner does not set: every point "DID NOT CRASH"); ours does not reach into it
    cmd = [sys.executable, "-m", "ckpt_chaos", "run", "--ranks", "2", "--modes", modes, "--max-points", str(max_points),
           # complete = every file of the fault-free run's checkpoint present, by name: DCP's .metadata holds the
           # checkpoint's path, so its size differs between ckpt-chaos's folders (reference/ against pt_003/)
           "--checkpoint-glob", "{out}/ckpt/step_*", "--ckpt-ignore-size", "--step-regex", r"resumed from step (\d+)",
           "--result-cmd", shlex.join([*me, "hash", "{out}"]), "--timeout", "180",
           "--fail-on", "HARD_FAIL,SILENT_DIVERGENCE,LOST_WORK", "--work", str(work / "runs"),
           "--", *me, "rank", str(template), "{out}"]
    shutil.rmtree(work / "runs", ignore_errors=True)
    with (work / "chaos.log").open("w") as log, Child(cmd, stdout=log, stderr=subprocess.STDOUT) as run:
        run.wait(None)
        code = run.proc.returncode
    # what outlived ckpt-chaos's jobs (its session: nothing of ours supervises them): a library's finding, then gone
    left = sorted(kill_sessions({run.proc.pid}).values())
    from ckpt_chaos.runner import rejudge  # its own rules over its own records (what `ckpt-chaos judge` prints)

    rows = [r for r in rejudge(work / "runs") if not r.label.startswith("no crash")]
    counts = {v: sum(r.verdict == v for r in rows) for v in VERDICTS}
    failed = [f"{r.label}: {r.verdict} ({r.outcome})" for r in rows if r.verdict != "PASS"]
    modes = [r.label.rsplit("[", 1)[-1].split("]")[0] for r in rows]  # "#12 open:x.distcp [torn]"
    per_mode = {m: modes.count(m) for m in dict.fromkeys(modes)}
    return {"exit": code, "points": len(rows), "per_mode": per_mode, "counts": counts, "failed": failed,
            "processes_left": left,
            "command": shlex.join(cmd), "log": str(work)}


def table(found: dict[str, dict], modes: str) -> str:
    lines = [f"| strategy | crash points ({modes}) | per mode | " + " | ".join(VERDICTS)
             + " | ckpt-chaos exit | processes left |", "|---|---|---|" + "---|" * len(VERDICTS) + "---|---|"]
    for s, r in found.items():
        per_mode = ", ".join(f"{m} {n}" for m, n in r.get("per_mode", {}).items()) or "-"
        lines.append(f"| {s} | {r['points']} | {per_mode} | " + " | ".join(str(r["counts"][v]) for v in VERDICTS)
                     + f" | {r['exit']} | {len(r['processes_left'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["rank"] and len(argv) == 3:
        return rank(Path(argv[1]), Path(argv[2]))
    if argv[:1] == ["hash"] and len(argv) == 2:
        print(final_hash(Path(argv[1])))
        return 0
    ap = argparse.ArgumentParser(prog="python -m resilience.bench.chaos", description=__doc__.split("\n\n")[0])
    lineup.bench_arguments(ap, WRITERS, "results/chaos")
    ap.add_argument("--modes", default="before,torn,term")
    ap.add_argument("--max-points", type=int, default=12, help="crash points per strategy, evenly sampled")
    args = ap.parse_args(argv)
    if (strategies := lineup.strategies_given(args)) is None:
        return 2
    if importlib.util.find_spec("ckpt_chaos") is None:
        print("error: ckpt-chaos is not installed: pip install -c workflow/envs/constraints.txt -e '.[chaos]'",
              file=sys.stderr)
        return 2
    started, found = time.monotonic(), {}
    for s in strategies:
        print(f"[{time.monotonic() - started:5.0f} s] {s} ...", flush=True)
        found[s] = chaos(s, args.out / s, args.modes, args.max_points, args.overrides)
        print(f"    {found[s]['points']} points: {found[s]['counts']} (exit {found[s]['exit']}, "
              f"{len(found[s]['processes_left'])} processes left); {found[s]['log']}", flush=True)
    write_table(args.out / "chaos.md", table(found, args.modes), started)
    return 0 if all(r["counts"]["PASS"] == r["points"] > 0 for r in found.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
