"""SLURM: the profile's settings, the conda environment, and the smoke matrix through profiles/slurm on a real
cluster (workflow/slurm/local_cluster.py: munge, MariaDB, slurmdbd, slurmctld, and two slurmd on this machine),
then one experiment across its two nodes with torchrun (the Snakefile's rule multinode).

The cluster test takes minutes (four 2-rank cells one after another on a 2-core machine, each a batch job that
starts its own Snakemake), so it runs only when selected: `pytest -m slurm`, or `make test-slurm`, which also
installs Debian's packages and the `slurm` extra. Without the packages it is skipped and says so.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import pandas as pd
import pytest
import yaml

from conftest import ROOT, processes_mentioning, run_module

sys.path.insert(0, str(ROOT / "workflow" / "slurm"))
from local_cluster import ACCOUNT, PACKAGES, PARTITION, LocalSlurm, missing_tools  # noqa: E402

PLUGIN = importlib.util.find_spec("snakemake_executor_plugin_slurm") is not None
needs_plugin = pytest.mark.skipif(not PLUGIN, reason="snakemake-executor-plugin-slurm is not installed "
                                  "(pip install -c workflow/envs/constraints.txt -e '.[slurm]')")


def snakemake_slurm(*args: str, timeout: float) -> subprocess.CompletedProcess:
    """``snakemake --profile profiles/slurm ARGS`` from the repository root (stdout and stderr together)."""
    return run_module("snakemake", "--profile", "profiles/slurm", *args, timeout=timeout, merge_stderr=True)


@needs_plugin
@pytest.mark.timeout(120)
def test_profile_without_account_or_partition_stops_in_one_line_before_any_job(tmp_path, monkeypatch):
    """Unset, the profile's `$SBATCH_ACCOUNT` would pass a dry run and fail at the first sbatch (or let the
    executor plugin guess an account); the Snakefile stops at once instead. The cluster test below runs the
    profile with both set."""
    for var in ("SBATCH_ACCOUNT", "SBATCH_PARTITION"):
        monkeypatch.delenv(var, raising=False)
    results = tmp_path / "results"
    done = snakemake_slurm("-n", "--config", "matrix=smoke", f"results={results}", timeout=100)
    assert done.returncode != 0
    last = done.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"error: SLURM: slurm_account \('\$SBATCH_ACCOUNT'\) and slurm_partition "
                        r"\('\$SBATCH_PARTITION'\) not set: export SBATCH_ACCOUNT=.*", last), done.stdout[-2000:]
    assert not results.exists()  # stopped before the probe snapshot or anything else was made


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_conda_env_has_every_dependency_at_the_locked_version():
    """workflow/envs/bench.yaml (the rules' software on a cluster without the venv) installs what the venv does,
    at the versions of workflow/envs/constraints.txt, and takes torch from conda-forge's CPU/CUDA-aware build."""
    env = yaml.safe_load((ROOT / "workflow/envs/bench.yaml").read_text())
    conda = dict(d.split("=", 1) for d in env["dependencies"] if isinstance(d, str) and "=" in d)
    pip = [p for d in env["dependencies"] if isinstance(d, dict) for p in d["pip"]]
    pins = {normalized(re.sub(r"\[.*\]", "", p.split("==")[0])): p.split("==")[1] for p in pip}
    assert all("==" in p for p in pip), pip
    lock = dict(line.split("==") for line in (ROOT / "workflow/envs/constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    lock = {normalized(k): v for k, v in lock.items()}
    for name, version in pins.items():
        assert lock.get(name) == version, f"bench.yaml pins {name}=={version}, the lock says {lock.get(name)}"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    needed = list(project["dependencies"]) + [d for extra in ("torchsnapshot", "torch_checkpointing", "nvrx", "dlrover",
                                                              "torchft", "data") for d in extras[extra]]
    for requirement in needed:
        name = normalized(re.split(r"[<>=\[;\s]", requirement, maxsplit=1)[0])
        if name == "torch":
            assert conda["pytorch"] == requirement.split("==")[1], "torch: pyproject and bench.yaml disagree"
        else:
            assert name in pins, f"{requirement} (pyproject.toml) is missing from workflow/envs/bench.yaml"
    assert "torch" not in pins, "torch from pip would be a CUDA wheel on CPU nodes; conda-forge's pytorch is not"


def selected(config: pytest.Config) -> bool:
    return re.search(r"(?<!not )\bslurm\b", config.getoption("markexpr") or "") is not None


def needs_the_local_cluster(request) -> None:
    """Skip, saying why, unless the packages are there, the test was selected (minutes of a real cluster) and we
    are root (slurmctld and slurmd run as root)."""
    if missing := missing_tools():
        pytest.skip(f"SLURM packages not installed ({' '.join(missing)} missing): apt-get install {PACKAGES}, "
                    "or make test-slurm")
    if not selected(request.config):
        pytest.skip("a real SLURM cluster, minutes end to end: runs when selected (pytest -m slurm; make test-slurm)")
    if os.geteuid() != 0:
        pytest.skip("the local SLURM cluster runs slurmctld and slurmd as root")


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.timeout(2000)
def test_smoke_matrix_through_the_slurm_profile_on_a_real_cluster(request, tmp_path, monkeypatch):
    needs_the_local_cluster(request)
    if not PLUGIN:
        pytest.skip("snakemake-executor-plugin-slurm is not installed: pip install -e '.[slurm]' (make test-slurm)")
    # Not tmp_path: pytest's is private to root, and munged and mariadbd run as their own users.
    cluster = LocalSlurm(Path(tempfile.mkdtemp(prefix="rb-slurm-")), nodes=2)
    results = tmp_path / "results"
    try:
        started = time.monotonic()
        cluster.up(timeout_s=120)
        up_s = time.monotonic() - started
        for var, value in (("SLURM_CONF", cluster.conf), ("SBATCH_ACCOUNT", ACCOUNT), ("SBATCH_PARTITION", PARTITION)):
            monkeypatch.setenv(var, str(value))
        done = snakemake_slurm("--config", "matrix=smoke", f"results={results}", "--slurm-logdir",
                               str(tmp_path / "slurm-jobs"), timeout=1800)
        run_s = time.monotonic() - started - up_s
        assert done.returncode == 0, done.stdout[-6000:]
        # Every cell ran, recovered and matched its reference, and the report was made.
        summary = pd.read_csv(results / "summary.csv")
        assert len(summary) == 4 and set(summary["state"]) <= {"ok", "noisy"}, summary[["cell", "state", "error"]]
        assert summary["matches_reference"].tolist() == [True] * 4
        assert (results / "report" / "index.html").stat().st_size > 10_000
        # As batch jobs of the test account and partition, each COMPLETED according to SLURM's accounting (what
        # the executor plugin polls); the light rules ran on the submit node.
        jobs = [line.split("|") for line in cluster.run("sacct", "-X", "-n", "--parsable2", "-o",
                                                        "JobID,State,Account,Partition,ExitCode").stdout.split()]
        assert len(jobs) == 5 and {tuple(j[1:]) for j in jobs} == {("COMPLETED", ACCOUNT, PARTITION, "0:0")}, jobs
        submitted = re.findall(r"has been submitted with SLURM jobid (\d+)", done.stdout)
        assert sorted(submitted, key=int) == [j[0] for j in jobs], done.stdout[-3000:]
        for rule in ("aggregate", "project", "report"):
            assert re.search(rf"^localrule {rule}:$", done.stdout, re.MULTILINE), done.stdout[-3000:]
        print(f"SLURM smoke: cluster up in {up_s:.0f} s, smoke matrix through profiles/slurm in {run_s:.0f} s")
        reference = summary.loc[summary["is_reference"].astype(bool), "final_state_sha256"].unique()
        multinode_across_two_nodes(cluster, results, reference, tmp_path)
    finally:
        left = cluster.down(timeout_s=60)
        shutil.copytree(cluster.root / "log", tmp_path / "slurm-logs", dirs_exist_ok=True)  # for a failure
        shutil.rmtree(cluster.root, ignore_errors=True)
    assert left == [], f"still running after the cluster stopped: {left}"
    assert processes_mentioning(str(cluster.root)) == [] and processes_mentioning(str(results)) == []


# The smoke matrix's killed sync cell, as one experiment across two nodes (one rank each); the thread count of the
# matrix's cells, since two "nodes" on one host would each resolve all its cores (README, Determinism).
MULTINODE = ("strategy=sync fault=kill fault.rank=1 fault.at_step=7 fault.phase=before_forward steps=12 "
             "checkpoint.every=4 detector=[process_exit] recovery=restart seed=0 threads_per_rank=1")


def multinode_across_two_nodes(cluster: LocalSlurm, results: Path, reference, tmp_path: Path) -> None:
    """rule multinode through profiles/slurm: one job of two nodes whose job step runs a task (torchrun) on each;
    rank 1 is killed and the run recovers to the smoke reference's final state, bit for bit."""
    started = time.monotonic()
    done = snakemake_slurm("multinode", "--config", "matrix=smoke", f"results={results}", f"multinode={MULTINODE}",
                           "nodes=2", "nproc_per_node=1", "--slurm-logdir", str(tmp_path / "slurm-jobs"),
                           timeout=900)
    assert done.returncode == 0, done.stdout[-6000:]
    (result,) = (results / "multinode").glob("2x1-*/result.json")
    r = json.loads(result.read_text())
    assert r["status"] == "ok" and r["recovered"] and r["world_size"] == 2, r
    assert len(reference) == 1 and r["final_state_sha256"] == reference[0]
    job = re.search(r"has been submitted with SLURM jobid (\d+)", done.stdout).group(1)
    steps = [line.split("|") for line in cluster.run("sacct", "-j", job, "-n", "--parsable2", "-o",
                                                     "JobID,State,NNodes,NTasks,NodeList").stdout.split()]
    assert [f"{job}.0", "COMPLETED", "2", "2", "rb[1-2]"] in steps, steps  # one task on each node
    assert re.search(r"^multinode 2x1-\w+ \(2 node\(s\) x 1 rank\(s\)\): ok, recovered True", done.stdout,
                     re.MULTILINE), done.stdout[-2000:]
    print(f"SLURM multinode: one run across two nodes in {time.monotonic() - started:.0f} s")


# A whole job cancelled by the scheduler and the run resumed by a new batch job: the dependent-job pattern
# (docs/pipeline.md, SLURM). Both jobs run the same command line; resume=auto starts the run in the first and
# resumes it in the second, in a run directory the command names (not the clock).
RESUMED = ("strategy=sync", "fault=none", "workload=gpt_tiny", "world_size=2", "steps=60", "checkpoint.every=5",
           "seed=0", "detector=[process_exit]", "threads_per_rank=1")


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.timeout(900)
def test_a_job_cancelled_with_scancel_is_resumed_by_a_dependent_job_bit_exact(request, tmp_path):
    needs_the_local_cluster(request)
    from conftest import run_experiment
    from resilience.record.events import read_events

    fault_free = run_experiment(tmp_path / "fault-free", "strategy=none", *RESUMED[1:])
    cluster = LocalSlurm(Path(tempfile.mkdtemp(prefix="rb-slurm-")), nodes=1)
    run_dir = tmp_path / "run"
    command = " ".join([sys.executable, "-m", "resilience", *RESUMED, "resume=auto", f"hydra.run.dir={run_dir}"])

    def sbatch(*options: str) -> str:
        done = cluster.run("sbatch", "--parsable", f"--account={ACCOUNT}", f"--partition={PARTITION}",
                           f"--chdir={ROOT}", *options, "--wrap", command)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip().split(";")[0]

    def state(job: str) -> str:
        out = cluster.run("sacct", "-X", "-n", "--parsable2", "-j", job, "-o", "State").stdout.split()
        return out[0] if out else ""

    try:
        cluster.up(timeout_s=120)
        first = sbatch("-o", str(tmp_path / "first.out"))
        second = sbatch("-o", str(tmp_path / "second.out"), f"--dependency=afterany:{first}")
        deadline = time.monotonic() + 300
        while not any(e["kind"] == "ckpt_durable" and e["step"] >= 10 for e in read_events(run_dir)):
            assert time.monotonic() < deadline, (tmp_path / "first.out").read_text()
            time.sleep(0.2)
        assert cluster.run("scancel", first).returncode == 0
        deadline = time.monotonic() + 600
        while state(second) not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
            assert time.monotonic() < deadline, f"job {second}: {state(second)}"
            time.sleep(1)
        assert state(first).startswith("CANCELLED") and state(second) == "COMPLETED", (state(first), state(second))
    finally:
        left = cluster.down(timeout_s=60)
        shutil.rmtree(cluster.root, ignore_errors=True)
    assert left == []
    said = (tmp_path / "second.out").read_text()
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "ok" and result["final_state_sha256"] == fault_free["final_state_sha256"], said
    (restart,) = result["job_restarts"]
    assert result["jobs"] == 2 and restart["loaded_step"] >= 10 and f"resumed from step {restart['loaded_step']}\n" \
        in said
    assert processes_mentioning(str(run_dir)) == []
    print(f"SLURM scancel + dependent job: resumed from step {restart['loaded_step']} (died at step "
          f"{restart['died_at_step']}, lost {restart['lost_steps']}); back in {restart['job_restart_s']:.1f} s")
