"""NVRx's asynchronous DCP save (``strategy=nvrx_async_dcp``) with sharded state: the two CPU workarounds of its
preload, the combinations it runs in, and (slow) a kill during a save that recovers bit-exact under HSDP.

The preload tests call the library itself in this process: they show what the workarounds are for, and fail when
a release of NVRx changes that behaviour."""

from __future__ import annotations

import pytest
import torch
from conftest import SHARDED, refusal, run_experiment

from resilience.__main__ import precheck
from resilience.config import check_group_choices
from resilience.record.events import read_events

pytest.importorskip("nvidia_resiliency_ext", reason="nvidia-resiliency-ext is not installed: pip install -e '.[nvrx]'")

from resilience.strategies.nvrx_async_dcp import NvrxAsyncDcpCheckpoint, staged_preload  # noqa: E402


def buckets(tensor: torch.Tensor) -> list:
    """One write bucket as ``FileSystemWriterAsync.prepare_write_data`` makes it: (path, key, (bytes, tensors))."""
    return [("/unused/__0_0.distcp", "__0_0.distcp", ([], [("item", tensor)]))]


def test_the_staging_copy_is_what_keeps_training_from_changing_the_saved_tensor():
    live = torch.zeros(4)
    shipped = staged_preload(buckets(live), blocking=True, copy=False)[0][2][1][0][1]
    staged = staged_preload(buckets(live), blocking=True, copy=True)[0][2][1][0][1]
    live.add_(1.0)  # the next optimizer step
    assert shipped.data_ptr() == live.data_ptr() and shipped[0].item() == 1.0  # the library's preload: live
    assert staged[0].item() == 0.0  # the workaround: the state as it was when the save began


@pytest.mark.skipif(torch.cuda.is_available(), reason="the shipped preload synchronises CUDA, which exists here")
def test_the_shipped_preload_fails_without_cuda():
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        staged_preload(buckets(torch.zeros(4)), blocking=False, copy=False)


def test_as_shipped_the_request_carries_the_librarys_own_preload():
    strategy = NvrxAsyncDcpCheckpoint(every=4, keep=2, patches="none")
    strategy._in_force = {p.name for p in strategy.patches}
    assert strategy.patches == [] and strategy._preload(None, "shipped") == "shipped"
    assert strategy.caps.shards_state


@pytest.mark.parametrize("overrides", [("parallel=fsdp", "strategy=nvrx_async_dcp"),
                                       ("parallel=hsdp", "world_size=4", "strategy=nvrx_async_dcp"),
                                       ("parallel=fsdp", "strategy=nvrx_async_dcp", "fault=node_loss",
                                        "ranks_per_node=2", "fault.rank=1", "recovery=shrink")])
def test_nvrx_async_dcp_runs_with_sharded_state_and_reshards(tmp_path, overrides):
    argv = [*overrides, f"hydra.run.dir={tmp_path / 'run'}"]
    check_group_choices(argv)
    precheck(argv)


def test_an_unknown_patch_is_one_clear_line(tmp_path):
    line = refusal(tmp_path, ("strategy=nvrx_async_dcp", "strategy.patches=[x]"))
    assert "\n" not in line and "strategy.patches=[x]" in line and "cpu_staging_copy" in line, line


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_hsdp_killed_during_a_save_recovers_bit_exact(tmp_path, sharded_fault_free):
    """Rank 1 dies once its shard of step 8 is written, before the finalize: every rank loads step 4 (NVRx's
    files, through sync's verified DCP load) and the run ends on the fault-free ``sync`` run's hash (the strategy
    does not touch the training state, so the fault-free hashes agree: docs/sharded.md)."""
    hit = run_experiment(tmp_path / "hit", "parallel=hsdp", "strategy=nvrx_async_dcp", "fault=kill", "fault.rank=1",
                         "fault.phase=during_checkpoint", "fault.at_step=8", *SHARDED, timeout=400)
    assert hit["status"] == "ok" and hit["recovered"]
    assert hit["final_state_sha256"] == sharded_fault_free("hsdp")
    on_cpu = ["cuda_synchronize", "cpu_staging_copy"] if not torch.cuda.is_available() else []
    assert hit["peer_patches"] == [*on_cpu, "worker_outlives_notice"]
    loaded = {e["rank"]: e["step"] for e in read_events(tmp_path / "hit") if e["kind"] == "ckpt_loaded"}
    assert loaded == {0: 4, 1: 4, 2: 4, 3: 4}, loaded
