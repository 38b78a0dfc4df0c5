"""Checkpoint strategies sync, async (CheckFreq-style) and dcp_async: round trips, snapshot consistency, background
failures, incomplete checkpoints, the when_busy policy, the dlrm_emb workload, and kill-and-recover end to end."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict_saver as dcp_saver
from hydra.utils import instantiate
from omegaconf import OmegaConf

from conftest import ROOT, run_cli, run_experiment
from resilience.record.events import EventLog, read_events
from resilience.runtime.rank import RankRuntime
from resilience.state.train import TrainState, state_sha256
from resilience.strategies.async_ckpt import AsyncCheckpoint
from resilience.strategies.background import PersistError
from resilience.ckpt.commit import CheckpointDir
from resilience.strategies.dcp_async import DcpAsyncCheckpoint
from resilience.ckpt.snapshot import HostSnapshot, assign_shares, flat_tensors
from resilience.strategies.sync import SyncCheckpoint

CPU = torch.device("cpu")
STRATEGIES = [SyncCheckpoint, AsyncCheckpoint, DcpAsyncCheckpoint]
BACKGROUND = [AsyncCheckpoint, DcpAsyncCheckpoint]


@pytest.fixture(scope="module", autouse=True)
def one_rank_group(tmp_path_factory):
    """A one-rank gloo process group in this process: the strategies' collectives run for real."""
    assert not dist.is_initialized()
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def workload(name: str = "gpt_tiny", **overrides):
    cfg = OmegaConf.load(ROOT / "conf" / "workload" / f"{name}.yaml")
    return instantiate(OmegaConf.merge(cfg, overrides), seed=0)


def train(state: TrainState, wl, steps: range) -> None:
    for step in steps:
        torch.manual_seed(step)
        wl.loss(state.model, wl.batch(step, 0, CPU)).backward()
        state.optimizer.step()
        state.optimizer.zero_grad(set_to_none=True)


def fresh_state(wl) -> TrainState:
    model = wl.build_model()
    return TrainState(model, wl.build_optimizer(model))


def attached(cls, tmp_path, hook=None, **kwargs):
    tmp_path.mkdir(parents=True, exist_ok=True)
    events = EventLog(tmp_path, 0, 0)
    rt = RankRuntime(rank=0, world_size=1, device=CPU, run_dir=tmp_path, ckpt_dir=tmp_path / "ckpt",
                     events=events, fault_hook=hook or (lambda phase, step: None))
    strategy = cls(every=5, keep=2, **kwargs)
    strategy.attach(rt)
    return strategy


def trained(steps: int = 5):
    """The gpt_tiny workload and a state trained ``steps`` steps."""
    wl = workload()
    state = fresh_state(wl)
    train(state, wl, range(steps))
    return wl, state


def kinds(tmp_path) -> list[tuple[str, int]]:
    return [(e["kind"], e["step"]) for e in read_events(tmp_path)]


@pytest.fixture
def held_persist(monkeypatch):
    """Hold every DCP save (async's thread and async_save's executor) until ``release`` is set."""
    release = threading.Event()
    started = threading.Event()
    real = dcp_saver.save

    def held(*args, **kwargs):
        started.set()
        assert release.wait(30), "test never released the persist"
        return real(*args, **kwargs)

    monkeypatch.setattr(dcp, "save", held)
    monkeypatch.setattr(dcp_saver, "save", held)
    yield started, release
    release.set()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cls", STRATEGIES, ids=lambda c: c.name)
def test_save_load_round_trip(tmp_path, cls):
    wl, state = trained()
    expected = state_sha256(state.state_dict())
    strategy = attached(cls, tmp_path)
    strategy.save(5, 100, state)
    strategy.wait()
    strategy.close()
    assert ("ckpt_durable", 5) in kinds(tmp_path) and ("ckpt_stall_end", 5) in kinds(tmp_path)

    restored = fresh_state(wl)
    again = attached(cls, tmp_path)
    assert again.load(restored) == 5
    assert state_sha256(restored.state_dict()) == expected
    again.close()


def test_snapshot_holds_the_state_of_its_step_while_training_goes_on():
    wl = workload()
    state = fresh_state(wl)
    train(state, wl, range(2))
    before = {k: t.clone() for k, (t, _) in flat_tensors(state.state_dict()).items()}
    snap = HostSnapshot(rank=0, world_size=1)
    taken = flat_tensors(snap.capture(state.state_dict()))
    train(state, wl, range(2, 4))
    assert taken.keys() == before.keys()
    assert all(torch.equal(taken[k][0], before[k]) for k in before)
    live = flat_tensors(state.state_dict())
    assert not all(torch.equal(live[k][0], before[k]) for k in before)  # training really moved on
    buffers = {k: t.data_ptr() for k, (t, _) in taken.items()}
    again = flat_tensors(snap.capture(state.state_dict()))
    assert {k: t.data_ptr() for k, (t, _) in again.items()} == buffers  # reused, not reallocated


def test_shares_partition_the_state_between_ranks():
    sd = fresh_state(workload()).model.state_dict()
    sizes = {k: t.numel() * t.element_size() for k, t in sd.items()}
    owner = assign_shares(sizes, 2)
    assert owner.keys() == sizes.keys() and owner == assign_shares(dict(reversed(sizes.items())), 2)
    loads = [sum(sizes[k] for k in sizes if owner[k] == r) for r in (0, 1)]
    assert abs(loads[0] - loads[1]) <= max(sizes.values())
    shares = [HostSnapshot(r, 2) for r in (0, 1)]
    keys = [set(flat_tensors(s.capture(sd))) for s in shares]
    assert keys[0].isdisjoint(keys[1]) and keys[0] | keys[1] == set(sd)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cls", BACKGROUND, ids=lambda c: c.name)
def test_checkpoint_is_the_state_at_its_step_even_if_written_later(tmp_path, cls, held_persist):
    started, release = held_persist
    wl, state = trained()
    at_5 = state_sha256(state.state_dict())
    strategy = attached(cls, tmp_path)
    strategy.save(5, 100, state)
    assert started.wait(10)
    train(state, wl, range(5, 8))  # parameters change in place while the checkpoint of step 5 is pending
    release.set()
    strategy.wait()
    restored = fresh_state(wl)
    assert attached(cls, tmp_path).load(restored) == 5
    assert state_sha256(restored.state_dict()) == at_5 != state_sha256(state.state_dict())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cls", BACKGROUND, ids=lambda c: c.name)
def test_failed_background_persist_surfaces_from_wait(tmp_path, cls):
    def broken_disk(phase, step):
        if phase == "during_checkpoint":
            raise OSError(28, "No space left on device (injected)")

    wl, state = trained()
    strategy = attached(cls, tmp_path, hook=broken_disk)
    strategy.save(5, 100, state)  # returns: the failure happens in the background
    with pytest.raises(PersistError, match="No space left on device"):
        strategy.wait()
    assert ("ckpt_failed", 5) in kinds(tmp_path) and ("ckpt_durable", 5) not in kinds(tmp_path)
    assert CheckpointDir(tmp_path / "ckpt").newest_committed() is None
    strategy.close()


@pytest.mark.timeout(60)
def test_failed_persist_stops_training_at_the_next_checkpoint(tmp_path):
    (tmp_path / "ckpt").write_text("not a directory")  # the persist cannot create step_00000005/
    wl, state = trained()
    strategy = attached(AsyncCheckpoint, tmp_path)
    strategy.save(5, 100, state)
    deadline = time.monotonic() + 10
    while not any(k == "ckpt_failed" for k, _ in kinds(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(PersistError, match="checkpoint of step 5 failed") as failure:
        strategy.save(10, 100, state)
    assert isinstance(failure.value.__cause__, OSError)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cls", BACKGROUND, ids=lambda c: c.name)
def test_incomplete_checkpoint_is_ignored(tmp_path, cls):
    wl, state = trained()
    expected = state_sha256(state.state_dict())
    strategy = attached(cls, tmp_path)
    strategy.save(5, 100, state)
    strategy.wait()
    half = CheckpointDir(tmp_path / "ckpt").prepare(10)  # a later save that died before its commit
    (half / "__0_0.distcp").write_bytes(os.urandom(1000))
    restored = fresh_state(wl)
    assert attached(cls, tmp_path).load(restored) == 5
    assert state_sha256(restored.state_dict()) == expected
    assert ("ckpt_incomplete", 10) in kinds(tmp_path)


@pytest.mark.timeout(60)
def test_when_busy_skip_and_wait(tmp_path, held_persist):
    started, release = held_persist
    wl, state = trained()
    skipper = attached(AsyncCheckpoint, tmp_path / "skip", when_busy="skip")
    skipper.save(5, 100, state)
    assert started.wait(10)
    t0 = time.monotonic()
    skipper.save(10, 100, state)  # the step-5 persist is still held: this checkpoint is skipped at once
    assert time.monotonic() - t0 < 1 and ("ckpt_skipped", 10) in kinds(tmp_path / "skip")
    release.set()
    skipper.wait()
    assert CheckpointDir(tmp_path / "skip" / "ckpt").newest_committed().step == 5

    release.clear()
    waiter = attached(AsyncCheckpoint, tmp_path / "wait", when_busy="wait")
    waiter.save(5, 100, state)
    threading.Timer(0.5, release.set).start()
    t0 = time.monotonic()
    waiter.save(10, 100, state)  # waits for the step-5 persist: part of the stall
    assert time.monotonic() - t0 >= 0.4
    waiter.wait()
    assert [e.step for e in CheckpointDir(tmp_path / "wait" / "ckpt").entries()] == [5, 10]


def test_when_busy_is_validated():
    with pytest.raises(ValueError, match="strategy.when_busy=x: must be one of wait, skip"):
        AsyncCheckpoint(every=5, keep=2, when_busy="x")
    with pytest.raises(ValueError, match="strategy.timeout_s=0"):
        DcpAsyncCheckpoint(every=5, keep=2, timeout_s=0)


@pytest.mark.timeout(60)
def test_cli_rejects_bad_when_busy(tmp_path):
    done = run_cli("strategy=async", "strategy.when_busy=later", f"hydra.run.dir={tmp_path}", timeout=60)
    assert done.returncode == 2
    assert "strategy.when_busy=later: must be one of wait, skip" in done.stderr


@pytest.mark.timeout(120)
def test_dlrm_state_is_over_1gb_and_a_step_is_fast():
    wl = workload("dlrm_emb")
    state = fresh_state(wl)
    sd = state.state_dict()  # Adagrad's state exists from the start: this must not step the optimizer
    nbytes = sum(t.numel() * t.element_size() for t, _ in flat_tensors(sd).values())
    assert nbytes >= 1 << 30 and wl.state_bytes() <= nbytes
    assert all(int(s["step"]) == 0 for s in state.optimizer.state.values())
    times = []
    for step in range(4):
        t0 = time.perf_counter()
        train(state, wl, range(step, step + 1))
        times.append(time.perf_counter() - t0)
    assert min(times[1:]) < 0.5, times
    assert state.model.emb[0].weight.grad is None


def test_dlrm_batches_are_pure_and_sparse_gradients_learn():
    wl = workload("dlrm_emb", rows=2000, tables=3)
    a, b = wl.batch(7, 1, CPU), workload("dlrm_emb", rows=2000, tables=3).batch(7, 1, CPU)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(wl.batch(7, 0, CPU)[1], a[1])
    assert a[1].max() < 2000 and set(a[2].unique().tolist()) <= {0.0, 1.0}
    state = fresh_state(wl)
    loss = wl.loss(state.model, wl.batch(0, 0, CPU))
    loss.backward()
    assert state.model.emb[0].weight.grad.is_sparse
    state.optimizer.zero_grad(set_to_none=True)
    losses = []
    for step in range(200):
        loss = wl.loss(state.model, wl.batch(step, 0, CPU))
        loss.backward()
        state.optimizer.step()
        state.optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert sum(losses[-50:]) < sum(losses[:50]) * 0.95


COMMON = ("steps=30", "checkpoint.every=5", "world_size=2", "seed=0")
E2E = [
    ("async", "before_forward", 13, 3),
    ("async", "during_checkpoint", 15, 5),
    ("dcp_async", "before_forward", 13, 3),
    ("dcp_async", "during_checkpoint", 15, 5),
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy,phase,at_step,lost", E2E, ids=[f"{s}-{p}" for s, p, _, _ in E2E])
def test_kill_and_recover_bit_exact(tmp_path, reference, strategy, phase, at_step, lost):
    result = run_experiment(tmp_path / "run", f"strategy={strategy}", "fault=kill", "fault.rank=1",
                            f"fault.at_step={at_step}", f"fault.phase={phase}", *COMMON)
    assert result["status"] == "ok" and result["recovered"]
    assert result["lost_steps"] == lost
    assert result["replicas_agree"]
    assert result["final_state_sha256"] == reference["final_state_sha256"]
    assert result["ckpt_stall_s"] < result["ckpt_durable_s"]  # the write happened after training went on


@pytest.mark.timeout(600)
@pytest.mark.skipif(not os.environ.get("RB_HEAVY_TESTS"), reason="set RB_HEAVY_TESTS=1 (two ~1 GB-state runs)")
def test_dlrm_async_kill_during_checkpoint_bit_exact(tmp_path):
    common = ("workload=dlrm_emb", "steps=120", "checkpoint.every=50", "world_size=2", "seed=0",
              "detector=[process_exit]")
    ref = run_experiment(tmp_path / "ref", "strategy=async", "fault=none", *common, timeout=300)
    hit = run_experiment(tmp_path / "hit", "strategy=async", "fault=kill", "fault.rank=1", "fault.at_step=100",
                         "fault.phase=during_checkpoint", *common, timeout=300)
    assert hit["status"] == "ok" and hit["recovered"] and hit["lost_steps"] == 50
    assert hit["final_state_sha256"] == ref["final_state_sha256"]
