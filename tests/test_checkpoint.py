"""The atomic commit, checkpoint listing and pruning, and interoperability with plain DCP."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hydra.utils import instantiate
from omegaconf import OmegaConf

from conftest import ROOT, run_cli
from resilience.ckpt.commit import COMMIT_MARKER, CheckpointDir
from resilience.ckpt.lock import DirectoryInUse, DirectoryLock
from resilience.settings.identity import RunIdentity
from resilience.record.events import EventLog, read_events
from resilience.runtime.rank import RankRuntime
from resilience.state.train import TrainState, state_sha256
from resilience.strategies.sync import SyncCheckpoint
from test_inmemory import attached, one_rank, trained_state  # noqa: F401 - a fixture: one gloo rank, no peers


def fake_checkpoint(dirs: CheckpointDir, step: int, commit: bool) -> None:
    path = dirs.prepare(step)
    (path / "__0_0.distcp").write_bytes(b"x" * 100)
    (path / ".metadata").write_bytes(b"m")
    if commit:
        dirs.commit(step)


def test_checkpoint_without_marker_is_never_chosen(tmp_path):
    dirs = CheckpointDir(tmp_path)
    fake_checkpoint(dirs, 5, commit=True)
    fake_checkpoint(dirs, 10, commit=False)  # e.g. killed after writing its data, before the commit
    assert dirs.newest_committed().step == 5
    assert [e.step for e in dirs.incomplete_after(5)] == [10]


def test_commit_records_sizes_and_prune_keeps_newest(tmp_path):
    dirs = CheckpointDir(tmp_path)
    for step in (5, 10, 15):
        fake_checkpoint(dirs, step, commit=True)
    fake_checkpoint(dirs, 12, commit=False)
    entry = dirs.newest_committed()
    assert dirs.size(entry) == 101
    assert (entry.path / COMMIT_MARKER).is_file()
    assert sorted(dirs.prune(keep=2)) == [5, 12]
    assert [e.step for e in dirs.entries()] == [10, 15]


def test_prepare_clears_leftovers_of_an_interrupted_save(tmp_path):
    dirs = CheckpointDir(tmp_path)
    fake_checkpoint(dirs, 15, commit=False)
    path = dirs.prepare(15)
    assert list(path.iterdir()) == []


def test_committed_checkpoint_loads_with_plain_dcp(runs_root, reference):
    """A checkpoint written by the 2-rank run loads with torch.distributed.checkpoint.load, no process group."""
    entry = CheckpointDir(runs_root / "reference" / "ckpt").newest_committed()
    assert entry is not None and entry.step == 25
    workload = instantiate(OmegaConf.load(ROOT / "conf" / "workload" / "gpt_tiny.yaml"), seed=0)
    model = workload.build_model()
    state = TrainState(model, workload.build_optimizer(model))
    before = state_sha256({"model": model.state_dict()})
    sd = state.state_dict()
    dcp.load(sd, checkpoint_id=str(entry.path))
    state.load_state_dict(sd)
    assert state_sha256({"model": model.state_dict()}) != before
    assert int(state.optimizer.state_dict()["state"][0]["step"]) == 25  # Adam's step count came back too
    assert all(torch.isfinite(p).all() for p in model.parameters())


RUN_A = RunIdentity("a" * 16, "c" * 16, 2, 8)
RUN_B = RunIdentity("b" * 16, "c" * 16, 2, 7)


def damaged(tmp_path, how: str) -> CheckpointDir:
    """Checkpoints 5 and 10 of run A, then checkpoint 10 damaged ``how``."""
    dirs = CheckpointDir(tmp_path, owner=RUN_A)
    for step in (5, 10):
        fake_checkpoint(dirs, step, commit=True)
    newest = dirs.path_for(10)
    if how == "flip":
        raw = bytearray((newest / "__0_0.distcp").read_bytes())
        raw[50] ^= 0x01
        (newest / "__0_0.distcp").write_bytes(bytes(raw))
    elif how == "truncate":
        (newest / "__0_0.distcp").write_bytes(b"x" * 99)
    elif how in ("delete_data", "delete_metadata"):
        (newest / ("__0_0.distcp" if how == "delete_data" else ".metadata")).unlink()
    elif how == "garble_commit":
        (newest / COMMIT_MARKER).write_text('{"step": 10, "files": ')
    elif how == "commit_without_checksums":
        record = json.loads((newest / COMMIT_MARKER).read_text())
        del record["sums"]
        (newest / COMMIT_MARKER).write_text(json.dumps(record))
    return dirs


@pytest.mark.parametrize("how", ["flip", "truncate", "delete_data", "delete_metadata", "garble_commit",
                                 "commit_without_checksums"])
def test_a_damaged_checkpoint_is_skipped_for_the_previous_one_without_any_detector(tmp_path, how):
    dirs = damaged(tmp_path / "ckpt", how)
    assert dirs.check(dirs.newest_committed()) is not None
    events = EventLog(tmp_path, 0, 0)
    rt = RankRuntime(rank=0, world_size=1, device=torch.device("cpu"), run_dir=tmp_path, ckpt_dir=tmp_path / "ckpt",
                     events=events, identity=RUN_A)  # no detector: no rejection report at all
    strategy = SyncCheckpoint(every=5, keep=2)
    strategy.attach(rt)
    assert strategy.choose().step == 5
    events.close()
    (rejected,) = [e for e in read_events(tmp_path) if e["kind"] == "ckpt_rejected"]
    assert rejected["step"] == 10 and rejected["reason"]


def test_another_runs_checkpoint_is_never_loaded(tmp_path):
    fake_checkpoint(CheckpointDir(tmp_path, owner=RUN_A), 10, commit=True)  # run A wrote step 10 here
    mine = CheckpointDir(tmp_path, owner=RUN_B)
    fake_checkpoint(mine, 5, commit=True)
    assert mine.check(mine.newest_committed()).startswith("written by another run")
    assert mine.check(mine.entries()[0]) is None
    assert json.loads((mine.path_for(5) / COMMIT_MARKER).read_text())["run"] == RUN_B.as_dict()


def test_a_locked_checkpoint_dir_is_refused_naming_its_owner(tmp_path):
    ckpt = tmp_path / "ckpt"
    lock = DirectoryLock(ckpt)
    lock.acquire({"run_id": "someone", "run_dir": "/elsewhere"})
    try:
        with pytest.raises(DirectoryInUse, match="someone"):
            DirectoryLock(ckpt).acquire({"run_id": "me"})
        done = run_cli("steps=2", f"checkpoint.dir={ckpt}", f"hydra.run.dir={tmp_path / 'run'}", timeout=60)
        assert done.returncode == 2 and done.stderr.count("\n") == 1
        assert "in use by another run" in done.stderr and "someone" in done.stderr and str(ckpt) in done.stderr
    finally:
        lock.release()
    DirectoryLock(ckpt).acquire({"run_id": "me"})  # released: free again (a SIGKILLed owner releases it too)


# ---- the load: one verified read --------------------------------------------------------------------------------
def sync_on(run_dir, attempt: int) -> SyncCheckpoint:
    return attached(SyncCheckpoint(every=1, keep=3), run_dir, attempt)


@pytest.mark.timeout(60)
def test_load_verifies_as_it_reads_and_never_half_loads_a_corrupt_checkpoint(one_rank):
    run_dir = one_rank
    saver = sync_on(run_dir, 0)
    state = trained_state(2)
    saver.save(2, 10, state)
    at_2 = state_sha256(state.state_dict())
    state = trained_state(3)
    saver.save(3, 10, state)
    saver.rt.events.close()
    newest = saver.dirs.path_for(3)
    shards = sorted(newest.glob("*.distcp"))
    assert len(shards) >= 2  # each rank writes its share as several files at once
    raw = bytearray(shards[-1].read_bytes())  # the last file DCP would read: the others would load first
    raw[len(raw) // 2] ^= 0x10
    shards[-1].write_bytes(bytes(raw))

    fresh = trained_state(0)
    loader = sync_on(run_dir, 1)
    assert loader.load(fresh) == 2 and state_sha256(fresh.state_dict()) == at_2
    loader.rt.events.close()
    (rejected,) = [e for e in read_events(run_dir) if e["kind"] == "ckpt_rejected"]
    assert rejected["step"] == 3 and f"checksum mismatch in {shards[-1].name}" in rejected["reason"]

    for shard in saver.dirs.path_for(2).glob("*.distcp"):  # now no checkpoint is good: nothing may be loaded
        shard.write_bytes(shard.read_bytes()[:-1])
    untouched = trained_state(1)
    before = state_sha256(untouched.state_dict())
    again = sync_on(run_dir, 2)
    assert again.load(untouched) == 0 and state_sha256(untouched.state_dict()) == before
    again.rt.events.close()
    reasons = [e["reason"] for e in read_events(run_dir) if e["kind"] == "ckpt_rejected" and e["attempt"] == 2]
    assert len(reasons) == 2 and any("bytes, the commit record says" in r for r in reasons)


@pytest.mark.timeout(60)
def test_async_reserves_its_buffers_before_the_first_checkpoint_without_stepping_the_optimizer(one_rank):
    from resilience.strategies.async_ckpt import AsyncCheckpoint

    run_dir = one_rank
    state = trained_state(0)  # Adam before its first step: no optimizer state yet
    strategy = attached(AsyncCheckpoint(every=1, keep=2), run_dir, 0)
    assert strategy.load(state) == 0
    assert not state.optimizer.state  # the layout came from a copy: the real optimizer was not stepped
    state = trained_state(1)  # the state after one step (a fresh object: the buffers depend on the layout only)
    strategy.save(1, 10, state)
    strategy.wait()
    strategy.close()
    strategy.rt.events.close()
    events = read_events(run_dir)
    (reserved,) = [e for e in events if e["kind"] == "snapshot_reserved"]
    (stall,) = [e for e in events if e["kind"] == "ckpt_stall_end"]
    assert reserved["bytes"] == stall["snapshot_bytes"] > 0 and stall["allocated_bytes"] == 0
