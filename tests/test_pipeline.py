"""The Snakemake pipeline: lint, a dry run of every matrix, the run rule's outcomes, and the smoke matrix end to end."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import textwrap
import time

import pandas as pd
import pytest
import yaml

from conftest import ROOT, processes_mentioning, run_module
from reports.cell import run_cell
from reports.matrix import available, load_matrix


def snakemake(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``snakemake ARGS`` from the repository root (stderr merged into stdout), killed whole on timeout; without
    Snakemake's notice that it uses the workflow's default profile (profiles/default)."""
    done = run_module("snakemake", *args, timeout=timeout, merge_stderr=True)
    done.stdout = "".join(s for s in done.stdout.splitlines(keepends=True) if not s.startswith(PROFILE_NOTICE))
    return done


PROFILE_NOTICE = "Using workflow specific profile"


@pytest.mark.timeout(120)
def test_lint_is_clean(tmp_path):
    done = snakemake("--lint", "--config", f"results={tmp_path}")
    assert done.returncode == 0 and "Congratulations" in done.stdout, done.stdout[-3000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("matrix", available())
def test_dry_run_of_every_matrix_plans_each_cell_once(matrix, tmp_path):
    done = snakemake("-n", "--cores", "2", "--config", f"matrix={matrix}", f"results={tmp_path}")
    assert done.returncode == 0, done.stdout[-3000:]
    cells = len(load_matrix(matrix).cells)
    assert re.search(rf"^run\s+{cells}$", done.stdout, re.MULTILINE), done.stdout[-2000:]
    for rule in ("probe", "aggregate", "project", "report"):
        assert rule in done.stdout


@pytest.mark.timeout(60)
def test_bad_matrix_is_one_line_naming_the_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("axes:\n  workload: [gpt_tiny]\n  sped: [1]\n")
    done = snakemake("-n", "--config", f"matrix={bad}", f"results={tmp_path}")
    assert done.returncode != 0
    assert done.stdout.strip() == ("error: matrix bad: axes.sped: unknown axis; allowed: workload, strategy, fault, "
                                   "detectors, checkpoint.every, seed, world_size, steps, recovery, "
                                   "supervisor.launcher, supervisor.spares, repeat")


@pytest.mark.timeout(120)
def test_a_bad_cell_fails_the_dry_run_in_one_line_before_any_cell_runs(tmp_path):
    fault, expected = "{name: kill, rank: 5}", r"cell .*: fault.rank=5: must be in \[0, 1\] for world_size=2"
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"axes:\n  workload: [gpt_tiny]\n  strategy: [sync]\n  fault: [none, {fault}]\n"
                   f"  detectors: [[process_exit]]\n  checkpoint.every: [5]\n  seed: [0]\n  world_size: [2]\n"
                   f"  steps: [12]\n")
    done = snakemake("-n", "--config", f"matrix={bad}", f"results={tmp_path / 'results'}")
    assert done.returncode != 0 and len(done.stdout.strip().splitlines()) == 1, done.stdout[-2000:]
    assert re.fullmatch(rf"error: matrix bad: {expected}.*", done.stdout.strip())
    assert not (tmp_path / "results").exists()


FAKE = textwrap.dedent("""
    import json, os, sys, time
    run_dir, mode = sys.argv[1], sys.argv[2]
    if mode == "ok":
        assert os.listdir(run_dir) == ["params.yaml"], os.listdir(run_dir)  # the stale run was cleared
        print("[rank 0 attempt 0] step 1/1", flush=True)
        open(os.path.join(run_dir, "result.json"), "w").write(json.dumps({"status": "ok"}))
    elif mode == "invalid":
        sys.exit(print("error: fault.at_step=99: must be in [0, 29]", file=sys.stderr) or 2)
    elif mode == "failed":
        open(os.path.join(run_dir, "supervisor.log"), "w").write("rank 1 lost its store connection\\n")
        sys.exit(print("RuntimeError: boom", file=sys.stderr) or 1)
    else:  # hang, with a "rank" in its own session that names the run's config file
        import subprocess
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", os.path.join(run_dir, "config.yaml")],
                         start_new_session=True)
        time.sleep(300)
""")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode,state,error", [
    ("ok", "ok", None),
    ("invalid", "invalid", "error: fault.at_step=99: must be in [0, 29]"),
    ("failed", "failed", "harness failure (exit 1), no result.json: RuntimeError: boom"),
    ("hang", "failed", "time limit of 2 s reached"),
])
def test_run_rule_records_every_outcome_and_leaves_no_process(tmp_path, mode, state, error):
    run_dir = tmp_path / "runs" / "cell-a"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "events.jsonl").write_text("{}\n")  # a stale, interrupted run
    spec = {"cell": "gpt_tiny-sync-none-seed0", "overrides": ["seed=0"], "params": {"strategy": "sync", "seed": 0}}
    record = run_cell(run_dir / "done.json", spec, timeout_s=2, command=[sys.executable, "-c", FAKE, str(run_dir), mode])
    assert record["state"] == state and record["error"] == error
    assert json.loads((run_dir / "done.json").read_text()) == record
    assert yaml.safe_load((run_dir / "params.yaml").read_text()) == spec  # the short directory's cell, in full
    if mode == "failed":
        assert "rank 1 lost its store connection" in record["error_detail"]
    assert processes_mentioning(str(run_dir)) == []


@pytest.mark.timeout(60)
def test_interrupted_cell_writes_no_done_file_and_stops_its_processes(tmp_path):
    run_dir = tmp_path / "runs" / "cell-b"
    code = (f"import sys, reports.cell as c; "
            f"c.child.experiment_command = lambda o, d: [sys.executable, '-c', {FAKE!r}, str(d), 'hang']; "
            f"sys.exit(c.main([{str(run_dir / 'done.json')!r}, "
            f"'{{\"cell\": \"cell-b\", \"overrides\": []}}']))")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 30
    while not processes_mentioning(str(run_dir / "config.yaml")) and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM and "interrupted" in out
    assert not (run_dir / "done.json").exists()
    assert processes_mentioning(str(run_dir)) == []


@pytest.mark.timeout(300)
def test_smoke_matrix_end_to_end(tmp_path):
    results = tmp_path / "results"
    config = ("--config", "matrix=smoke", f"results={results}")
    started = time.monotonic()
    done = snakemake("--cores", "2", *config, timeout=270)
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stdout[-5000:]
    deadline = time.monotonic() + 10
    while processes_mentioning(str(results)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_mentioning(str(results)) == [], "a rank or supervisor process outlived the pipeline"
    summary = pd.read_csv(results / "summary.csv")
    assert len(summary) == 4 and set(summary["state"]) == {"ok"}, summary[["cell", "state", "error"]]
    assert summary["matches_reference"].tolist() == [True] * 4
    html = (results / "report" / "index.html").read_text()
    assert 'id="projection"' in html and html.count("data:image/png;base64,") >= 7
    assert not list(results.glob("runs/*/ckpt"))  # checkpoint payloads are removed after each run
    print(f"smoke matrix end to end: {elapsed:.0f} s")

    again = snakemake("-n", "--cores", "2", *config)  # finished cells never rerun
    assert again.returncode == 0 and "Nothing to be done" in again.stdout, again.stdout[-3000:]
    zipped = snakemake("--report", str(results / "snakemake-report.zip"), *config)
    assert zipped.returncode == 0 and (results / "snakemake-report.zip").stat().st_size > 10_000, zipped.stdout[-3000:]
