"""How the in-memory strategy lays training state out in a snapshot, and restores it.

A snapshot holds the *native* state dicts, ``{"model": model.state_dict(), "optim": optimizer.state_dict()}``:
the tensor bytes, each at a 64-byte-aligned offset, plus a pickled *skeleton*, the same nesting with every tensor
replaced by a ``TensorRef`` (key, dtype, shape, offset) and every other leaf (hyperparameters, step counts that
are not tensors) kept. Native, not DCP's fully-qualified form (``TrainState.state_dict``), because a restarted
rank then restores without DCP's conversions and without initialising a fresh optimizer's state by a zero-lr
step: every tensor the model and optimizer already hold (parameters, buffers, and the state of an optimizer that
creates it up front, like Adagrad) is read in place, and the optimizer adopts the others, freshly read. A
snapshot is read back only by the same run, so the model and optimizer are built the same way.
"""

from __future__ import annotations

import pickle
from typing import Any, Callable, NamedTuple

import torch

from resilience.state.train import TrainState, map_tensors
from resilience.ckpt.digest import CURRENT
from resilience.ckpt.prefault import new_tensor
from resilience.ckpt.shm_store import ALIGN
from resilience.ckpt.snapshot import is_sharded, local_part


class TensorRef(NamedTuple):
    """Where one tensor of a snapshot lies in its slot's data (the skeleton holds these instead of tensors)."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def snapshot_state(state: TrainState) -> dict[str, Any]:
    """What a snapshot holds; its tensors are the model's and the optimizer's own (no copies). Of a sharded tensor
    (a ``DTensor``, ``parallel=fsdp|hsdp``) it holds the local shard: each rank snapshots its own shards."""
    return map_tensors(local_part, native_state(state))


def native_state(state: TrainState) -> dict[str, Any]:
    """Model and optimizer, natively, and the job's other parts (bytes: the skeleton keeps them)."""
    return {"model": state.model.state_dict(), "optim": state.optimizer.state_dict(), **state.parts.state_dict()}


def tensor_leaves(obj: Any, key: str = "") -> dict[str, torch.Tensor]:
    """Every tensor leaf of ``obj``, under the key ``StateCodec.encode`` gives it."""
    if isinstance(obj, torch.Tensor):
        return {key: obj}
    out: dict[str, torch.Tensor] = {}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for k, v in items:
        out.update(tensor_leaves(v, f"{key}.{k}"))
    return out


def layout(sd: dict[str, Any]) -> tuple[bytes, list[tuple[TensorRef, torch.Tensor]], int]:
    """The skeleton of ``sd`` (pickled, each tensor a ``TensorRef`` keyed as ``tensor_leaves`` keys it), its tensors
    with their places (each at an ``ALIGN``ed offset) and the data's length: what a snapshot or a shard file holds."""
    tensors: list[tuple[TensorRef, torch.Tensor]] = []
    end = 0

    def walk(obj: Any, key: str) -> Any:
        nonlocal end
        if isinstance(obj, torch.Tensor):
            ref = TensorRef(key, obj.dtype, tuple(obj.shape), end, obj.numel() * obj.element_size())
            end += -(-ref.nbytes // ALIGN) * ALIGN
            tensors.append((ref, obj))
            return ref
        if isinstance(obj, dict):
            return {k: walk(v, f"{key}.{k}") for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(walk(v, f"{key}.{i}") for i, v in enumerate(obj))
        return obj

    meta = pickle.dumps(walk(sd, ""), protocol=pickle.HIGHEST_PROTOCOL)
    return meta, tensors, end


class StateCodec:
    """State dict <-> (tensor bytes, skeleton).

    Contract: ``encode(sd, checksum)`` returns (data_len, meta, fill): ``fill(buf)`` copies every tensor of ``sd``
    into ``buf`` and returns the checksum (``digest.CURRENT``) of the tensor bytes in skeleton order (None unless
    ``checksum``). ``decode(meta,
    read, live)`` rebuilds the state dict: a tensor whose key is in ``live`` is read into that tensor (dtype and
    shape must match), any other into a new CPU tensor; ``read(ref, dst)`` does the reading. Every ``live`` key
    must be in the snapshot.
    """

    def encode(self, sd: dict[str, Any], checksum: bool) -> tuple[int, bytes, Callable[[torch.Tensor], int | None]]:
        meta, tensors, end = layout(sd)

        def fill(buf: torch.Tensor) -> int | None:
            running = CURRENT.new() if checksum else None
            for ref, t in tensors:
                if ref.nbytes:
                    part = buf[ref.offset:ref.offset + ref.nbytes]
                    part.copy_(t.detach().reshape(-1).view(torch.uint8))
                    if running is not None:  # right after the copy, while the bytes are still in cache
                        running.update(memoryview(part.numpy()))
            return running.value if running is not None else None

        return end, meta, fill

    def ranges(self, meta: bytes) -> list[tuple[int, int]]:
        """(offset, nbytes) of every tensor in skeleton order: the bytes ``fill``'s and a load's checksum cover (the
        alignment gaps between tensors are not part of it)."""
        out: list[tuple[int, int]] = []
        self.decode(meta, lambda ref, dst: out.append((ref.offset, ref.nbytes)), {}, make=lambda ref: None)
        return out

    def decode(self, meta: bytes, read: Callable[[TensorRef, torch.Tensor], None],
               live: dict[str, torch.Tensor], make: Callable[[TensorRef], Any] | None = None) -> dict[str, Any]:
        live = dict(live)
        make = make or (lambda ref: new_tensor(ref.shape, ref.dtype))

        def walk(obj: Any) -> Any:
            if isinstance(obj, TensorRef):
                dst = live.pop(obj.key, None)
                if dst is None:  # uninitialised (the read fills it), its pages faulted in at once (prefault)
                    dst = make(obj)
                elif dst.dtype != obj.dtype or tuple(dst.shape) != obj.shape:
                    raise RuntimeError(f"in-memory snapshot does not match the training state at {obj.key}")
                read(obj, dst)
                return dst
            if isinstance(obj, dict):
                return {k: walk(v) for k, v in obj.items()}
            if isinstance(obj, (list, tuple)):
                return type(obj)(walk(v) for v in obj)
            return obj

        restored = walk(pickle.loads(meta))
        if live:
            raise RuntimeError(f"in-memory snapshot lacks {sorted(live)[:3]} of the training state")
        return restored


def restore(state: TrainState, restored: dict[str, Any]) -> None:
    """Put a snapshot decoded with ``live=tensor_leaves(snapshot_state(state))`` into ``state``. The model's tensors
    were read in place: ``load_state_dict``, which would copy each onto itself, runs only if one of them is not a
    parameter's or buffer's own memory. The optimizer adopts its tensors (same dtype and device: no copy)."""
    live = tensor_leaves(native_state(state))
    if any(is_sharded(t) for t in live.values()):
        restored = _as_sharded(restored, live)
    owned = {local_part(t).data_ptr() for t in (*state.model.parameters(), *state.model.buffers())}
    if not all(local_part(t).data_ptr() in owned for t in tensor_leaves(restored["model"]).values()):
        state.model.load_state_dict(restored["model"])
    state.optimizer.load_state_dict(restored["optim"])
    state.parts.load_state_dict(restored)


def _as_sharded(restored: Any, live: dict[str, torch.Tensor], key: str = "") -> Any:
    """``restored`` with each local shard read in place given back as its ``DTensor`` (the optimizer must adopt
    sharded state). Every sharded tensor must have been read in place: the load creates the optimizer's state
    first (``inmemory``), since a new local tensor has no sharding to wrap it in."""
    if isinstance(restored, torch.Tensor):
        whole = live.get(key)
        if whole is None or not is_sharded(whole):
            return restored
        if local_part(whole).data_ptr() != restored.data_ptr():
            raise RuntimeError(f"in-memory snapshot: the shard of {key} was not read into the live tensor")
        return whole
    items = restored.items() if isinstance(restored, dict) else enumerate(restored) \
        if isinstance(restored, (list, tuple)) else None
    if items is None:
        return restored
    walked = {k: _as_sharded(v, live, f"{key}.{k}") for k, v in items}
    return walked if isinstance(restored, dict) else type(restored)(walked.values())
