"""Shared helpers: run the experiment command as a user would, and check that it leaves nothing behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from resilience.proc import child, pool
from resilience.proc.child import processes_mentioning
from resilience.ckpt.shm_store import SHM_DIR, run_id
from resilience.record.environment import ENV_VAR
from resilience.record.reference import INDEX_VAR as REFERENCE_INDEX_VAR

# One run id for the whole session, set before any test starts a process: DLRover's in-process saver names its
# sockets and segments by it (tests/test_rejected_load.py), and the multiprocessing fork server, shared by every
# test of this process (the data loader's workers, DLRover's saver), keeps the environment it was started with:
# a run id set later by one test would not reach a saver forked from a server another test started.
os.environ.setdefault("TORCHELASTIC_RUN_ID", f"rbtest{os.getpid()}")
# Every rank start after a run's first is forked from the run's preloaded interpreter (supervisor.restarts, in
# conf/config.yaml), not a cold interpreter: ~2.5 s less per restart, and a restart's correctness does not depend on
# how its process started. Its time does: tests of the cold path (test_pool.py, test_zygote.py) name
# supervisor.restarts=cold.
os.environ.setdefault("RB_RESTARTS", "preloaded")
# The pipelines' probe writes 128 MiB disk samples, not 1 GiB (reports/limits.py): seconds less per pipeline run.
os.environ.setdefault("RB_PROBE_MB", "128")

ROOT = Path(__file__).resolve().parent.parent


def run_module(module: str, *args: str, timeout: float, merge_stderr: bool = False,
               cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``python -m MODULE ARGS`` (from ``cwd``: the repository root) in its own process group; killed whole on
    timeout."""
    # the experiment's command forked from the session's preloaded interpreter when there is one (``preloaded``)
    cmd = pool.command(module, list(args)) if module == pool.SUPERVISOR else [sys.executable, "-m", module, *args]
    done = child.run(cmd, timeout_s=timeout, cwd=cwd, merge_stderr=merge_stderr)
    if done.timed_out:
        pytest.fail(f"python -m {module} {' '.join(args)} ran over {timeout} s\n{done.stdout[-5000:]}\n{done.stderr}")
    return subprocess.CompletedProcess(cmd, done.returncode, done.stdout, done.stderr)


def run_cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """``python -m resilience ARGS``."""
    return run_module("resilience", *args, timeout=timeout)


def run_experiment(run_dir: Path, *overrides: str, timeout: float = 180) -> dict:
    """Run one experiment to completion, assert the harness succeeded and left no process and no /dev/shm entry
    (the supervisor's to remove, killed ranks' included), return result.json."""
    shm_before = set(os.listdir(SHM_DIR))
    done = run_cli(*overrides, f"hydra.run.dir={run_dir}", timeout=timeout)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    left_nothing(run_dir, shm_before)
    return json.loads((run_dir / "result.json").read_text())


def of_kind(events: list[dict], kind: str, **match) -> list[dict]:
    """The events of ``kind`` whose fields equal ``match``."""
    return [e for e in events if e["kind"] == kind and all(e.get(k) == v for k, v in match.items())]


def exact(result: dict) -> None:
    """The run recovered and ended on the fault-free run's state, bit for bit."""
    assert result["status"] == "ok" and result["recovered"], result.get("error")
    assert result["reference"]["matches"] is True, result["reference"]
    assert result["final_state_sha256"] == result["reference"]["sha256"]


def left_nothing(run_dir: Path, shm_before: set[str]) -> None:
    """No process of the run in ``run_dir`` is alive, and /dev/shm holds nothing new since ``shm_before`` that no
    live process uses."""
    deadline = time.monotonic() + 10
    while processes_mentioning(str(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_mentioning(str(run_dir)) == [], "rank processes outlived the run"
    assert list(SHM_DIR.glob(f"*{run_id(run_dir)}*")) == [], "shared memory outlived the run"
    left = unused(set(os.listdir(SHM_DIR)) - shm_before)
    deadline = time.monotonic() + 3  # what a process of another job on the host holds for a moment is gone by then
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = unused(set(left))
    assert left == [], f"/dev/shm entries outlived the run: {left} (the check assumes no other job on this host " \
                       f"creates /dev/shm entries meanwhile: run the suite alone)"


def unused(names: set[str]) -> list[str]:
    """The /dev/shm entries among ``names`` that no live process maps or holds open: what a run left behind (an
    entry of another process on the host that is still in use is not the run's leftover)."""
    used: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            used |= {line.rsplit("/dev/shm/", 1)[1].removesuffix(" (deleted)")
                     for line in (proc / "maps").read_text().splitlines() if "/dev/shm/" in line}
            used |= {Path(os.readlink(fd)).name for fd in (proc / "fd").iterdir()
                     if os.readlink(fd).startswith("/dev/shm/")}
        except OSError:  # the process ended while we looked
            continue
    return sorted(n for n in names if n not in used and (SHM_DIR / n).exists())


@pytest.fixture(scope="session", autouse=True)
def shared_environment(tmp_path_factory):
    """Every run of the session names one environment.json, captured by the first (torch.utils.collect_env costs
    0.4-4 s a run), as pipeline cells name their probe snapshot's."""
    os.environ[ENV_VAR] = str(tmp_path_factory.mktemp("environment") / "environment.json")  # children inherit it
    os.environ[REFERENCE_INDEX_VAR] = str(tmp_path_factory.mktemp("references"))  # not the project's results/
    yield
    os.environ.pop(ENV_VAR, None)
    os.environ.pop(REFERENCE_INDEX_VAR, None)


@pytest.fixture(scope="session", autouse=True)
def preloaded():
    """Every experiment command of the session (``run_cli``, and those the benches and tools it runs start:
    ``child.experiment_command``) forked from one preloaded interpreter, as a pipeline's cells are
    (``resilience.proc.pool``): ~2 s and ~3.5 s of CPU less a run, of the ~2 s its supervisor and zygote spend
    importing before the first step. A run's result does not depend on how its supervisor started (tests/
    test_pool.py holds a forked one to the cold one's state, bit for bit); its start's time does, and the tests
    of the cold path start cold by name (test_pool.py, test_zygote.py). ``RB_TEST_COLD=1`` runs every command of
    the session cold instead."""
    started = None if os.environ.get("RB_TEST_COLD") == "1" else pool.Pool.start()
    yield started
    if started is not None:
        started.stop()


@pytest.fixture(scope="session")
def runs_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="session")
def reference(runs_root) -> dict:
    """The fault-free run that recovered runs must match bit for bit (tests/test_pool.py holds a cold run of the same
    training to it, bit for bit: two fault-free runs agree)."""
    ref = run_experiment(runs_root / "reference", "strategy=sync", "fault=none", "steps=30", "checkpoint.every=5",
                         "world_size=2", "seed=0")
    # every detector of the default set on (conf/config.yaml), and no fault: none of them may raise an alarm
    assert ref["status"] == "ok" and not ref["fault_injected"] and ref["false_alarms"] == 0, ref
    return ref


# gpt_tiny on 2 ranks, 12 steps: the replayable loop (tests/test_jit.py, tests/test_job_resume.py) and the real one,
# with dropout for the RNG streams to matter (tests/test_job_state.py, tests/test_preempt.py)
SHORT = ("workload=gpt_tiny", "world_size=2", "steps=12", "checkpoint.every=4", "seed=0", "detector=[process_exit]")
# checkpoint.every=1: the real loop hashes its parts at every checkpoint step, so the reference has a hash at every
# step a run with any interval checks (its loads included; resilience/record/job_state.py)
SHORT_REAL = (*SHORT[:3], "checkpoint.every=1", *SHORT[4:], "train=real", "workload.dropout=0.1")


@pytest.fixture(scope="session")
def fault_free_run(tmp_path_factory) -> Callable[..., dict]:
    """``fault_free_run(*training)``: the fault-free run of a training (``strategy=none fault=none``), once for the
    session. It records itself as its training's reference (resilience/record/reference.py): a later run of that
    training with ``reference.check=run`` finds it there instead of running its own first, seconds a test."""
    runs: dict[tuple[str, ...], dict] = {}

    def of(*training: str) -> dict:
        if training not in runs:
            runs[training] = run_experiment(tmp_path_factory.mktemp("fault-free") / "run", "strategy=none",
                                            "fault=none", *training)
        return runs[training]

    return of


# A pipeline of 2 stages on 2 ranks (tests/test_pipeline_parallel.py, tests/test_swift_log.py)
PP = ("parallel=pp", "world_size=2", "workload=gpt_tiny", "steps=12", "seed=0", "detector=[process_exit]")


@pytest.fixture(scope="session")
def pp_reference(tmp_path_factory) -> dict:
    """``PP``'s fault-free run (strategy=none: the reference of its training, recorded for the runs that follow)."""
    ref = run_experiment(tmp_path_factory.mktemp("pp-ref"), *PP, "strategy=none", "fault=none", timeout=300)
    assert ref["status"] == "ok" and ref["replicas_agree"]  # every rank ends on the hash over both stages
    return ref


# End-to-end modules: every test starts real rank processes (seconds each). `pytest -m "not slow"` leaves them out,
# with every test that needs a finished run (the session's reference run), for a fast round of the rest.
E2E_MODULES = {"test_faults", "test_recovery", "test_replica", "test_extend", "test_pipeline", "test_parity", "test_peers",
               "test_replica_torchft", "test_nvrx_heartbeat", "test_torchrun"}


def pytest_addoption(parser) -> None:
    tier = parser.getgroup("tier", "which tests run (tests/tiers.py)")
    tier.addoption("--long", action="store_true", help="only the long tier (make test-long)")
    tier.addoption("--all", action="store_true", help="both tiers: CI's set and the long one")


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        code = getattr(getattr(item, "function", None), "__code__", None)
        runs = code is not None and "run_experiment" in code.co_names
        if item.module.__name__ in E2E_MODULES or runs or {"reference", "runs_root", "fault_free_run"} & set(
                item.fixturenames):
            item.add_marker(pytest.mark.slow)
    _choose_tier(config, items)


def _choose_tier(config, items) -> None:
    """CI's set by default, the long tier with ``--long``, both with ``--all``; a test named on the command line
    runs whatever its tier. Collecting the whole suite, every entry of ``tiers.LONG`` must name a test."""
    from tiers import LONG

    ids = {item.nodeid for item in items}
    if {Path(a).resolve() for a in config.args} == {ROOT / "tests"}:
        stale = sorted(set(LONG) - ids)
        if stale:
            raise pytest.UsageError(f"tests/tiers.py names {len(stale)} test(s) that do not exist: {stale[0]}")
    if config.getoption("all"):
        return
    named = tuple(a for a in config.args if "::" in a)
    keep = [i for i in items if (i.nodeid in LONG) == config.getoption("long")
            or any(i.nodeid == a or i.nodeid.startswith(a + "[") for a in named)]
    if len(keep) < len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep


# The sharded end-to-end tests' settings: gpt_tiny on 4 ranks, short (tests/test_sharded*.py).
SHARDED = ("world_size=4", "workload=gpt_tiny", "steps=12", "checkpoint.every=4", "seed=0", "detector=[process_exit]")


@pytest.fixture(scope="session")
def sharded_fault_free(tmp_path_factory):
    """The fault-free run's final hash per ``parallel`` setting on ``SHARDED``'s settings, run once for the session
    (ours and the libraries' sharded tests share it): the strategy does not touch the training state, so every
    strategy's fault-free run ends on the same hash (docs/sharded.md). ``strategy=none``, as the sharded matrix's
    reference cells: no save on the training path (three sharded saves of 4 ranks less than sync's, seconds)."""
    hashes: dict[str, str] = {}

    def of(parallel: str) -> str:
        if parallel not in hashes:
            ref = run_experiment(tmp_path_factory.mktemp(f"ref-{parallel}"), f"parallel={parallel}", "strategy=none",
                                 "fault=none", *SHARDED, timeout=400)
            hashes[parallel] = ref["final_state_sha256"]
        return hashes[parallel]

    return of


def checked(tmp_path, overrides) -> None:
    """Check a configuration as the command checks it before anything starts (``ConfigError`` where refused)."""
    from resilience.__main__ import precheck
    from resilience.config import check_group_choices

    argv = [*overrides, f"hydra.run.dir={tmp_path / 'run'}"]
    check_group_choices(argv)
    precheck(argv)


def refusal(tmp_path, overrides) -> str:
    """The error a configuration is refused with, checked as the command checks it before anything starts."""
    from resilience.config import ConfigError

    with pytest.raises(ConfigError) as info:
        checked(tmp_path, overrides)
    return str(info.value)


def sigkill_seen(events: list[dict]) -> None:
    """Rank 1 SIGKILLed: the supervisor's verdict blames it, and the survivor's attempt ends at once (its collective
    fails; if the supervisor stops it first, the restart marks its end)."""
    fault = next(e for e in events if e["kind"] == "fault_injected")
    detected = next(e for e in events if e["kind"] == "fault_detected" and e["t_mono"] >= fault["t_mono"])
    assert detected["value"]["1"] == "SIGKILL" and detected["blamed_rank"] == 1
    ended = [e["t_mono"] for e in events if (e["kind"] == "rank_error" and e["rank"] == 0 and e["attempt"] == 0)
             or e["kind"] == "restart"]
    assert min(ended) - fault["t_mono"] < 2.0
