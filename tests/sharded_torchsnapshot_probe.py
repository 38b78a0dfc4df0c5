"""What torchsnapshot 0.1.0 does with FSDP2's state (DTensor shards): rank processes of
tests/test_sharded_torchsnapshot.py, started by ``torch.multiprocessing`` (spawn), and a reproducer on its own:

    .venv/bin/python tests/sharded_torchsnapshot_probe.py /tmp/tsnap-probe

Four gloo ranks shard a small GPT with ``fully_shard`` and train it 3 steps with AdamW (``tests/sharded_ranks.py``'s
state). For each way of saving (``Snapshot.take`` / ``Snapshot.async_take``, with and without ``replicated=["**"]``)
they save ``{"train": TrainState}``, describe what was written (each DTensor's manifest entry on each rank), restore
into a state trained 1 step (other values everywhere), gather the global state and compare it, tensor by tensor and
bit for bit, with the global state at the save. Rank 0 writes ``outcome.json``: per case, what raised, the manifest
entries, and the keys whose restored global tensor differs.
"""

from __future__ import annotations

import json
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: sharded_ranks sits beside it
from sharded_ranks import _flat, _sharded_state, spawn  # noqa: E402

WORLD = 4
CASES = {"take": ("take", None), "take_replicated": ("take", ["**"]),
         "async_take": ("async_take", None), "async_take_replicated": ("async_take", ["**"])}
PARAM = "train/model/blocks.0.qkv.weight"  # a parameter whose dim 0 (96 rows) shards evenly over 4 ranks


def _join(rank: int, world: int, store: str) -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    # a library collective that one rank never reaches fails in 60 s instead of hanging the test
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))


def _error(exc: BaseException) -> str:
    where = traceback.extract_tb(exc.__traceback__)[-1]
    return f"{type(exc).__name__}: {str(exc)[:300]} ({Path(where.filename).name}:{where.lineno})"


def _save(ts, how: str, path: str, state, replicated, seen: dict) -> None:
    """Save with ``how``; ``seen["raised_in"]`` names the call that raised, if one did."""
    seen["raised_in"] = how
    if how == "take":
        ts.Snapshot.take(path, {"train": state}, replicated=replicated)
    else:
        pending = ts.Snapshot.async_take(path, {"train": state}, replicated=replicated)
        seen["raised_in"] = "wait"
        pending.wait()
    del seen["raised_in"]


def _entry_made_for(path: str, replicated, state) -> dict:
    """The manifest entry torchsnapshot's ``prepare_write`` makes for ``PARAM`` (a DTensor) on this rank,
    without staging it: its type and shape say whether the library sees a shard or a whole tensor."""
    from torchsnapshot.io_preparer import prepare_write

    dtensor = state.state_dict()["model"][PARAM.removeprefix("train/model/")]
    entry, _ = prepare_write(dtensor, PARAM, dist.get_rank(), replicated=bool(replicated))
    return {"type": entry.type, "shape": list(entry.shape), "location": entry.location}


def _differing(saved: dict, restored: dict) -> list[str]:
    flat_saved, flat_restored = _flat(saved), _flat(restored)
    bad = sorted(set(flat_saved) ^ set(flat_restored))
    for key, value in flat_saved.items():
        if key in flat_restored:
            other = flat_restored[key]
            same = (isinstance(other, torch.Tensor) and value.shape == other.shape and torch.equal(value, other)) \
                if isinstance(value, torch.Tensor) else value == other
            if not same:
                bad.append(key)
    return bad


def _case(ts, how: str, replicated, path: str, world: int, tmp: str) -> dict:
    """One way of saving, then restoring; every rank returns what it saw."""
    state = _sharded_state(world, tmp, steps=3)
    saved = state.full_state_dict()
    local = state.state_dict()["model"][PARAM.removeprefix("train/model/")]
    seen: dict = {"rank": dist.get_rank(), "dtensor_global_shape": list(local.shape),
                  "dtensor_local_shape": list(local.to_local().shape),
                  "entry_made": _entry_made_for(path, replicated, state)}
    try:
        _save(ts, how, path, state, replicated, seen)
    except Exception as exc:  # noqa: BLE001 - the finding is what the library raises
        seen["save_error"] = _error(exc)
        dist.barrier()  # every rank has given up on this save before any looks at what it left
        seen["left_behind"] = sorted(str(p.relative_to(path)) for p in Path(path).rglob("*") if p.is_file())
        return seen
    fresh = _sharded_state(world, tmp, steps=1)
    fresh.state_dict()  # the optimizer's state exists (as any load here makes sure) so that there is a target
    try:
        ts.Snapshot(path).restore({"train": fresh})
    except Exception as exc:  # noqa: BLE001
        seen["restore_error"] = _error(exc)
        dist.barrier()  # the ranks may have stopped in different places; meet before the next case
        return seen
    seen["differing"] = _differing(saved, fresh.full_state_dict())
    return seen


def probe_rank(rank: int, world: int, store: str, tmp: str) -> None:
    import torchsnapshot as ts

    _join(rank, world, store)
    outcome = {}
    for name, (how, replicated) in CASES.items():
        seen = _case(ts, how, replicated, f"{tmp}/{name}", world, tmp)
        everyone: list = [None] * world
        dist.all_gather_object(everyone, seen)
        outcome[name] = everyone
    if rank == 0:
        Path(tmp, "outcome.json").write_text(json.dumps(outcome, indent=1, default=str))
    dist.destroy_process_group()


def run(tmp: str) -> dict:
    """Run the probe on ``WORLD`` ranks in ``tmp``; return rank 0's ``outcome.json``."""
    spawn(probe_rank, WORLD, tmp)
    return json.loads(Path(tmp, "outcome.json").read_text())


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/tsnap-probe")
    out.mkdir(parents=True, exist_ok=True)
    print(json.dumps(run(str(out)), indent=1))
