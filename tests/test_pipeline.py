"""The Snakemake pipeline: lint, a dry run of every matrix, the run rule's outcomes, and the smoke matrix end to end."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from conftest import ROOT, processes_mentioning, run_module
from reports.cell import run_cell, state_line, validity_reasons
from reports.limits import PROBE_DIR, SIZE_VAR
from reports.matrix import available, load_matrix
from reports.scenario_choice import SCENARIOS
from resilience.ckpt.shm_store import SHM_DIR, run_id


def snakemake(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``snakemake ARGS`` from the repository root (stderr merged into stdout), killed whole on timeout; without
    Snakemake's notice that it uses the workflow's default profile (profiles/default)."""
    done = run_module("snakemake", *args, timeout=timeout, merge_stderr=True)
    done.stdout = "".join(s for s in done.stdout.splitlines(keepends=True) if not s.startswith(PROFILE_NOTICE))
    return done


PROFILE_NOTICE = "Using workflow specific profile"


@pytest.mark.timeout(120)
def test_lint_is_clean(tmp_path):
    # The lint reads the rules, the same for every matrix; the smoke matrix's 4 cells are checked in 1 s where the
    # default's 119 take 7 (the default matrix's cells: checked in process below, and by its dry run).
    done = snakemake("--lint", "--config", "matrix=smoke", f"results={tmp_path}")
    assert done.returncode == 0 and "Congratulations" in done.stdout, done.stdout[-3000:]


@pytest.mark.timeout(60)
def test_snakefile_is_formatted():
    done = subprocess.run([str(Path(sys.executable).parent / "snakefmt"), "--check", "Snakefile"], cwd=ROOT,
                          capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, f"run `snakefmt Snakefile`:\n{done.stdout}{done.stderr}"


# Snakemake plans the default matrix here and the smoke matrix in its run (test_smoke_matrix_end_to_end); its rule
# graph is the same for every matrix, so the test below runs what differs, the Snakefile's first step, in this process
# for every matrix (hundreds of cells: 8-15 s a dry run), the default's too: its cells are checked in whichever tier
# its dry run is (tests/tiers.py).
DRY_RUN = ("default",)


def plans_each_cell_once(out: str, matrix: str) -> None:
    """Snakemake's console, of a run or a dry run: one run job per cell, every stage, short run directories."""
    cells = len(load_matrix(matrix).cells)
    assert re.search(rf"^run\s+{cells}$", out, re.MULTILINE), out[-2000:]
    for rule in ("probe", "aggregate", "project", "report"):
        assert rule in out
    assert max(len(p.name) for p in map(Path, re.findall(r"\S+/runs/[^/\s]+", out))) < 64


@pytest.mark.timeout(120)
@pytest.mark.parametrize("matrix", DRY_RUN)
def test_dry_run_of_a_matrix_plans_each_cell_once(matrix, tmp_path):
    done = snakemake("-n", "--config", f"matrix={matrix}", f"results={tmp_path}")  # cores: the profile's
    assert done.returncode == 0, done.stdout[-3000:]
    plans_each_cell_once(done.stdout, matrix)


def test_each_matrix_has_its_own_results_folder_by_default(monkeypatch):
    """Without results=, the smoke matrix's results go to results/smoke/ (the Snakefile writes every output under
    that folder: test_smoke_matrix_end_to_end, with results=)."""
    from reports.pipeline_config import pipeline_config

    for key in ("RB_PROBE", "RB_ENVIRONMENT", "RB_DATA_DIR", "PATH"):  # what it sets for the rules, back after
        monkeypatch.setenv(key, os.environ.get(key, ""))
    monkeypatch.delenv("RB_PROBE")  # unset: this pipeline run's snapshot is chosen, not inherited
    config = pipeline_config({"matrix": "smoke"})
    assert config.results == "results/smoke" and Path(config.probe).parent == Path("results/smoke/probe")
    assert {d.parent for d in config.run_dirs} == {Path("results/smoke/runs")}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("matrix", available())
def test_every_cell_of_every_other_matrix_passes_the_commands_checks(matrix):
    cells = load_matrix(matrix, check=True).cells  # as the Snakefile loads it: every cell as the command checks it
    assert cells and len({c.dir for c in cells}) == len(cells)
    assert max(len(c.dir) for c in cells) < 64


@pytest.mark.timeout(60)
def test_bad_matrix_is_one_line_naming_the_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("axes:\n  workload: [gpt_tiny]\n  sped: [1]\n")
    done = snakemake("-n", "--config", f"matrix={bad}", f"results={tmp_path}")
    assert done.returncode != 0
    assert done.stdout.strip() == ("error: matrix bad: axes.sped: unknown axis; allowed: workload, strategy, fault, "
                                   "detectors, checkpoint.every, seed, world_size, steps, recovery, "
                                   "supervisor.launcher, supervisor.spares, repeat, parallel")


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
    record = run_cell(run_dir / "done.json", spec, timeout_s=2,
                      command=[sys.executable, "-c", FAKE, str(run_dir), mode])
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


def one_cell_matrix(folder: Path, strategy: str = "none", steps: int = 12, every: int = 4) -> Path:
    """A matrix of one fault-free cell (its own reference), and a fresh probe snapshot in ``folder/results``, which
    ``probe_max_age_h=1`` reuses: these tests are about the cells, not the probe."""
    matrix = folder / "one.yaml"
    matrix.write_text(f"axes:\n  workload: [gpt_tiny]\n  strategy: [{strategy}]\n  fault: [none]\n"
                      f"  detectors: [[process_exit]]\n  checkpoint.every: [{every}]\n  seed: [0]\n"
                      f"  world_size: [2]\n  steps: [{steps}]\nreference: {{strategy: {strategy}}}\n")
    snapshot = folder / "results" / PROBE_DIR / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    snapshot.mkdir(parents=True)
    (snapshot / "limits.json").write_text('{"probed": false, "reason": "a test"}')
    (snapshot / "environment.json").write_text("{}")
    return matrix


@pytest.mark.timeout(120)
def test_a_failed_cell_fails_the_pipeline_unless_allowed(tmp_path):
    matrix = one_cell_matrix(tmp_path)
    cell = load_matrix(str(matrix)).cells[0]
    run_dir = tmp_path / "results" / "runs" / cell.dir
    run_dir.mkdir(parents=True)
    (run_dir / "done.json").write_text(json.dumps({"cell": cell.name, "overrides": list(cell.overrides),
                                                   "state": "failed", "error": "harness failure (exit 1)"}))
    config = ("--until", "aggregate", "--config", f"matrix={matrix}", f"results={tmp_path / 'results'}",
              "probe_max_age_h=1")
    failed = snakemake(*config)
    assert failed.returncode == 1, failed.stdout[-3000:]
    assert re.search(r"cell states:\n  failed\s+1\n  total\s+1\n", failed.stdout), failed.stdout[-2000:]
    assert f"error: 1 cell(s) failed" in failed.stdout and cell.dir in failed.stdout
    allowed = snakemake("-R", "aggregate", *config, "allow_failed=true")
    assert allowed.returncode == 0 and "cell states:" in allowed.stdout, allowed.stdout[-3000:]


@pytest.mark.timeout(300)
def test_sigterm_to_snakemake_alone_stops_the_running_cell_its_ranks_and_shared_memory(tmp_path):
    matrix = one_cell_matrix(tmp_path, strategy="inmemory", steps=2000, every=2)  # snapshots in /dev/shm
    results = tmp_path / "results"
    run_dir = results / "runs" / load_matrix(str(matrix)).cells[0].dir
    shm = f"*{run_id(run_dir)}*"
    cmd = [sys.executable, "-m", "snakemake", "--config", f"matrix={matrix}", f"results={results}", "probe_max_age_h=1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # a signal to its group would reach the cell directly
    try:
        deadline = time.monotonic() + 200  # about 15 s on a quiet machine; 100 s seen at a load average of 27
        while not list(SHM_DIR.glob(shm)) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert list(SHM_DIR.glob(shm)), "the cell never held a snapshot in shared memory"
        proc.send_signal(signal.SIGTERM)  # to snakemake's process only
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode != 0, out[-3000:]
    assert processes_mentioning(str(results)) == [], "a cell, rank or supervisor outlived snakemake"
    assert list(SHM_DIR.glob(shm)) == [], "shared memory outlived the run"
    assert not (run_dir / "done.json").exists()  # it runs again next time
    assert re.search(r"cell states:\n  not run\s+1\n", out), out[-3000:]


@pytest.mark.timeout(300)
def test_smoke_matrix_end_to_end(tmp_path):
    results = tmp_path / "results"
    # Projected to a cluster of the user's own (--config scenario=PATH, reports/scenario_choice.py): the YAML given,
    # not a built-in, is what the projection projects to (a scenario that is none: tests/test_report.py)
    spec = yaml.safe_load((SCENARIOS / "llama3_405b.yaml").read_text())
    mine = tmp_path / "my_cluster.yaml"
    mine.write_text(yaml.safe_dump({**spec, "name": "my_cluster", "gpus": 2048}))
    config = ("--config", "matrix=smoke", f"results={results}", f"scenario={mine}")
    started = time.monotonic()
    done = snakemake(*config, timeout=270)  # bare: cores and the rest from profiles/default
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stdout[-5000:]
    plans_each_cell_once(done.stdout, "smoke")  # its job table, as a dry run shows it
    deadline = time.monotonic() + 10
    while processes_mentioning(str(results)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_mentioning(str(results)) == [], "a rank or supervisor process outlived the pipeline"
    summary = pd.read_csv(results / "summary.csv")
    assert len(summary) == 4 and set(summary["state"]) == {"ok"}, summary[["cell", "state", "error"]]
    assert summary["matches_reference"].tolist() == [True] * 4
    assert pd.read_parquet(results / "summary.parquet")["cell"].tolist() == summary["cell"].tolist()
    # One console line per cell (ok, or noisy on a busy machine), then the table of states.
    shown = re.findall(r"^\[cell\] (\S+): (ok|noisy) \(\d+ s\)(?:: .+)?$", done.stdout, re.MULTILINE)  # noisy: why
    assert sorted(d for d, _ in shown) == sorted(p.parent.name for p in results.glob("runs/*/done.json")), shown
    table = r"^cell states:\n(  (ok|noisy)\s+\d\n)+  total\s+4$"
    assert re.search(table, done.stdout, re.MULTILINE), done.stdout[-2000:]
    # Where, when and with what each cell ran; the environment is the probe snapshot's, captured once.
    assert summary["host"].notna().all() and summary["started"].str.match(r"\d{4}-\d\d-\d\dT").all()
    assert summary["provenance.git_commit"].notna().all() and summary["provenance.torch"].notna().all()
    for run_dir in map(Path, summary["run_dir"]):
        assert (run_dir / "params.yaml").exists() and (run_dir / "trace.json").exists()
        env = run_dir / json.loads((run_dir / "result.json").read_text())["provenance"]["environment"]
        assert env.resolve().parent.parent == (results / PROBE_DIR).resolve()
        assert "torch_version" in json.loads(env.read_text())["collect_env"]
    # The probe's figures and console (the probe command's, run first, by reports.limits, at RB_PROBE_MB's disk
    # samples: tests/conftest.py's 128 MiB, a whole number of its 8 MiB chunks)
    (snapshot,) = results.glob(f"{PROBE_DIR}/*/limits.json")
    limits = json.loads(snapshot.read_text())
    assert limits["probed"] is True and limits["probe_bytes"] == int(os.environ[SIZE_VAR]) << 20, limits
    assert limits["write_GBps"] > 0 and limits["read_GBps"] > 0 and limits["memcpy_GBps"] > 0, limits
    assert 0 < limits["rank_start_s"] < 60 and limits["p2p_GBps"] > 0, limits
    assert limits["host"] and limits["measured_at"] <= time.time()
    log = (results / "logs" / "probe.log").read_text()
    assert "disk write (fsync, median)" in log and "rank start (2 ranks" in log and "rank-to-rank transfer" in log
    assert re.search(rf"^  snapshot \S*/{snapshot.parent.name}/limits\.json$", log, re.MULTILINE), log[-3000:]
    html = (results / "report" / "index.html").read_text()
    assert 'id="projection"' in html and html.count("data:image/png;base64,") >= 7
    projected = results / "projection"
    status = json.loads((projected / "projection_status.json").read_text())
    assert status["ok"] and set(pd.read_csv(projected / "projection_summary.csv")["gpus"]) == {2048}
    # The projection command's own outputs (resilience.projection.cli; tests/test_projection.py runs it alone): its
    # console, at the user's cluster size (llama3_405b's 50,677 GPU-hours per interruption over 2,048 GPUs) ...
    assert "job MTBF          24.74 h at 2,048 GPUs" in status["console"], status["console"]
    assert "Young" in status["console"] and "Daly" in status["console"] and "Monte Carlo:" in status["console"]
    # ... each table labelled as the model's, each figure a PNG, no temporary file left behind ...
    for name in ("summary", "calibration", "failure_mix", "interval_sweep", "cluster_sweep", "winner_grid",
                 "cluster_monte_carlo"):
        frame = pd.read_csv(projected / f"projection_{name}.csv")
        assert len(frame) and (frame["label"] == "projection").all(), name
    for name in ("goodput_vs_interval", "goodput_vs_cluster", "winner_heatmap", "failure_band"):
        assert (projected / f"projection_{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert not [p for p in projected.iterdir() if p.name.startswith(".")]
    # ... and the closed form and the Monte Carlo agree, a gap beyond the simulation's 95% error flagged
    proj = pd.read_csv(projected / "projection_summary.csv")
    closed, mc = proj["goodput_closed_form"], proj["goodput_monte_carlo"]
    assert ((closed - mc).abs() / closed < 0.01).all(), proj[["strategy", "goodput_closed_form", "goodput_monte_carlo"]]
    assert (proj["gap_flagged"] == ((closed - mc).abs() > proj["goodput_monte_carlo_ci95"])).all()
    assert ((proj["closed_minus_monte_carlo"] - (closed - mc)).abs() < 1e-12).all()
    assert html.count('download="trace-') == 2  # a trace under the timeline of each strategy
    assert not list(results.glob("runs/*/ckpt"))  # checkpoint payloads are removed after each run
    print(f"smoke matrix end to end: {elapsed:.0f} s")

    again = snakemake("-n", "--cores", "2", *config)  # finished cells never rerun
    assert again.returncode == 0 and "Nothing to be done" in again.stdout, again.stdout[-3000:]
    zipped = snakemake("--report", str(results / "snakemake-report.zip"), *config)
    assert zipped.returncode == 0 and (results / "snakemake-report.zip").stat().st_size > 10_000, zipped.stdout[-3000:]


def test_a_noisy_cells_console_line_says_why(tmp_path):
    (tmp_path / "result.json").write_text(json.dumps({"validity": {"verdict": "noisy", "reasons": [
        "other processes used 14% of the CPU (max 10%)"]}}))
    reasons = validity_reasons(tmp_path)
    noisy = {"state": "ok", "validity": "noisy", "validity_reasons": reasons, "elapsed_s": 12}
    assert state_line("c", noisy) == "[cell] c: noisy (12 s): other processes used 14% of the CPU (max 10%)"
    assert state_line("c", {**noisy, "validity": "valid"}) == "[cell] c: ok (12 s)"
    assert validity_reasons(tmp_path / "none") == []


# A rank killed inside a save whose library handed its tensors to worker processes through /dev/shm (DCP's process
# executor, NVRx's async worker: torch_<pid>_* files, 70 MB each in the peers matrix): the cell, as the pipeline
# runs it, leaves nothing of the run in /dev/shm nor any process (the supervisor's sweep, resilience.proc.orphans).
@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", ["dcp_async_process", "nvrx_async"])
def test_a_kill_during_a_save_cell_leaves_no_shared_memory_behind(tmp_path, strategy):
    from conftest import left_nothing

    run_dir = tmp_path / "runs" / "cell"
    run_dir.mkdir(parents=True)
    overrides = [f"strategy={strategy}", "fault=kill", "fault.rank=1", "fault.at_step=8",
                 "fault.phase=during_checkpoint", "workload=gpt_tiny", "world_size=2", "steps=12",
                 "checkpoint.every=4", "seed=0", "detector=[process_exit]", "reference.check=none"]
    shm_before = set(os.listdir(SHM_DIR))
    record = run_cell(run_dir / "done.json", {"cell": f"kill-in-save-{strategy}", "overrides": overrides},
                      timeout_s=200)
    assert record["state"] == "ok", record
    assert json.loads((run_dir / "result.json").read_text())["recovered"] is True
    left_nothing(run_dir, shm_before)


def test_the_run_ends_with_the_decision_sections_answers(tmp_path):
    from reports.pipeline import results_summary

    csv = tmp_path / "decision.csv"
    pd.DataFrame([{"workload": "gpt_tiny", "question": "stall", "asks": "What does a checkpoint cost training?",
                   "leader": "async", "runner_up": "sync", "called": True, "ratio": "x0.06 [0.04, 0.07]",
                   "answer": "..."},
                  {"workload": "gpt_tiny", "question": "durable", "asks": "How soon is it durable?",
                   "leader": "sync", "runner_up": "async", "called": False, "ratio": "x0.9", "answer": "..."}]
                 ).to_csv(csv, index=False)
    lines = results_summary(csv).splitlines()
    assert lines[1] == "  [gpt_tiny] What does a checkpoint cost training? async leads sync (x0.06 [0.04, 0.07])"
    assert lines[2].endswith("no difference shown between sync and async (x0.9)")
    assert results_summary(tmp_path / "missing.csv") == ""
