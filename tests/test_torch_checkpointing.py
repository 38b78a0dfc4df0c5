"""torch-checkpointing 0.1.1 as ``strategy=torch_checkpointing``: killed in the middle of a save it recovers bit-exact
(2 gloo ranks, real processes); what its CPU settings and its workaround are for, shown on the library itself; the
combinations the table of rules lets it run in; and (long tier) sharded state killed in a save, and a world shrunk
and grown back whose resharded loads end where DCP's do.

The library tests fail when a release changes what they show: then the YAML's comments, the module's docstring and
docs/peers.md say something that no longer holds."""

from __future__ import annotations

import errno
import importlib.metadata
import os
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import SHARDED, refusal, run_experiment
from hydra.utils import instantiate
from omegaconf import OmegaConf

from resilience.__main__ import precheck
from resilience.config import CONF_DIR, check_group_choices
from resilience.record.events import read_events

tc = pytest.importorskip("torch_checkpointing",
                         reason="torch-checkpointing is not installed: pip install -e '.[torch_checkpointing]'")

from resilience.strategies.torch_checkpointing_ckpt import (  # noqa: E402
    OPTIM_GROUPS, SHARED, SHIPPED, TMP_PREFIX, TorchCheckpointingCheckpoint, _gather_objects)

VERSION = importlib.metadata.version("torch-checkpointing")
# the kill in a save: test_peers.py's settings, so that the session's reference run (strategy=sync) is this one's
COMMON = ("steps=30", "checkpoint.every=5", "world_size=2", "seed=0", "detector=[process_exit]")
ON_CPU = [] if torch.cuda.is_available() else ["cpu_metadata_gather"]


def story(run_dir: Path) -> str:
    keep = ("ckpt_durable", "ckpt_loaded", "ckpt_rejected", "ckpt_incomplete", "ckpt_failed", "fault_injected")
    return "\n".join(f"{e['attempt']} r{e['rank']} {e['kind']} step {e['step']} {e.get('reason', '')}"
                     for e in read_events(run_dir) if e["kind"] in keep)


@pytest.mark.timeout(240)
def test_kill_during_a_save_loads_the_previous_checkpoint_bit_exact(tmp_path, reference):
    """Rank 1 is SIGKILLed once its copy of step 20 is staged and handed to the library's checkpoint process: the
    save of step 20 never commits, both ranks load step 15 (5 steps lost) and the run ends on the fault-free
    state, with nothing of the library left behind (no process, no /dev/shm entry, no temporary folder)."""
    run = tmp_path / "run"
    result = run_experiment(run, "strategy=torch_checkpointing", "fault=kill", "fault.rank=1", "fault.at_step=20",
                            "fault.phase=during_checkpoint", *COMMON)
    assert result["status"] == "ok" and result["recovered"], story(run)
    assert result["lost_steps"] == 5 and result["ckpt_count"] >= 5, story(run)
    assert result["final_state_sha256"] == reference["final_state_sha256"]
    events = read_events(run)
    assert {(e["rank"], e["step"]) for e in events if e["kind"] == "ckpt_loaded"} == {(0, 15), (1, 15)}, story(run)
    assert [e["step"] for e in events if e["kind"] == "ckpt_incomplete"] == [20], story(run)
    assert result["peer"]["library"] == "torch-checkpointing" and result["peer"]["version"] == VERSION
    assert result["peer"]["settings"]["direct_io"] is False and result["peer_patches"] == ON_CPU
    assert result["orphans_killed"] == []
    assert not list((run / "ckpt").glob(f"{TMP_PREFIX}*")), "the library's temporary folder outlived the run"
    newest = max((run / "ckpt").glob("step_*"))
    names = {p.name for p in newest.iterdir()}
    assert {f"{key}_0.pt" for key in ("model", "optim", OPTIM_GROUPS)} <= names and f"{OPTIM_GROUPS}_1.pt" not in names


@pytest.mark.skipif(torch.cuda.is_available(), reason="the shipped gather works where CUDA is")
def test_the_shipped_metadata_gather_needs_cuda_and_the_patch_gathers_the_same_objects(monkeypatch):
    from torch_checkpointing.metadata_manager import DefaultMetadataManager
    from torch_checkpointing.types import RankInfo

    # the library's own gather, though an earlier test of this process may have run the strategy (and its patch)
    shipped = SHIPPED.get("gather", DefaultMetadataManager._all_gather_pickled_data)
    monkeypatch.setattr(DefaultMetadataManager, "_all_gather_pickled_data", shipped)  # put back after the patch
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    manager = DefaultMetadataManager(rank_info=RankInfo(global_rank=0, global_world_size=1, role_rank=0,
                                                        role_world_size=1))
    try:
        with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
            manager._all_gather_pickled_data({"model": [1, 2]})
        (patch,) = TorchCheckpointingCheckpoint(every=2, keep=2).patches
        assert patch.name == "cpu_metadata_gather" and patch.applies()
        patch.apply()
        assert DefaultMetadataManager._all_gather_pickled_data is _gather_objects
        assert manager._all_gather_pickled_data({"model": [1, 2]}) == {0: {"model": [1, 2]}}
    finally:
        manager.close()
        if started:
            dist.destroy_process_group()


def o_direct_open_accepted(folder: Path) -> bool:
    try:
        fd = os.open(folder / "probe", os.O_RDWR | os.O_CREAT | os.O_DIRECT)
    except OSError:
        return False
    os.close(fd)
    return True


def test_direct_io_as_shipped_fails_torch_save_where_the_open_is_accepted(tmp_path):
    """Why ``direct_io: false``: the library falls back to buffered I/O only when the ``O_DIRECT`` open fails. A
    file system that accepts the open (ext4) refuses ``torch.save``'s unaligned writes: the save raises EINVAL."""
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    state = {"w": torch.arange(1000, dtype=torch.float32)}
    buffered = LocalFileSystemStorageConfig(use_direct_io=False).create_storage()
    with buffered.get_write_stream(tmp_path / "buffered.pt", state) as f:
        torch.save(state, f)
    assert torch.equal(torch.load(tmp_path / "buffered.pt")["w"], state["w"])
    direct = LocalFileSystemStorageConfig(use_direct_io=True).create_storage()
    if not o_direct_open_accepted(tmp_path):  # tmpfs: the open fails and the library falls back, as designed
        with direct.get_write_stream(tmp_path / "direct.pt", state) as f:
            torch.save(state, f)
        return
    with pytest.raises(OSError) as refused:
        with direct.get_write_stream(tmp_path / "direct.pt", state) as f:
            torch.save(state, f)
    assert refused.value.errno == errno.EINVAL


def test_payload_is_the_librarys_items_and_rank_0_alone_holds_the_shared_ones():
    strategy = TorchCheckpointingCheckpoint(every=2, keep=2)
    sd = {"model": {"w": torch.zeros(2)}, "optim": {"state": {"w": {"step": torch.tensor(1.0)}},
                                                    "param_groups": [{"lr": 0.1, "params": ["w"]}]},
          "job": {"lr_scheduler": b"x"}, "rank": {"0": {"rng": b"y"}}}
    payload = strategy._payload(sd)
    assert all(re.fullmatch(r"[a-zA-Z0-9_-]+", key) for key in payload)  # the library's rule for item names
    assert payload["optim"] == {"state": sd["optim"]["state"]}
    assert payload[OPTIM_GROUPS] is sd["optim"]["param_groups"]  # not a tensor: a resharded load would skip it
    assert set(SHARED) == {OPTIM_GROUPS, "job"} and payload["job"] is sd["job"] and payload["rank"] is sd["rank"]


def test_patches_setting_names_the_librarys_patch():
    node = OmegaConf.load(CONF_DIR / "strategy" / "torch_checkpointing.yaml")
    node.timeout_s = 10
    assert [p.name for p in instantiate(node, every=2, keep=2).patches] == ["cpu_metadata_gather"]
    node.patches = "none"
    assert instantiate(node, every=2, keep=2).patches == []
    node.patches = ["nope"]
    with pytest.raises(Exception, match=r"strategy.patches=\[nope\]: allowed: all, none, or a list of "
                                         r"cpu_metadata_gather"):
        instantiate(node, every=2, keep=2)


def test_a_missing_library_is_refused_in_one_line_naming_the_extra(monkeypatch):
    from resilience.libs.peer import PeerLibrary

    monkeypatch.setattr(TorchCheckpointingCheckpoint, "library", PeerLibrary("no_such_rb", "no-such", "nosuch"))
    with pytest.raises(ValueError, match=r"^strategy=torch_checkpointing: no-such is not installed .*\.\[nosuch\]"):
        TorchCheckpointingCheckpoint(every=2, keep=2).check_host(None, 2)


@pytest.mark.parametrize("overrides", [("parallel=fsdp",), ("parallel=hsdp", "world_size=4"),
                                       ("parallel=fsdp", "fault=node_loss", "ranks_per_node=2", "world_size=4",
                                        "fault.rank=1", "recovery=shrink"),
                                       ("parallel=fsdp", "fault=node_loss", "ranks_per_node=2", "world_size=4",
                                        "fault.rank=1", "fault.return_after_s=0", "recovery=grow")])
def test_sharded_state_and_resized_worlds_pass_the_rules(tmp_path, overrides):
    argv = ["strategy=torch_checkpointing", *overrides, f"hydra.run.dir={tmp_path / 'run'}"]
    check_group_choices(argv)
    precheck(argv)


def test_a_fault_through_dcps_file_layer_is_refused_in_one_line(tmp_path):
    line = refusal(tmp_path, ("strategy=torch_checkpointing", "fault=slow_disk"))
    assert "\n" not in line and "not applicable to strategy=torch_checkpointing" in line, line


@pytest.mark.timeout(600)
def test_fsdp_killed_during_a_save_recovers_bit_exact(tmp_path, sharded_fault_free):
    """Each rank's DTensor shards, written by its checkpoint process; rank 1 dies once step 8 is handed over: every
    rank loads step 4 and the run ends on the fault-free run's state."""
    run = tmp_path / "hit"
    hit = run_experiment(run, "parallel=fsdp", "strategy=torch_checkpointing", "fault=kill", "fault.rank=1",
                         "fault.phase=during_checkpoint", "fault.at_step=8", *SHARDED, timeout=500)
    assert hit["status"] == "ok" and hit["recovered"], story(run)
    assert hit["final_state_sha256"] == sharded_fault_free("fsdp")
    loaded = {e["rank"]: e["step"] for e in read_events(run) if e["kind"] == "ckpt_loaded"}
    assert loaded == {0: 4, 1: 4, 2: 4, 3: 4}, story(run)


GROW = ("parallel=fsdp", "workload=gpt_tiny", "fault=node_loss", "ranks_per_node=2", "fault.rank=1", "world_size=4",
        "fault.at_step=6", "fault.return_after_s=0", "recovery=grow", "steps=24", "checkpoint.every=4", "seed=0",
        "detector=[process_exit]")


@pytest.mark.timeout(900)
def test_a_world_shrunk_and_grown_back_ends_where_dcps_resharded_loads_end(tmp_path):
    """4 ranks lose a node at step 6, go on with 2 from step 4 (the library's load resharded 4 -> 2), and grow back
    to 4 after the step-8 checkpoint (2 -> 4). The training after each load is deterministic, so the run ends on
    the state that ``sync`` (DCP's resharding) ends on: the resharded loads restored the same state."""
    ours = run_experiment(tmp_path / "ours", "strategy=torch_checkpointing", *GROW, timeout=600)
    assert ours["status"] == "ok" and ours["recovered"], story(tmp_path / "ours")
    assert [(e["direction"], e["world_size"]) for e in ours["world_resizes"]] == [("down", 2), ("up", 4)]
    loaded = sorted((e["attempt"], e["rank"], e["step"]) for e in read_events(tmp_path / "ours")
                    if e["kind"] == "ckpt_loaded")
    assert loaded == [(1, 0, 4), (1, 1, 4), (2, 0, 8), (2, 1, 8), (2, 2, 8), (2, 3, 8)], story(tmp_path / "ours")
    dcp = run_experiment(tmp_path / "dcp", "strategy=sync", *GROW, timeout=600)
    assert ours["final_state_sha256"] == dcp["final_state_sha256"]
