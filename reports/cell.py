"""``python -m reports.cell DONE_JSON (JOB_SPEC | --matrix FILE --cell NAME)``: run one matrix cell and record how it ended, whatever happened.

The run directory is DONE_JSON's folder. A stale run there (an interrupted job) is cleared first, because
``python -m resilience`` refuses a directory that already holds a run. The experiment's exit status becomes a state
in ``done.json``, written atomically and last, so that the file exists only for a cell that really finished:

=========== ============================================================================================
state       meaning
=========== ============================================================================================
ok          exit 0, result status "ok"
unrecovered exit 0, result status "unrecovered" (the harness worked; the fault won)
failed      exit 1 (harness failure), a crash, or the time limit; ``error`` holds the last log lines
invalid     exit 2: a configuration error; ``error`` holds its one line
=========== ============================================================================================

A cell whose fault kills the whole job (its class declares ``ends_the_job``: ``fault=job_kill``, ``fault=preempt``)
is two jobs, as a scheduler's requeue makes it: the first, then the same command with ``resume=<run dir>``; the cell's
time is both jobs', its state the resumed job's, and ``done.json`` lists each job's exit and time (``jobs``).

This command exits 0 in all four cases, so that one bad cell never stops the pipeline. It exits non-zero (and
writes no ``done.json``) only when it is interrupted itself; the cell then runs again on the next invocation.
Rank processes never outlive it: on timeout or interruption the supervisor's process group is stopped, then any
process still naming the run's config file is killed. ``RB_KEEP_CHECKPOINTS=1`` keeps the checkpoint files
(removed by default after the run: results come from the event log, and checkpoints fill disks).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import yaml

from resilience.proc import child
from resilience.record.events import EVENTS_FILE
from resilience.record.fsio import atomic_write_bytes, atomic_write_json
from resilience.trace import write_trace

TAIL_LINES = 12
PARAMS_FILE = "params.yaml"  # the cell's full name, overrides and parameters, in its run directory
NOISE = ("Set the environment variable HYDRA_FULL_ERROR", "See https://hydra.cc")  # Hydra's footer, not the cause


class Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def run_cell(done_path: Path, spec: dict[str, Any], timeout_s: float, command: Sequence[str] | None = None,
             keep_checkpoints: bool = False) -> dict[str, Any]:
    """Run the cell (``command`` replaces ``python -m resilience`` in tests); write and return its done record."""
    run_dir = done_path.parent.resolve()
    clear_run_dir(run_dir)
    # The directory's name is short (reports.matrix.Cell.dir); what the cell is, in full, is written beside its run.
    atomic_write_bytes(run_dir / PARAMS_FILE, yaml.safe_dump(
        {"cell": spec["cell"], "overrides": spec["overrides"], "params": spec.get("params", {})},
        sort_keys=False).encode())
    cmd = list(command or child.experiment_command(spec["overrides"], run_dir))
    print(f"[cell] {spec['cell']}\n[cell] $ {' '.join(cmd)}", flush=True)
    started = time.time()
    job = _job(cmd, run_dir, timeout_s)
    jobs = [job]
    if command is None and job.code != 0 and not job.timed_out and ends_the_job(spec["overrides"]):
        # The fault killed the whole job: the run goes on in a new one, as a scheduler's requeue would start it,
        # and the cell is both jobs (its time, its state: the resumed job's)
        resume = child.experiment_command([*spec["overrides"], f"resume={run_dir}"], run_dir)
        print(f"[cell] the job died (exit {job.code}): a new job resumes it\n[cell] $ {' '.join(resume)}", flush=True)
        job = _job(resume, run_dir, max(1.0, timeout_s - (time.time() - started)))
        jobs.append(job)
    record = {
        "cell": spec["cell"], "overrides": spec["overrides"], "command": cmd, "host": socket.gethostname(),
        "probe": probe_snapshot(),
        "started": started, "elapsed_s": time.time() - started, "exit_code": job.code,
        "jobs": [{"exit_code": j.code, "elapsed_s": j.elapsed_s} for j in jobs],
        **classify(run_dir, job.code, job.timed_out, timeout_s, job.stderr, job.stdout),
    }
    record["validity"] = measured_validity(run_dir)
    record["validity_reasons"] = validity_reasons(run_dir)
    if (run_dir / EVENTS_FILE).exists():  # the run as a Perfetto / Chrome trace (milliseconds of work)
        try:
            write_trace(run_dir)
        except Exception as exc:  # informative only: a torn or odd event log must not cost the cell its record
            print(f"[cell] no trace.json: {type(exc).__name__}: {exc}", flush=True)
    if not keep_checkpoints and (run_dir / "ckpt").is_dir():
        shutil.rmtree(run_dir / "ckpt", ignore_errors=True)
    atomic_write_json(done_path, record)
    print(state_line(run_dir.name, record), flush=True)  # the log's last line; the run rule echoes it
    return record


@dataclass
class Job:
    code: int | None
    timed_out: bool
    elapsed_s: float
    stdout: list[str]
    stderr: list[str]


def _job(cmd: list[str], run_dir: Path, timeout_s: float) -> Job:
    """Run one job of the cell, its output passed through line by line; its exit and the tails of its output."""
    t0 = time.time()
    running = child.Child(cmd)
    proc = running.proc
    tails = {"stdout": deque(maxlen=TAIL_LINES), "stderr": deque(maxlen=TAIL_LINES)}
    readers = [threading.Thread(target=_pump, args=(getattr(proc, name), tails[name]), daemon=True)
               for name in tails]
    for t in readers:
        t.start()
    try:
        timed_out = not running.wait(timeout_s)
    finally:  # also on Interrupted: nothing of the run may outlive this command
        running.stop()
        child.kill_mentioning(str(run_dir / "config.yaml"))  # a rank process that escaped the group
        for t in readers:
            t.join(timeout=5)
    return Job(proc.returncode, timed_out, time.time() - t0, list(tails["stdout"]), list(tails["stderr"]))


def ends_the_job(overrides: list[str]) -> bool:
    """Whether the cell's fault kills the whole job (its class declares ``ends_the_job``: job_kill, preempt)."""
    fault = next((o.split("=", 1)[1] for o in overrides if o.startswith("fault=")), None)
    if fault in (None, "none"):
        return False
    from resilience.compat import options  # the roles' classes: imported only for a cell whose job died

    option = options("fault").get(fault)
    return option is not None and bool(option.caps.ends_the_job)


def shown_state(record: dict[str, Any]) -> str:
    """The state a reader sees: ``noisy`` for an ok cell measured on a busy host, otherwise done.json's state."""
    return "noisy" if record.get("state") == "ok" and record.get("validity") == "noisy" else str(record.get("state"))


def state_line(name: str, record: dict[str, Any]) -> str:
    """One line per finished cell: ``[cell] sync-kill-fd2e563d: ok (14 s)``, with the error of a failed one."""
    why = f": {record['error']}" if record.get("error") else ""
    if shown_state(record) == "noisy" and record.get("validity_reasons"):
        reasons = record["validity_reasons"]  # what made the host busy, in the run's own words; one line a cell
        why = f": {reasons[0]}" + (f" (and {len(reasons) - 1} more: done.json)" if len(reasons) > 1 else "")
    return f"[cell] {name}: {shown_state(record)} ({record.get('elapsed_s', 0):.0f} s){why}"


def measured_validity(run_dir: Path) -> str | None:
    """valid, noisy or unknown: was the host quiet while the cell ran (result.json's validity); None without one."""
    try:
        return json.loads((run_dir / "result.json").read_text())["validity"]["verdict"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def validity_reasons(run_dir: Path) -> list[str]:
    """Why the run was measured on a busy host (result.json's validity reasons); empty for a quiet one or none."""
    try:
        return list(json.loads((run_dir / "result.json").read_text())["validity"]["reasons"])
    except (OSError, ValueError, KeyError, TypeError):
        return []


def set_aside_noisy(results: Path, cells: list[str]) -> list[str]:
    """Move the run directories of the noisy cells among ``cells`` to ``results/noisy/<cell>-<time>`` (so that they
    run again); return their names."""
    moved = []
    for name in cells:
        run_dir = results / "runs" / name
        done = run_dir / "done.json"
        if done.exists() and json.loads(done.read_text()).get("validity") == "noisy":
            target = results / "noisy" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
            target.parent.mkdir(parents=True, exist_ok=True)
            run_dir.rename(target)
            moved.append(name)
    return moved


def probe_snapshot() -> str | None:
    """The pipeline run's probe snapshot (the Snakefile sets ``RB_PROBE``: its folder), or None outside one."""
    folder = os.environ.get("RB_PROBE")
    return Path(folder).name if folder else None


def clear_run_dir(run_dir: Path) -> None:
    """Remove whatever an interrupted earlier attempt left, keeping the (empty) directory."""
    if run_dir.exists() and any(run_dir.iterdir()):
        print(f"[cell] clearing stale run directory {run_dir}", flush=True)
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)


def classify(run_dir: Path, code: int | None, timed_out: bool, timeout_s: float, stderr: list[str],
             stdout: list[str]) -> dict[str, Any]:
    """State, result status and error text of a finished experiment command."""
    result_path = run_dir / "result.json"
    status = json.loads(result_path.read_text()).get("status") if result_path.exists() else None
    if timed_out:
        return {"state": "failed", "result_status": status, "error": f"time limit of {timeout_s:.0f} s reached",
                "error_detail": _detail(run_dir, stderr, stdout)}
    if code == 0 and status in ("ok", "unrecovered"):
        return {"state": status, "result_status": status, "error": None, "error_detail": None}
    if code == 2:
        line = next((s for s in reversed(stderr) if s.strip()), "configuration error (no message)")
        return {"state": "invalid", "result_status": status, "error": line.strip(), "error_detail": "\n".join(stderr)}
    if code is not None and code < 0:
        why = f"killed by {signal.Signals(-code).name}"
    elif code == 0:
        why = f"exit 0 but result status {status!r}"
    else:
        why = f"harness failure (exit {code})" + (f", result status {status!r}" if status else ", no result.json")
    last = next((s.strip() for s in reversed(stderr + stdout) if s.strip() and not s.startswith(NOISE)), "")
    return {"state": "failed", "result_status": status, "error": why + (f": {last}" if last else ""),
            "error_detail": _detail(run_dir, stderr, stdout)}


def _detail(run_dir: Path, stderr: list[str], stdout: list[str]) -> str:
    """The last lines of every log a reader would open to find out why: console, supervisor.log, rank logs."""
    parts = [("console (stdout)", stdout), ("console (stderr)", stderr)]
    for path in [run_dir / "supervisor.log", *sorted((run_dir / "logs").glob("rank*.log"))]:
        if path.exists():
            lines = [s for s in path.read_text(errors="replace").splitlines() if s.strip()]
            parts.append((str(path.relative_to(run_dir)), lines[-TAIL_LINES:]))
    return "\n".join(f"--- {name}\n" + "\n".join(lines) for name, lines in parts if lines)


def _pump(stream, tail: deque) -> None:
    """Copy a child's output line by line into this command's log (progress stays visible) and keep its tail."""
    for line in stream:
        sys.stdout.write(line)
        sys.stdout.flush()
        tail.append(line.rstrip("\n"))


def _raise_interrupted(signum: int, _frame: Any) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # a second signal must not cut the clean-up short
        signal.signal(sig, signal.SIG_IGN)
    raise Interrupted(signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reports.cell", description=__doc__.splitlines()[0])
    parser.add_argument("done", type=Path, help="the done.json to write; its folder is the run directory")
    parser.add_argument("spec", nargs="?", help='JSON: {"cell": NAME, "overrides": [...]} (or --matrix and --cell)')
    parser.add_argument("--matrix", help="the matrix file whose cell to run (with --cell: a short command line)")
    parser.add_argument("--cell", help="the cell's run directory name in --matrix")
    parser.add_argument("--timeout-min", type=float, default=20.0, help="time limit of the experiment (minutes)")
    args = parser.parse_args(argv)
    # A matrix measures recoveries: its restarts start cold whatever the environment says (the test suite's
    # RB_RESTARTS=preloaded, conf/config.yaml); a matrix that wants otherwise names supervisor.restarts itself.
    os.environ.pop("RB_RESTARTS", None)
    if args.spec is None and not (args.matrix and args.cell):
        parser.error("give the cell's JSON spec, or --matrix FILE and --cell NAME")
    if args.spec is None:
        from reports.matrix import load_matrix  # the pipeline's cells, expanded as the Snakefile expanded them

        spec = json.loads(load_matrix(args.matrix).at(args.cell).job_spec())
    else:
        spec = json.loads(args.spec)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _raise_interrupted)
    # Under SLURM, end a little before the job's own limit, so that the cell is recorded rather than cut off.
    timeout_s = max(60.0, args.timeout_min * 60 - 30)
    keep = os.environ.get("RB_KEEP_CHECKPOINTS", "") not in ("", "0")
    try:
        run_cell(args.done, spec, timeout_s, keep_checkpoints=keep)
    except Interrupted as exc:
        print(f"[cell] interrupted ({exc}); the cell will run again next time", flush=True)
        return 128 + exc.signum
    return 0


if __name__ == "__main__":
    sys.exit(main())
