"""torchft's HSDP recipe as ``replica_torchft`` under ``parallel=hsdp`` (``resilience.libs.torchft_hsdp``):
each replica of the shards is a torchft replica group, FSDP2 within it, torchft's all-reduce across the groups.
After a kill the dead rank's whole group is started again and heals shard by shard from the other group; with
``min_replicas`` = every group the run ends bit-exact with the fault-free one."""

from __future__ import annotations

import os

import pytest

from conftest import SHARDED, refusal, run_experiment
from resilience.parallel.ddp import DataParallel
from resilience.parallel.hsdp import HybridShardedParallel
from resilience.record.events import read_events
from resilience.libs.torchft_hsdp import ReplicaGroups

try:
    import torchft  # noqa: F401
except ImportError:
    pytest.skip("torchft is not installed: pip install -e '.[torchft]' (or .[peers])", allow_module_level=True)


def test_under_hsdp_a_replica_group_is_one_replica_of_the_shards():
    groups = [ReplicaGroups.of(HybridShardedParallel(replicate=2), rank, 4) for rank in range(4)]
    assert [(g.group, g.local) for g in groups] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {(g.count, g.shard) for g in groups} == {(2, 2)}  # rank r: shard r % 2 of replica r // 2, as hsdp lays out


def test_under_ddp_each_rank_is_a_replica_group_of_its_own():
    groups = [ReplicaGroups.of(DataParallel(), rank, 2) for rank in range(2)]
    assert [(g.group, g.local, g.count, g.shard) for g in groups] == [(0, 0, 2, 1), (1, 0, 2, 1)]


def test_more_replicas_required_than_hsdp_has_is_refused_before_launch(tmp_path):
    line = refusal(tmp_path, ("parallel=hsdp", "world_size=4", "strategy=replica_torchft", "strategy.min_replicas=3"))
    assert "\n" not in line and "strategy.min_replicas=3" in line and "parallel.replicate=2" in line, line


def test_under_fsdp_there_is_no_replica_to_heal_from(tmp_path):
    line = refusal(tmp_path, ("parallel=fsdp", "world_size=4", "strategy=replica_torchft"))
    assert "\n" not in line and "strategy=replica_torchft" in line and "parallel=hsdp" in line, line


# Opt-in: 1 of the 19 kill runs made so far crashed a survivor with SIGSEGV right after it served a heal (cause not
# found; the ranks run with faulthandler on, so the next one leaves its threads' stacks in the rank log). A suite
# that CI must pass does not carry a known intermittent native crash; docs/sharded.md reports it.
@pytest.mark.skipif(not os.environ.get("RB_FLAKY_TESTS"), reason="set RB_FLAKY_TESTS=1: torchft HSDP heal, an "
                    "intermittent survivor SIGSEGV (1 in 19 runs) is open (docs/sharded.md)")
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_killed_rank_s_group_is_restarted_and_heals_shard_by_shard_bit_exact(tmp_path, sharded_fault_free):
    run_dir = tmp_path / "run"
    result = run_experiment(run_dir, "parallel=hsdp", "strategy=replica_torchft", "strategy.min_replicas=2",
                            "fault=kill", "fault.rank=1", "fault.at_step=7", *SHARDED, timeout=400)
    assert result["status"] == "ok" and result["recovered"] is True, result
    assert result["final_state_sha256"] == sharded_fault_free("hsdp")
    assert result["reduced_width_steps"] == 0 and result["replicas_consistent"] is True
    assert result["survivors_restarted"] is True  # rank 1's group mate
    assert result["peer_patches"] == []  # torchft's DDP is not used under hsdp: its hook patch is not declared
    events = read_events(run_dir)
    # torchft restarts a replica group, not a rank: rank 1's group mate 0 fails in its next FSDP collective and
    # is replaced as well; the other group (ranks 2, 3) is one process each from start to end.
    restarted = sorted(r for e in events if e["kind"] == "restart" and e["rank"] is None for r in e["ranks"])
    assert restarted == [0, 1]
    for rank in (2, 3):
        assert len({e["pid"] for e in events if e["kind"] == "run_start" and e["rank"] == rank}) == 1
    heals = {e["rank"]: e["bytes"] for e in events if e["kind"] == "ft_heal"}
    assert set(heals) == {0, 1} and all(b > 1_000_000 for b in heals.values())  # each its own shard
