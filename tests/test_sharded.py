"""Sharded training (``parallel=fsdp|hsdp``, docs/sharded.md): the refusals, the rank-order reduce-scatter, a
checkpoint resharded to a smaller world loads the saved global state exactly, and kill-and-recover is bit-exact.

The multi-process cases (gloo ranks started here) are slow on a small machine and marked so."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import run_experiment
from resilience.__main__ import precheck
from resilience.config import ConfigError, check_group_choices

REFUSED = [
    (("parallel=fsdp", "workload=dlrm_emb"), "parallel=fsdp", "sparse gradients"),
    (("parallel=hsdp", "world_size=4", "workload=dlrm_emb"), "parallel=hsdp", "parallel=ddp"),
    (("parallel=fsdp", "strategy=async"), "strategy=async", "strategy=sync"),
    (("parallel=fsdp", "strategy=dcp_async_process"), "strategy=dcp_async", "executor=thread"),
    (("parallel=fsdp", "fault=bitflip"), "fault=bitflip", "parallel=ddp"),
    (("parallel=fsdp", "detector=[replica_fingerprint]"), "replica_fingerprint", "detector list"),
    (("parallel=hsdp", "world_size=3"), "parallel.replicate=2", "world_size=4"),
    (("parallel=hsdp", "world_size=4", "parallel.replicate=4"), "parallel.replicate=4", "at least 2 shards"),
    (("parallel=fsdp", "parallel.reduce=ring"), "parallel.reduce=ring", "ordered"),
]


@pytest.mark.parametrize("overrides,setting,allowed", REFUSED, ids=[r[1] for r in REFUSED])
def test_a_combination_that_cannot_shard_is_one_clear_line(tmp_path, overrides, setting, allowed):
    argv = [*overrides, f"hydra.run.dir={tmp_path / 'run'}"]
    with pytest.raises(ConfigError) as info:
        check_group_choices(argv)
        precheck(argv)
    line = str(info.value)
    assert "\n" not in line and setting in line and allowed in line, line


@pytest.mark.parametrize("overrides", [("parallel=fsdp", "strategy=none"), ("parallel=fsdp", "strategy=sync"),
                                       ("parallel=hsdp", "world_size=4", "strategy=dcp_async")])
def test_the_sharded_combinations_pass(tmp_path, overrides):
    argv = [*overrides, f"hydra.run.dir={tmp_path / 'run'}"]
    check_group_choices(argv)
    precheck(argv)


def _spawn(fn, world: int, *args) -> None:
    """``fn(rank, world, store, *args)`` on ``world`` gloo ranks in fresh processes; fails if any rank fails."""
    store = Path(args[0]) / f"store{world}"
    mp.start_processes(fn, args=(world, str(store), *args), nprocs=world, start_method="spawn", join=True)


def _join(rank: int, world: int, store: str) -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)


def _reduce_scatter_worker(rank: int, world: int, store: str, tmp: str) -> None:
    from resilience.parallel.ordered import OrderedReduceScatter

    _join(rank, world, store)
    g = torch.Generator().manual_seed(1000 + rank)
    inputs = [torch.randn(world * 1000, generator=torch.Generator().manual_seed(1000 + r)) for r in range(world)]
    mine = torch.randn(world * 1000, generator=g)
    assert torch.equal(mine, inputs[rank])
    out = torch.empty(1000)
    OrderedReduceScatter()(out, mine, dist.group.WORLD, dist.ReduceOp.AVG)
    expected = inputs[0][rank * 1000:(rank + 1) * 1000].clone()
    for part in inputs[1:]:
        expected += part[rank * 1000:(rank + 1) * 1000]
    expected /= world
    assert torch.equal(out, expected), "not the rank-order sum, bit for bit"
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ordered_reduce_scatter_is_the_rank_order_sum(tmp_path):
    _spawn(_reduce_scatter_worker, 4, str(tmp_path))


def _sharded_state(world: int, tmp: str, steps: int):
    """A small GPT sharded by FSDP over ``world`` ranks, trained ``steps`` steps (Adam has state)."""
    from resilience.parallel.fsdp import FullyShardedParallel
    from resilience.state import TrainState
    from resilience.workloads.gpt import GPTWorkload

    wl = GPTWorkload(0, d_model=32, n_layer=2, n_head=2, seq_len=16)
    model = FullyShardedParallel().wrapper(torch.device("cpu"), world, None, False)(wl.build_model())
    state = TrainState(model, wl.build_optimizer(model))
    for step in range(steps):
        wl.loss(model, wl.batch(step, dist.get_rank(), torch.device("cpu"))).backward()
        state.optimizer.step()
        state.optimizer.zero_grad(set_to_none=True)
    return state


def _save_worker(rank: int, world: int, store: str, tmp: str) -> None:
    import torch.distributed.checkpoint as dcp

    _join(rank, world, store)
    state = _sharded_state(world, tmp, steps=2)
    dcp.save(state.state_dict(), checkpoint_id=f"{tmp}/ckpt")  # each rank writes its shards
    full = state.full_state_dict()
    if rank == 0:
        torch.save(full, f"{tmp}/saved_full.pt")
    dist.destroy_process_group()


def _load_worker(rank: int, world: int, store: str, tmp: str) -> None:
    import torch.distributed.checkpoint as dcp

    from resilience.state import state_sha256

    _join(rank, world, store)
    state = _sharded_state(world, tmp, steps=1)  # other values than saved: the load must overwrite them all
    sd = state.state_dict()
    dcp.load(sd, checkpoint_id=f"{tmp}/ckpt")  # resharded: 4 ranks' shards read into 2 ranks' shards
    state.load_state_dict(sd)
    loaded = state.full_state_dict()
    saved = torch.load(f"{tmp}/saved_full.pt", weights_only=False)
    assert state_sha256(loaded) == state_sha256(saved)
    for part in ("model", "optim"):
        flat_saved, flat_loaded = _flat(saved[part]), _flat(loaded[part])
        assert flat_saved.keys() == flat_loaded.keys()
        for key, value in flat_saved.items():
            assert torch.equal(value, flat_loaded[key]) if isinstance(value, torch.Tensor) \
                else value == flat_loaded[key], key
    dist.destroy_process_group()


def _flat(obj, prefix: str = "") -> dict:
    if isinstance(obj, dict):
        return {k: v for key, val in obj.items() for k, v in _flat(val, f"{prefix}{key}.").items()}
    return {prefix: obj}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_checkpoint_of_4_shards_loads_on_2_ranks_as_the_saved_global_state(tmp_path):
    """DCP's load-time resharding (what ``recovery=shrink`` relies on): the gathered full tensors, model and
    optimizer, equal the saved ones exactly."""
    _spawn(_save_worker, 4, str(tmp_path))
    _spawn(_load_worker, 2, str(tmp_path))


COMMON = ("world_size=4", "steps=12", "checkpoint.every=4", "seed=0", "detector=[process_exit]")
E2E = [("fsdp", "sync", "before_forward", 7), ("hsdp", "dcp_async", "during_checkpoint", 8)]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("parallel,strategy,phase,at_step", E2E, ids=[f"{p}-{s}-{ph}" for p, s, ph, _ in E2E])
def test_sharded_kill_and_recover_bit_exact(tmp_path, parallel, strategy, phase, at_step):
    """The recovered run ends with the fault-free run's hash over the gathered global state."""
    ref = run_experiment(tmp_path / "ref", f"parallel={parallel}", f"strategy={strategy}", "fault=none", *COMMON,
                         timeout=280)
    hit = run_experiment(tmp_path / "hit", f"parallel={parallel}", f"strategy={strategy}", "fault=kill",
                         "fault.rank=1", f"fault.at_step={at_step}", f"fault.phase={phase}", *COMMON, timeout=280)
    assert hit["status"] == "ok" and hit["recovered"]
    assert hit["final_state_sha256"] == ref["final_state_sha256"]
