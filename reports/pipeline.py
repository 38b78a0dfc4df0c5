"""What the Snakefile does around its jobs: the table of cell states at the end, and stopping cells on a signal.

Snakemake's local executor leaves running jobs alone when the snakemake process alone is signalled (a wrapper, a
scheduler, ``kill PID``): SIGTERM lets them finish ("Will exit after finishing currently running jobs") and SIGINT
waits for them. A benchmark cell can run for many minutes, so :func:`stop_jobs_on_signal` first passes the signal to
the jobs' commands (``python -m reports.*``): a cell stops its supervisor, ranks and shared memory and exits
without ``done.json`` (reports/cell.py), so it runs again next time. Then Snakemake's own handling goes on.
"""

from __future__ import annotations

import json
import os
import signal
from collections import Counter
from pathlib import Path
from typing import Any, Iterable

import pandas as pd
import psutil  # a dependency of Snakemake

from reports.cell import shown_state
from resilience.proc.pool import POOL_ENV, Pool

# The order of the table; "noisy" is an ok cell measured on a busy host.
STATES = ("ok", "noisy", "unrecovered", "failed", "invalid", "not run")
FAILED = ("failed", "invalid")


def cell_states(run_dirs: Iterable[Path]) -> dict[str, str]:
    """Each run directory's shown state (reports.cell.shown_state), ``not run`` without a done.json."""
    states = {}
    for run_dir in run_dirs:
        done = run_dir / "done.json"
        states[run_dir.name] = shown_state(json.loads(done.read_text())) if done.exists() else "not run"
    return states


def state_table(states: dict[str, str]) -> str:
    """The console's closing table: one line per state that occurs, then the failed cells by name."""
    counts = Counter(states.values())
    width = max(len(s) for s in STATES)
    lines = ["cell states:"] + [f"  {s:<{width}}  {counts[s]:>4}" for s in STATES if counts[s]]
    lines.append(f"  {'total':<{width}}  {len(states):>4}")
    failed = [name for name, s in states.items() if s in FAILED]
    if failed:
        lines.append("failed or invalid (done.json and the log name the reason): " + ", ".join(failed))
    return "\n".join(lines)


def results_summary(decision_csv: Path) -> str:
    """The console's last lines: each question of the report's decision section and its answer in a few words
    (``reports/decision.py``'s CSV); "" when the report has none."""
    try:
        rows = pd.read_csv(decision_csv)
    except (OSError, ValueError, pd.errors.EmptyDataError):
        return ""
    if rows.empty or not {"workload", "asks", "leader", "runner_up", "called", "ratio"} <= set(rows.columns):
        return ""  # none, or a report of an older layout
    lines = ["results (the report's \"What to choose\"; each call needs the 95% intervals apart):"]
    for r in rows.itertuples():
        said = (f"{r.leader} leads {r.runner_up}" if r.called else
                f"no difference shown between {r.leader} and {r.runner_up}")
        lines.append(f"  [{r.workload}] {r.asks} {said} ({r.ratio})")
    return "\n".join(lines)


def failed_count(states: dict[str, str]) -> int:
    return sum(s in FAILED for s in states.values())


def job_commands() -> list[psutil.Process]:
    """This process's descendants that run a rule's command (``python -m reports...``), not the shells around them."""
    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            args = proc.cmdline()
        except psutil.Error:
            continue
        if "-m" in args[:-1] and args[args.index("-m") + 1].startswith("reports"):
            found.append(proc)
    return found


def stop_jobs() -> None:
    """SIGTERM to each running job's command. A cell stops its own supervisor and ranks, in order; the other rules'
    commands do not handle the signal, so what they started (the probe's test ranks) is told too."""
    for proc in job_commands():
        try:
            targets = [proc] if "reports.cell" in proc.cmdline() else [proc, *proc.children(recursive=True)]
        except psutil.Error:  # it ended meanwhile
            continue
        for target in targets:
            try:
                target.send_signal(signal.SIGTERM)
            except psutil.Error:
                pass


_pool: Pool | None = None


def start_pool(wanted: bool) -> None:
    """The cells' commands forked from one preloaded interpreter (``resilience.proc.pool``), when ``wanted`` (the
    cells run on this machine, ``--config preload`` not false): it takes ~1.4 s off each cell before its first step,
    which no figure measures; every restart after a fault stays cold. Called from ``onstart``."""
    global _pool
    if not wanted:  # cold as the setting says, even where the environment names a pool (a test session's own)
        os.environ.pop(POOL_ENV, None)
    elif _pool is None:
        _pool = Pool.start()
        if _pool is None:
            print("note: the cells' preloaded interpreter did not start: every cell starts cold", flush=True)


def stop_pool() -> None:
    """Called from ``onsuccess`` and ``onerror``: no cell runs any more."""
    global _pool
    if _pool is not None:
        _pool.stop()
        _pool = None


def stop_jobs_on_signal() -> None:
    """On SIGTERM or SIGINT, :func:`stop_jobs`, then call the handler installed before (Snakemake's: stop
    scheduling, mark outputs incomplete). Called from ``onstart``, after Snakemake's scheduler has installed its
    own SIGTERM handler."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        previous = signal.getsignal(sig)
        if previous == signal.SIG_IGN:  # started to ignore it (nohup, a background job): keep ignoring it
            continue

        def handler(signum: int, frame: Any, previous: Any = previous) -> None:
            if signum == signal.SIGTERM and callable(previous):
                previous(signum, frame)  # first: no new job starts once the running ones are told to stop
            stop_jobs()
            if signum == signal.SIGINT and callable(previous):
                previous(signum, frame)  # Python's default: KeyboardInterrupt, which Snakemake handles
            elif not callable(previous):
                raise KeyboardInterrupt

        signal.signal(sig, handler)
