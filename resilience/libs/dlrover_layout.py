"""The sharded state as DLRover's FSDP engine can restore it from memory (two declared workarounds).

DLRover's ``SharedMemoryReader`` reads every tensor from the reading rank's own segment, and the values that are
not tensors with a shape (scalars, 0-dim tensors, pickled objects) from rank 0's copy, which the engine broadcasts
after its DCP save (``fsdp_engine._write_memory_from_list``: "Only rank-0 has the no sharding data"). DCP on
torch 2.13 writes a value that several ranks hold once, on the rank with the least data planned so far
(``dedup_save_plans``, ``dedup_save_to_lowest_rank=False``), so as shipped:

- the values every rank holds (Adam's step counts, the param groups, our ``step``) are written by ranks 1..W-1 as
  well, are missing from rank 0's broadcast, and a load from memory fails (``KeyError``). ``unsharded_on_rank0``:
  only rank 0 hands them to the engine (every rank still asks for them at load).
- under HSDP one rank of each replica group holds the same shard: DCP writes it once, into one group's segment,
  and a rank of the other group reads other bytes from its own segment at that offset. ``twin_shards_apart``: each
  replica group's shards under keys of its own (``replica<i>/``), so that no two ranks hold the same key and every
  rank's shards are in its own segment (and each group's copy on disk).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch.distributed as dist

RANK0 = "unsharded_on_rank0"
TWINS = "twin_shards_apart"
# dlrover_sharded.py's patch, named here: dlrover_flash names it without importing DCP (which dlrover_sharded does)
RANK_IN_CONFIG = "rank_in_shard_config"


def has_twins(tensors: Iterable[Any]) -> bool:
    """Whether some shard is held by several ranks (a ``DTensor`` replicated along a mesh dimension: HSDP)."""
    return any(_is_dtensor(t) and _replica(t) for t in tensors)


def engine_view(sd: dict[str, Any], patches: set[str], saving: bool) -> dict[str, Any]:
    """What the engine is handed: ``sd`` itself as shipped, else a flat dict of ``sd``'s leaves (the same objects:
    DCP's load copies into the tensors; ``write_back`` puts the other values where they belong)."""
    if not patches & {RANK0, TWINS}:
        return sd
    view = {}
    for path, container, key in _leaves(sd):
        value = container[key]
        if _is_dtensor(value):
            view[f"{_replica(value)}{path}" if TWINS in patches else path] = value
        elif not (saving and RANK0 in patches) or dist.get_rank() == 0:
            view[path] = value
    return view


def write_back(sd: dict[str, Any], view: dict[str, Any], patches: set[str]) -> None:
    """After a load into ``engine_view(sd, patches, saving=False)``: the values DCP replaced (not tensors) into
    ``sd``."""
    if view is sd:
        return
    for path, container, key in _leaves(sd):
        value = container[key]
        container[key] = view[f"{_replica(value)}{path}" if TWINS in patches and _is_dtensor(value) else path]


def _leaves(obj: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, dict, str]]:
    """(dotted path, its dict, its key) of every value that is not a dict (lists and tuples are values)."""
    for key, value in obj.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _leaves(value, f"{path}.")
        else:
            yield path, obj, key


def _is_dtensor(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def _replica(t) -> str:
    """``replica<i>/`` for a shard held once per replica group (``i``: this rank's group), else empty."""
    coord = t.device_mesh.get_coordinate()
    group = [str(coord[d]) for d, p in enumerate(t.placements) if p.is_replicate()]
    return f"replica{'_'.join(group)}/" if group else ""
