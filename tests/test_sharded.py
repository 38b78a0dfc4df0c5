"""Sharded training (``parallel=fsdp|hsdp``, docs/sharded.md): the refusals, the rank-order reduce-scatter, a
checkpoint resharded to a smaller world loads the saved global state exactly, and kill-and-recover is bit-exact.

The multi-process cases (gloo ranks started here) are slow on a small machine and marked so."""

from __future__ import annotations

import pytest
import sharded_ranks
from conftest import SHARDED, checked, refusal, run_experiment
from sharded_ranks import spawn
from resilience.record.events import read_events

REFUSED = [
    (("parallel=fsdp", "workload=dlrm_emb"), "parallel=fsdp", "sparse gradients"),
    (("parallel=hsdp", "world_size=4", "workload=dlrm_emb"), "parallel=hsdp", "parallel=ddp"),
    (("parallel=fsdp", "strategy=torchsnapshot"), "strategy=torchsnapshot", "no DTensor support"),
    (("parallel=fsdp", "strategy=dcp_async_staged_process"), "strategy=dcp_async", "nvrx_async_dcp"),
    (("parallel=fsdp", "strategy=dcp_async_process"), "strategy=dcp_async", "executor=thread"),
    (("parallel=fsdp", "fault=bitflip"), "fault=bitflip", "parallel=ddp"),
    (("parallel=fsdp", "detector=[replica_fingerprint]"), "replica_fingerprint", "detector list"),
    (("parallel=hsdp", "world_size=3"), "parallel.replicate=2", "world_size=4"),
    (("parallel=hsdp", "world_size=4", "parallel.replicate=4"), "parallel.replicate=4", "at least 2 shards"),
    (("parallel=fsdp", "parallel.reduce=ring"), "parallel.reduce=ring", "ordered"),
    (("recovery=shrink", "strategy=replica"), "recovery=shrink", "restarts every rank"),
]


@pytest.mark.parametrize("overrides,setting,allowed", REFUSED, ids=[r[1] for r in REFUSED])
def test_a_combination_that_cannot_shard_is_one_clear_line(tmp_path, overrides, setting, allowed):
    line = refusal(tmp_path, overrides)
    assert "\n" not in line and setting in line and allowed in line, line


@pytest.mark.parametrize("overrides", [("parallel=fsdp", "strategy=none"), ("parallel=fsdp", "strategy=sync"),
                                       ("parallel=hsdp", "world_size=4", "strategy=dcp_async"),
                                       ("parallel=fsdp", "strategy=async"),
                                       ("parallel=hsdp", "world_size=4", "strategy=inmemory")])
def test_the_sharded_combinations_pass(tmp_path, overrides):
    checked(tmp_path, overrides)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ordered_reduce_scatter_is_the_rank_order_sum(tmp_path):
    spawn(sharded_ranks.reduce_scatter_rank, 3, str(tmp_path))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_checkpoint_of_4_shards_loads_on_2_ranks_as_the_saved_global_state(tmp_path):
    """DCP's load-time resharding (what ``recovery=shrink`` relies on): the gathered full tensors, model and
    optimizer, equal the saved ones exactly. The 2 ranks then check ``async``'s and ``inmemory``'s sharded
    snapshots and ``sync``'s load from the planned files alone (``sharded_ranks.check_snapshots``)."""
    spawn(sharded_ranks.save_rank, 4, str(tmp_path))
    spawn(sharded_ranks.load_rank, 2, str(tmp_path))


# One case per strategy that saves sharded state; async and inmemory: about 60-80 s each on 2 loaded cores. The
# inmemory case loses node 0 (ranks 0 and 1, their memory wiped): they take their shards from the peer copies held
# by the same shards' ranks of the other replica group.
KILL = ("fault=kill", "fault.rank=1")
NODE_LOSS = ("fault=node_loss", "ranks_per_node=2", "fault.rank=1")
E2E = [("fsdp", "sync", (*KILL, "fault.phase=before_forward", "fault.at_step=7")),
       ("hsdp", "dcp_async", (*KILL, "fault.phase=during_checkpoint", "fault.at_step=8")),
       ("fsdp", "async", (*KILL, "fault.phase=during_checkpoint", "fault.at_step=8")),
       ("hsdp", "inmemory", (*NODE_LOSS, "fault.at_step=7"))]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("parallel,strategy,fault", E2E, ids=[f"{p}-{s}-{f[0][6:]}" for p, s, f in E2E])
def test_sharded_kill_and_recover_bit_exact(tmp_path, sharded_fault_free, parallel, strategy, fault):
    """The recovered run ends with the fault-free run's hash over the gathered global state."""
    hit = run_experiment(tmp_path / "hit", f"parallel={parallel}", f"strategy={strategy}", *fault, *SHARDED,
                         timeout=400)
    assert hit["status"] == "ok" and hit["recovered"]
    assert hit["final_state_sha256"] == sharded_fault_free(parallel)
    # the torch internals it relied on, declared by the supervisor (the agent's hooks) and the ranks (FSDP's comm)
    assert {"elastic_agent_hooks", "fsdp_custom_reduce_scatter"} <= set(hit["torch_workarounds"])
    if strategy == "inmemory":  # the lost node's ranks loaded their shards from the other replica's memory
        events = read_events(tmp_path / "hit")
        # the newest snapshot, not the disk: checkpoint.every=4 and the loss before step 7's forward pass (step 8's
        # snapshot is not taken yet; persist_every=4 puts none of steps 4 and 8 on disk)
        loaded = {e["rank"]: (e["source"], e["step"]) for e in events if e["kind"] == "ckpt_loaded"}
        assert loaded == {0: ("peer_memory", 4), 1: ("peer_memory", 4), 2: ("memory", 4), 3: ("memory", 4)}, loaded
        assert not [e for e in events if e["kind"] == "ckpt_memory_fallback"]


def test_shrink_drops_the_failed_ranks_nodes():
    from resilience.recovery.shrink import Shrink

    two_per_node = Shrink(max_restarts=3, ranks_per_node=2)
    assert two_per_node.world_after(4, [1]) == 2  # node 0 (ranks 0, 1) is gone
    assert two_per_node.world_after(4, [0, 1]) == 2
    assert two_per_node.world_after(8, [1, 6]) == 4  # two nodes
    assert two_per_node.world_after(4, []) == 4  # no rank named: restart at full size
    assert Shrink(max_restarts=3, ranks_per_node=2, min_world_size=3).world_after(4, [1]) == 4
