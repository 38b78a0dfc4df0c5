"""DLRover Flash Checkpoint with sharded state (``parallel=fsdp|hsdp``; strategies/dlrover_sharded.py): the
combinations pass the checks, our reading of DLRover's saver (when a persist is complete) and what we hand its
engine, and one kill-and-recover from DLRover's memory copy that ends bit-exact (slow)."""

from __future__ import annotations

import pickle

import pytest
import torch
from conftest import SHARDED, refusal, run_experiment
from resilience.__main__ import precheck
from resilience.config import check_group_choices
from resilience.record.events import read_events
from resilience.libs.peer import PeerLibrary

DLROVER = pytest.mark.skipif(not PeerLibrary("dlrover.trainer.torch.flash_checkpoint.ddp", "dlrover",
                                             "dlrover").installed(),
                             reason="dlrover is not installed: pip install -e '.[dlrover]'")


@pytest.mark.parametrize("overrides", [("parallel=fsdp",), ("parallel=hsdp", "world_size=4"),
                                       ("parallel=fsdp", "strategy=dlrover_flash_standalone"),
                                       ("parallel=fsdp", "strategy=dlrover_flash_shipped")])
def test_dlrover_with_sharded_state_passes_the_checks(tmp_path, overrides):
    argv = ["strategy=dlrover_flash", *overrides, f"hydra.run.dir={tmp_path / 'run'}"]
    check_group_choices(argv)
    precheck(argv)


@DLROVER
def test_a_persist_is_complete_once_the_savers_commit_removed_its_stage_directory(tmp_path):
    """Shard 0's thread names the step in the tracker before the other shards are written; DLRover's commit names
    it again once every shard reported done, then removes ``<step>.done``."""
    from resilience.libs.dlrover_sharded import STAGE_DIR, ShardedFlash

    flash = ShardedFlash.__new__(ShardedFlash)  # no engine: only the reading of the saver's files
    flash.ckpt_dir = tmp_path
    (tmp_path / STAGE_DIR / "8.done").mkdir(parents=True)
    assert not flash.persisted(8, 4) and not flash.persisted(8, 8)  # shard 0 has named it, the others are writing
    (tmp_path / STAGE_DIR / "8.done").rmdir()
    assert flash.persisted(8, 8) and not flash.persisted(8, 4)


@DLROVER
def test_a_shard_file_that_the_metadata_points_past_fails_the_persist(tmp_path):
    """Before our commit, rank 0 checks that every file the saved DCP metadata points into is there, long enough
    (the saver empties the step directory from one thread while others write into it)."""
    from dlrover.trainer.torch.flash_checkpoint.fsdp_engine import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    from resilience.libs.dlrover_sharded import ShardedFlash

    storage = {MetadataIndex("model.w", torch.Size([0])): _StorageInfo("__0_0.distcp", 0, 64),
               MetadataIndex("model.w", torch.Size([4])): _StorageInfo("__1_0.distcp", 16, 64)}
    (tmp_path / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata={}, storage_data=storage)))
    (tmp_path / "__0_0.distcp").write_bytes(bytes(64))
    (tmp_path / "__1_0.distcp").write_bytes(bytes(79))
    with pytest.raises(RuntimeError, match=r"__1_0.distcp is short \(needs 80 bytes\)"):
        ShardedFlash.check_written(tmp_path)
    (tmp_path / "__1_0.distcp").write_bytes(bytes(80))
    ShardedFlash.check_written(tmp_path)
    (tmp_path / "__0_0.distcp").unlink()
    with pytest.raises(RuntimeError, match="__0_0.distcp is missing"):
        ShardedFlash.check_written(tmp_path)


def test_the_engine_gets_our_state_as_shipped_or_flat_with_the_unsharded_values_on_rank_0(monkeypatch):
    """Patch ``unsharded_on_rank0``: ranks other than 0 hand the engine no value that is not a sharded tensor;
    every rank asks for all of them at load, and the loaded values go back where they were."""
    import resilience.libs.dlrover_layout as layout

    sd = {"model": {"w": torch.ones(2)}, "optim": {"param_groups": [{"lr": 0.1}]}, "step": 8}
    assert layout.engine_view(sd, set(), saving=True) is sd  # as shipped
    monkeypatch.setattr(layout.dist, "get_rank", lambda: 1)
    assert layout.engine_view(sd, {layout.RANK0}, saving=True) == {}  # a plain tensor is held by every rank
    view = layout.engine_view(sd, {layout.RANK0}, saving=False)
    assert set(view) == {"model.w", "optim.param_groups", "step"} and view["model.w"] is sd["model"]["w"]
    view.update({"optim.param_groups": [{"lr": 0.2}], "step": 12})  # what DCP's load puts in
    layout.write_back(sd, view, {layout.RANK0})
    assert sd["step"] == 12 and sd["optim"]["param_groups"] == [{"lr": 0.2}]


@DLROVER
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_hsdp_killed_in_a_save_restores_every_rank_from_dlrovers_memory_bit_exact(tmp_path, sharded_fault_free):
    """HSDP 2x2, rank 1 killed in the step-8 save (once its shards are in DLRover's memory and on disk, before our
    commit): every rank loads its own shards of step 8 from its segment held by the saver in the supervisor, the
    three sharded workarounds declared, and the run ends on the fault-free hash."""
    hit = run_experiment(tmp_path / "hit", "parallel=hsdp", "strategy=dlrover_flash", "fault=kill", "fault.rank=1",
                         "fault.phase=during_checkpoint", "fault.at_step=8", *SHARDED, timeout=400)
    assert hit["status"] == "ok" and hit["recovered"]
    assert hit["final_state_sha256"] == sharded_fault_free("hsdp")
    loaded = {e["rank"]: (e["source"], e["step"]) for e in read_events(tmp_path / "hit") if e["kind"] == "ckpt_loaded"}
    assert loaded == {r: ("memory", 8) for r in range(4)}, loaded
    assert hit["peer_patches"] == ["rank_in_shard_config", "unsharded_on_rank0", "twin_shards_apart"]


def test_a_shrink_of_dlrovers_sharded_state_is_refused_in_one_line(tmp_path):
    """Its memory copy holds each old rank's shards, and DLRover's saver keeps the shard count it started with."""
    line = refusal(tmp_path, ("parallel=fsdp", "world_size=4", "strategy=dlrover_flash", "fault=node_loss",
                              "ranks_per_node=2", "fault.rank=1", "recovery=shrink"))
    assert "\n" not in line and "recovery=shrink" in line and "strategy=dlrover_flash" in line, line
