"""Host-memory snapshots of training state: the fast first phase of a two-phase (CheckFreq-style) checkpoint.

A snapshot copies every tensor of a state dict that this rank will write into host buffers that are allocated
once and reused, so that a checkpoint costs training a memcpy, not an allocation (first-touch page faults cost
more than the copy itself: ~0.4 GB/s against ~15 GB/s on the reference machine).

Data-parallel ranks hold identical replicas, so each rank snapshots and writes only its *share*: tensors are
assigned to ranks by a deterministic size-balanced partition that every rank computes alone. DCP merges the
ranks' disjoint plans into one checkpoint, loadable like any other (every rank then reads every key).

Sharded ranks (``parallel=fsdp|hsdp``: the state dict holds ``DTensor``s) hold different data, so each rank
snapshots every key: the local shard of each ``DTensor`` (re-wrapped around the buffer, so that DCP writes it as
this rank's piece of the global tensor) and every plain tensor (DCP deduplicates those, and the replicas' shards).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from resilience.record.torch_workarounds import declare

_OMIT = object()  # marks a tensor that another rank writes
SHARD_SPEC = declare(
    "dtensor_from_spec", "a host buffer becomes this rank's shard of the global tensor without a move to the device "
    "(DTensor.from_local would move it): DTensor's own constructor with the live tensor's private _spec, as torch's "
    "CPU staging does", ("2.13.0",), __name__)


def local_part(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a ``DTensor``'s local shard, a plain tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def is_sharded(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _join(prefix: str, key: Any) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def flat_tensors(obj: Any, prefix: str = "", in_list: bool = False) -> dict[str, tuple[torch.Tensor, bool]]:
    """Every tensor leaf of a nested dict/list/tuple: dotted path -> (tensor, whether a list holds it).

    Tensors inside lists are written by every rank (DCP deduplicates them): leaving one out would shift the
    indices, and so the keys, of the elements after it.
    """
    if isinstance(obj, torch.Tensor):
        return {prefix: (obj, in_list)}
    out: dict[str, tuple[torch.Tensor, bool]] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flat_tensors(v, _join(prefix, k), in_list))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(flat_tensors(v, _join(prefix, i), True))
    return out


def assign_shares(sizes: dict[str, int], world_size: int) -> dict[str, int]:
    """Owner rank of each key: largest first to the least-loaded rank (ties: lower rank), keys sorted for ties.

    A pure function of the keys and sizes, identical on every rank without communication.
    """
    load = [0] * world_size
    owner = {}
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):
        r = min(range(world_size), key=lambda i: (load[i], i))
        owner[key] = r
        load[r] += sizes[key]
    return owner


def layout_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The state dict ``TrainState.state_dict`` will return once the optimizer has stepped, as tensors on the meta
    device (dtype and shape, no memory), without touching the real optimizer.

    An optimizer that creates its state at its first step (Adam) has none before it, and DCP's ``get_state_dict``
    fills it by a zero-learning-rate step, which would advance the real step count. So the step is taken on a copy
    whose parameters, buffers and existing state are meta tensors: the same code path, the same keys and shapes.
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict

    inner = getattr(model, "module", model)  # a DDP wrapper holds a process group: copy what it wraps
    memo: dict[int, Any] = {}
    for t in (*inner.parameters(), *inner.buffers()):
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                memo[id(v)] = torch.empty_like(v, device="meta")
    shadow_model, shadow_optim = copy.deepcopy((inner, optimizer), memo)
    model_sd, optim_sd = get_state_dict(shadow_model, shadow_optim)
    return {"model": model_sd, "optim": optim_sd}


class HostSnapshot:
    """Reusable host buffers for this rank's share of a state dict.

    Contract: ``capture(sd)`` returns a state dict with the same nesting as ``sd`` whose tensors are this rank's
    buffers holding a copy of ``sd`` as it was during the call (non-tensor leaves are deep-copied). The returned
    dict stays valid, and unchanged, until the next ``capture``; the caller must not start a new capture while
    anything still reads the previous one (the strategy guarantees that by allowing one persist at a time).
    """

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self._buffers: dict[str, torch.Tensor] = {}
        self._layout: dict[str, tuple] = {}
        self.allocated = 0  # bytes the last ``capture`` had to allocate (0: reserved beforehand)
        self._captured = False  # the buffers' layout is that of a captured state, not only a reserved one

    @property
    def captured(self) -> bool:
        """Whether a capture has written the buffers (a persist may read them from then on)."""
        return self._captured

    @property
    def nbytes(self) -> int:
        """Host memory held by the buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def reserve(self, sd: dict[str, Any]) -> int:
        """Allocate (and touch) the buffers for ``sd``'s layout now, outside any stall; return bytes held. ``sd``
        may hold meta tensors (``layout_state_dict``): only dtypes and shapes are read."""
        flat = flat_tensors(sd)
        tensors = {k: (local_part(t), shared) for k, (t, shared) in flat.items()}
        layout = {k: (t.dtype, tuple(t.shape)) for k, (t, _) in tensors.items()}
        if layout == self._layout:
            return self.nbytes
        if any(is_sharded(t) for t, _ in flat.values()):  # every rank's data is its own: it keeps all of it
            owner = dict.fromkeys(tensors, self.rank)
        else:
            owner = assign_shares({k: t.numel() * t.element_size() for k, (t, shared) in tensors.items()
                                   if not shared}, self.world_size)
        pin = torch.cuda.is_available()  # pinned buffers make device-to-host copies asynchronous and faster
        self._buffers = {}
        for k, (t, shared) in tensors.items():
            if shared or owner[k] == self.rank:
                buf = torch.zeros(t.shape, dtype=t.dtype, device="cpu")  # zeros: fault the pages in here
                self._buffers[k] = buf.pin_memory() if pin else buf
        self._layout = layout
        return self.nbytes

    def capture(self, sd: dict[str, Any], same_tensors: bool = False) -> dict[str, Any]:
        """Copy this rank's share of ``sd`` into the buffers; return the snapshot state dict (see class doc).
        ``same_tensors``: ``sd`` holds the very tensors of the previous capture, whose layout is the buffers'."""
        before = self._layout
        if not (same_tensors and self._captured):
            self.reserve(sd)  # a no-op unless the layout changed
        self.allocated = self.nbytes if self._layout is not before else 0
        snap = self._copy(sd, "")
        self._captured = True
        if any(b.is_pinned() for b in self._buffers.values()):
            torch.cuda.synchronize()  # non-blocking device-to-host copies must land before anyone reads them
        return snap

    def _copy(self, obj: Any, prefix: str) -> Any:
        if isinstance(obj, torch.Tensor):
            buf = self._buffers.get(prefix)
            if buf is None:
                return _OMIT
            buf.copy_(local_part(obj.detach()), non_blocking=buf.is_pinned())
            if is_sharded(obj):
                # The host buffer as this rank's shard of the global tensor, with the live tensor's sharding spec
                # (as torch's own CPU staging does, _state_dict_utils): ``from_local`` would move it to the device.
                from torch.distributed.tensor import DTensor

                SHARD_SPEC.acted()  # declared by the rank before its event log closes (declare_acted)
                return DTensor(buf, obj._spec, requires_grad=False)
            return buf
        if isinstance(obj, dict):
            items = ((k, self._copy(v, _join(prefix, k))) for k, v in obj.items())
            return {k: v for k, v in items if v is not _OMIT}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._copy(v, _join(prefix, i)) for i, v in enumerate(obj))  # never omitted
        return copy.deepcopy(obj)
