"""Rank processes of tests/test_sharded.py, started by ``spawn`` (forked from one process ``torch.multiprocessing``
spawns): kept apart from the test module so that the ranks import torch and the few modules they use, not the
command and Hydra."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def spawn(fn, world: int, *args) -> None:
    """``fn(rank, world, store, *args)`` on ``world`` gloo ranks in fresh processes; fails if any rank fails.

    One spawned process (nothing of the test process's threads or process groups) imports torch and ``fn``'s module,
    then forks the ranks: the imports once, not once a rank (1.5-2 s each, 2 to 4 ranks a test on 2 cores)."""
    spawn_worlds([(fn, world)], *args)


def spawn_worlds(worlds: list[tuple], *args, preload: tuple[str, ...] = ()) -> None:
    """``spawn`` of each ``(fn, world)`` in turn, every world forked from the same spawned process: its imports (and
    the ``preload`` modules, which the ranks would each import on 2 cores) once for all of them; fails at the first
    world with a failed rank, and runs no world after it."""
    helper = mp.get_context("spawn").Process(target=_fork_worlds, args=(list(worlds), preload, *args))
    helper.start()
    try:
        helper.join()
    finally:
        if helper.is_alive():  # the test ran out of time: the helper and its ranks, one process group, end with it
            _kill_group(helper)
    assert helper.exitcode == 0, f"a rank failed (exit {helper.exitcode}: its traceback is above)"


def _fork_worlds(worlds: list[tuple], preload: tuple[str, ...], *args) -> None:
    import importlib

    os.setsid()  # the ranks inherit this group: spawn() ends them all with one signal
    for module in preload:  # imports only, as a zygote's (resilience/proc/zygote.py): no thread, no process group
        importlib.import_module(module)
    for fn, world in worlds:  # one store per world size: a world's file store is never one an earlier world used
        store = str(Path(args[0]) / f"store{world}")
        mp.start_processes(fn, args=(world, store, *args), nprocs=world, start_method="fork", join=True)


def _kill_group(helper) -> None:
    try:
        os.killpg(helper.pid, signal.SIGKILL)
    except ProcessLookupError:  # killed before its setsid: it leads no group yet, and has started no rank
        helper.kill()
    helper.join()


def _join(rank: int, world: int, store: str) -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)


def reduce_scatter_rank(rank: int, world: int, store: str, tmp: str) -> None:
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


def _sharded_state(world: int, tmp: str, steps: int):
    """A small GPT sharded by FSDP over ``world`` ranks, trained ``steps`` steps (Adam has state)."""
    from resilience.parallel.fsdp import FullyShardedParallel
    from resilience.state.train import TrainState
    from resilience.workloads.gpt import GPTWorkload

    wl = GPTWorkload(0, d_model=32, n_layer=2, n_head=2, seq_len=16)
    model = FullyShardedParallel().wrapper(torch.device("cpu"), world, None, False)(wl.build_model())
    state = TrainState(model, wl.build_optimizer(model))
    for step in range(steps):
        wl.loss(model, wl.batch(step, dist.get_rank(), torch.device("cpu"))).backward()
        state.optimizer.step()
        state.optimizer.zero_grad(set_to_none=True)
    return state


# What save_rank and load_rank import (check_snapshots' modules too), for a helper to import before it forks them.
SAVE_LOAD_IMPORTS = ("torch.distributed.checkpoint", "torch.distributed.tensor", "resilience.parallel.fsdp",
                     "resilience.state.train", "resilience.workloads.gpt", "resilience.ckpt.codec",
                     "resilience.ckpt.snapshot", "resilience.ckpt.dcp_files")


def save_rank(rank: int, world: int, store: str, tmp: str) -> None:
    import torch.distributed.checkpoint as dcp

    _join(rank, world, store)
    state = _sharded_state(world, tmp, steps=2)
    dcp.save(state.state_dict(), checkpoint_id=f"{tmp}/ckpt")  # each rank writes its shards
    full = state.full_state_dict()
    if rank == 0:
        torch.save(full, f"{tmp}/saved_full.pt")
    dist.destroy_process_group()


def load_rank(rank: int, world: int, store: str, tmp: str) -> None:
    import torch.distributed.checkpoint as dcp

    from resilience.state.train import state_sha256

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
    check_snapshots(state, tmp)  # on the loaded state: these ranks are up, a spawn of their own costs ~60 s
    dist.destroy_process_group()


def _flat(obj, prefix: str = "") -> dict:
    if isinstance(obj, dict):
        return {k: v for key, val in obj.items() for k, v in _flat(val, f"{prefix}{key}.").items()}
    return {prefix: obj}


def check_snapshots(state, tmp: str) -> None:
    """``async``'s host snapshot and ``inmemory``'s codec on sharded state: each rank copies its own shards, and
    a fresh model and optimizer restored from the encoded shards hold the saved global state exactly."""
    from torch.distributed.tensor import DTensor

    from resilience.ckpt.codec import StateCodec, restore, snapshot_state, tensor_leaves
    from resilience.ckpt.snapshot import HostSnapshot
    from resilience.state.train import state_sha256

    rank, world = dist.get_rank(), dist.get_world_size()
    sd = state.state_dict()
    snap = HostSnapshot(rank, world).capture(sd)
    live, copied = tensor_leaves(sd), tensor_leaves(snap)
    assert live.keys() == copied.keys(), "a sharded rank snapshots every key (its own shards)"
    for key, t in live.items():
        if isinstance(t, DTensor):
            c = copied[key]
            assert isinstance(c, DTensor) and c.placements == t.placements and c.shape == t.shape, key
            assert torch.equal(c.to_local(), t.to_local()) and c.to_local().data_ptr() != t.to_local().data_ptr()
    codec = StateCodec()
    data_len, meta, fill = codec.encode(snapshot_state(state), checksum=False)
    buf = torch.empty(data_len, dtype=torch.uint8)
    fill(buf)
    assert data_len < sum(t.numel() * t.element_size() for t in tensor_leaves(state.full_state_dict()).values())
    fresh = _sharded_state(world, tmp, steps=0)
    fresh.state_dict()  # the optimizer's sharded state exists before the read, as inmemory's load makes sure
    into = tensor_leaves(snapshot_state(fresh))
    restored = codec.decode(meta, lambda ref, dst: dst.reshape(-1).view(torch.uint8).copy_(
        buf[ref.offset:ref.offset + ref.nbytes]), into)
    restore(fresh, restored)
    assert state_sha256(fresh.full_state_dict()) == state_sha256(state.full_state_dict())
    _load_planned_files_only(state, tmp)


def _load_planned_files_only(state, tmp: str) -> None:
    """``sync``'s load of a sharded checkpoint verifies and serves only the files its plan names: DCP loads the
    saved state from those alone (``MemoryFiles`` has no other file to give it)."""
    import torch.distributed.checkpoint as dcp

    from resilience.ckpt.dcp_files import load, planned_files
    from resilience.state.train import state_sha256

    root = Path(tmp) / "planned"
    dcp.save(state.state_dict(), checkpoint_id=str(root))
    dist.barrier()
    buffers = {".metadata": memoryview((root / ".metadata").read_bytes())}
    fresh = _sharded_state(dist.get_world_size(), tmp, steps=0)
    sd = fresh.state_dict()
    planned = planned_files(root, buffers, sd)
    assert planned and planned <= {p.name for p in root.glob("*.distcp")}
    buffers.update({name: memoryview((root / name).read_bytes()) for name in planned})
    load(sd, root, buffers)
    fresh.load_state_dict(sd)
    assert state_sha256(fresh.full_state_dict()) == state_sha256(state.full_state_dict())

