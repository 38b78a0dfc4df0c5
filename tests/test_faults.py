"""Each fault, through the real command on 2 gloo ranks: what the training processes really experience.

A scenario table (fault, parameters, expected observable) drives the tests; every run must also leave no process
(stopped or not) behind, which ``run_experiment`` checks. The gil hang and the pre-reduce flip are exercised by
``python -m resilience.bench.coverage`` instead, to keep the suite short.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch.distributed.checkpoint as dcp

from conftest import run_experiment, sigkill_seen
from resilience.record.events import read_events
from resilience.ckpt.commit import CheckpointDir

COMMON = ("steps=20", "checkpoint.every=5", "world_size=2", "seed=0", "timeouts.collective_s=3")


def first(events: list[dict], kind: str, **match) -> dict:
    return next(e for e in events if e["kind"] == kind and all(e.get(k) == v for k, v in match.items()))


def kill_observed(run: Path, result: dict, reference: dict) -> None:
    sigkill_seen(read_events(run))
    # ... and sync brings it back from the step-5 checkpoint, bit-exact
    assert result["lost_steps"] == 2 and result["detected_rank_correct"]
    recovered_bit_exact(run, result, reference)


def stall_times_out(run: Path, result: dict) -> None:
    ev = read_events(run)
    fault = first(ev, "fault_injected")
    survivor = first(ev, "rank_error", rank=0, attempt=0)
    waited = survivor["t_mono"] - fault["t_mono"]
    assert 2.0 <= waited <= 3.0 + 4.0, waited  # about timeouts.collective_s=3


def recovered_bit_exact(run: Path, result: dict, reference: dict) -> None:
    assert result["recovered"] and result["final_state_sha256"] == reference["final_state_sha256"]


def slow_save(run: Path, result: dict) -> None:
    ev = read_events(run)
    rank1_bytes = sum(p.stat().st_size for p in (run / "ckpt").glob("step_*/__1_*.distcp")) / 2  # 2 kept
    slowest = max(e["t_mono"] - first(ev, "ckpt_begin", rank=0, step=e["step"])["t_mono"]
                  for e in ev if e["kind"] == "ckpt_durable")
    assert slowest >= rank1_bytes / 10e6  # fault.mbps=10


def enospc_keeps_previous(run: Path, result: dict) -> None:
    ev = read_events(run)
    assert [e["step"] for e in ev if e["kind"] == "ckpt_durable"] == [5]
    assert {e["step"] for e in ev if e["kind"] == "ckpt_failed"} == {10, 15}
    entry = CheckpointDir(run / "ckpt").newest_committed()
    assert entry.step == 5
    metadata = dcp.FileSystemReader(entry.path).read_metadata()
    assert any(k.startswith("model.") for k in metadata.state_dict_metadata)


def diverged(run: Path, result: dict) -> None:
    assert result["status"] == "ok" and not result["replicas_agree"]  # silent: nothing noticed, replicas differ


SCENARIOS: list[tuple[str, tuple[str, ...], Callable]] = [
    ("kill", ("fault=kill", "fault.at_step=7"), kill_observed),
    ("hang-stall", ("fault=hang", "fault.mode=stall", "fault.at_step=7"), stall_times_out),
    ("hang-sigstop", ("fault=hang", "fault.mode=sigstop", "fault.at_step=7"), recovered_bit_exact),
    ("node_loss", ("fault=node_loss", "ranks_per_node=1", "fault.at_step=12"), recovered_bit_exact),
    ("torn_write", ("fault=slow_disk", "fault.mode=torn_write", "fault.at_step=6"), recovered_bit_exact),
    ("slow_disk", ("fault=slow_disk", "fault.mbps=10"), slow_save),
    ("enospc", ("fault=slow_disk", "fault.mode=enospc", "fault.at_step=6", "fault.budget_mb=1"),
     enospc_keeps_previous),
    ("bitflip-weights", ("fault=bitflip", "fault.target=weights", "fault.at_step=7"), diverged),
]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name,overrides,check", SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_fault_scenario(tmp_path, short_reference, name, overrides, check):
    run = tmp_path / "run"
    result = run_experiment(run, "strategy=sync", *overrides, *COMMON)
    assert result["fault_injected"], name
    if check in (recovered_bit_exact, kill_observed):
        check(run, result, short_reference)
    else:
        check(run, result)


@pytest.fixture(scope="module")
def short_reference(tmp_path_factory) -> dict:
    """strategy=none: the final state is the training's whatever the strategy (the runs here use sync), and this
    one records itself as the reference of gpt_tiny's 20 steps on 2 ranks, which tests/test_shadow.py's
    reference.check=run then finds instead of running it again."""
    return run_experiment(tmp_path_factory.mktemp("ref") / "run", "strategy=none", "fault=none", *COMMON)
