"""The replica heal under HSDP: a rank's shard travels as local tensors, and the survivors rebuild their model.

Under ``parallel=hsdp`` rank ``r`` holds shard ``r % S`` of replica ``r // S`` (``resilience.parallel.hsdp``); the
parameters and the optimizer's moments are ``DTensor``s whose local part is that shard. A lost rank's shard
exists once more, in the rank holding the same shard of another replica group: the heal (``replica_transfer``)
sends the replacement those local tensors only (one shard's bytes) and wraps them again with the receiver's own
mesh and placements.

The survivors cannot keep their model: FSDP2 and its ``DeviceMesh`` hold the broken generation's process groups
(the mesh keeps the group objects themselves), and a group closes its sockets only when nothing refers to it any
more. A survivor blocked in a collective with a peer that failed elsewhere (a rank of the other replica group,
waiting in the all-reduce across replicas) learns of the failure only then. So a survivor first keeps its state as
plain local tensors and lets go of every ``DTensor`` (``release``); after the group is re-formed it builds the
model again over the new mesh, on the meta device (every byte is overwritten), and loads the kept tensors into it
(``rebuild``): a copy in memory, no transfer.
"""

from __future__ import annotations

import gc
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from resilience.record.torch_workarounds import declare
from resilience.runtime.rank import RankRuntime
from resilience.state.train import TrainState

FORGET_GROUPS = declare(
    "forget_broken_groups", "a broken process group closes its sockets only once nothing refers to it, and DTensor's "
    "caches and FSDP's DataParallelMeshInfo (private _fsdp_common) keep it: a gc.get_objects() sweep clears the "
    "meshes' _pg_registry and the mesh infos' groups", ("2.13.0",), __name__)


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def shard_key(model: nn.Module) -> int:
    """Which shard of the state this rank holds: ranks with the same key are replicas of each other (0 for DDP,
    where every rank holds the whole state)."""
    from torch.distributed.tensor import DTensor

    p = next(iter(model.parameters()))
    if not isinstance(p, DTensor):
        return 0
    mesh = p.device_mesh
    return mesh.get_local_rank("shard") if mesh.mesh_dim_names and "shard" in mesh.mesh_dim_names else mesh.get_rank()


def localise(obj: Any, sharded: set[str], path: str = "") -> Any:
    """``obj`` with every ``DTensor`` replaced by its local part (a view, no copy), whose path (as
    ``transfer._hollow`` names it) goes into ``sharded``."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        sharded.add(path)
        return obj.to_local()
    if isinstance(obj, dict):
        return {k: localise(v, sharded, f"{path}/{k}") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(localise(v, sharded, f"{path}/{i}") for i, v in enumerate(obj))
    return obj


def load_local(state: TrainState, loaded: dict[str, Any], sharded: set[str]) -> None:
    """Load a state of local tensors (``localise``'s form) into ``state``: the tensors at ``sharded`` paths are
    wrapped again with the mesh and placements of this rank's own parameter they belong to."""
    from torch.distributed.tensor import DTensor

    model = _bare(state)
    by_name = dict(model.named_parameters())
    by_index = [p for g in state.optimizer.param_groups for p in g["params"]]

    def like(path: str) -> torch.Tensor:  # /model/<fqn> or /optim/state/<index>/<key>
        parts = path.split("/")
        return by_name[parts[2]] if parts[1] == "model" else by_index[int(parts[3])]

    def wrap(obj: Any, path: str = "") -> Any:
        if isinstance(obj, torch.Tensor):
            if path not in sharded:
                return obj
            p = like(path)
            return DTensor.from_local(obj, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                      stride=p.stride())
        if isinstance(obj, dict):
            return {k: wrap(v, f"{path}/{k}") for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(wrap(v, f"{path}/{i}") for i, v in enumerate(obj))
        return obj

    full = wrap(loaded)
    model.load_state_dict(full["model"])
    state.optimizer.load_state_dict(full["optim"])


@dataclass
class Held:
    """A survivor's state while it has no model: local tensors, and the optimizer's parameters by name."""

    state: dict[str, Any]
    sharded: set[str]
    groups: list[list[str]]  # each optimizer param group's parameters, by fully qualified name


def release(state: TrainState, error: BaseException) -> Held:
    """Keep the state as local tensors and drop every reference to the broken groups (see the module docstring)."""
    from resilience.ckpt.transfer import replica_state

    model = _bare(state)
    sharded: set[str] = set()
    kept = localise(replica_state(state), sharded)
    name_of = {id(p): n for n, p in model.named_parameters()}
    groups = [[name_of[id(p)] for p in g["params"]] for g in state.optimizer.param_groups]
    state.optimizer.state.clear()
    for g in state.optimizer.param_groups:
        g["params"] = []
    state.model = None
    del model
    if error.__traceback__ is not None:  # the failed collective's frames hold FSDP's objects, and so the groups
        traceback.clear_frames(error.__traceback__)
    gc.collect()  # FSDP's hooks make cycles: the groups close their sockets only once these are collected
    FORGET_GROUPS.acted()  # the survivor lives on: it declares it before its event log closes (declare_acted)
    _forget_groups()
    return Held(kept, sharded, groups)


def _forget_groups() -> None:
    """Drop the references to the broken groups that outlive the model: meshes stay in DTensor's caches
    (sharding propagation, redistribution plans, topology, keyed by the mesh) with their registry of groups, and
    FSDP's mesh infos stay reachable from the failed step's autograd nodes (held in C++). Neither is used again:
    the rebuilt model has its own mesh. Called before the group is re-formed, so every group alive is a broken one."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp._fully_shard._fsdp_common import DataParallelMeshInfo

    for obj in gc.get_objects():
        if isinstance(obj, DeviceMesh) and isinstance(getattr(obj, "_pg_registry", None), dict):
            obj._pg_registry.clear()
        elif isinstance(obj, DataParallelMeshInfo):
            for name, value in list(vars(obj).items()):
                if isinstance(value, dist.ProcessGroup):
                    setattr(obj, name, None)


def rebuild(state: TrainState, rt: RankRuntime, held: Held) -> None:
    """The model again, sharded over the re-formed group, holding ``held``'s state; the same optimizer object."""
    with torch.device("meta"):
        bare = rt.build_model()
    model = rt.wrap_model(bare)
    model.to_empty(device=rt.device)  # uninitialised: load_local overwrites every parameter
    params = dict(model.named_parameters())
    for g, names in zip(state.optimizer.param_groups, held.groups):
        g["params"] = [params[n] for n in names]
    state.model = model
    load_local(state, held.state, held.sharded)


def _bare(state: TrainState) -> nn.Module:
    return getattr(state.model, "module", state.model)
