"""The atomic commit, checkpoint listing and pruning, and interoperability with plain DCP."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from hydra.utils import instantiate
from omegaconf import OmegaConf

from conftest import ROOT
from resilience.state import TrainState, state_sha256
from resilience.ckpt.commit import COMMIT_MARKER, CheckpointDir


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
