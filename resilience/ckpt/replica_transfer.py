"""The replica heal's state transfer, pipelined: every message in flight at once, small tensors packed into buckets.

``resilience.ckpt.transfer`` sends tensor after tensor with blocking ``send``/``recv``: each waits for the one
before, so a state of many small tensors (a transformer's ~250 parameters and AdamW moments) pays a round trip per
tensor, which on a busy host is a scheduling delay each (measured on ``gpt_small``: 8x the time of one flat send of
the same bytes; ``python -m resilience.bench.replica_peers --transfer``). Here the same protocol (the positions,
the most advanced replica as the source, the skeleton) moves the tensors with ``isend``/``irecv``:

* tensors of at least ``BUCKET_BYTES`` travel alone, straight into the receiver's own tensor (no copy);
* smaller ones are packed, in order, into buckets of about ``BUCKET_BYTES`` (one copy on each side, a bucket at a
  time, so the staging memory is at most ``WINDOW`` buckets);
* the receiver posts each receive as soon as its buffer exists, so allocating the next buffer (a replacement has no
  AdamW moments yet) overlaps the bytes already on the wire, and at most ``WINDOW`` buckets are in flight.

The bytes are copied, never converted: the healed state is bit-identical to the source's, as with the plain
transfer.

Under HSDP (``replica_shards``) a rank holds one shard of the state, and only the ranks holding the same shard in
other replica groups are its replicas: each rank behind takes its shard from such a rank, as local tensors. Under
``parallel=pp_dp`` a rank holds one pipeline stage, and its replicas are the ranks holding the same stage in the
other pipelines (``stage``): each rank behind takes its stage from its twin, as a whole model's state.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

# The plain transfer's state layout (a skeleton of slots, filled in the same order) is the protocol both share.
from resilience.ckpt.transfer import Reconciled, _bare, _fill, _hollow, _Slot, replica_state
from resilience.state.train import TrainState
from resilience.ckpt.replica_shards import load_local, localise, shard_key
from resilience.runtime.reduce import all_gather_single

BUCKET_BYTES = 16 << 20
WINDOW = 4  # buckets in flight at once: bounds the staging memory to WINDOW x BUCKET_BYTES


class NothingToRecover(RuntimeError):
    """The state to recover exists on no rank: the rank exits with ``NOTHING_TO_RECOVER_EXIT``."""


class ReplicasLost(NothingToRecover):
    """Every replica of one part of the state (a shard, a pipeline stage) was lost while the others live: the one
    line says which part and step (the supervisor's ``unrecoverable`` reason)."""


def reconcile(state: TrainState, position: int | None, device: torch.device, empty: bool = False,
              stage: int | None = None) -> Reconciled:
    """Make every rank hold the most advanced replica's state (collective), with the pipelined transfer: each rank
    behind takes its shard (DDP: the whole state) from a rank that holds the same shard at the newest position.
    ``empty``: this rank (position None) was built uninitialised and receives even at position 0. ``stage``: the
    pipeline stage this rank holds (``pp_dp``), its replicas the ranks holding the same stage."""
    rank, world = dist.get_rank(), dist.get_world_size()
    everyone = torch.empty(2 * world, dtype=torch.int64, device=device)
    mine = [(-2 if empty else -1) if position is None else position,
            shard_key(_bare(state)) if stage is None else stage]
    all_gather_single(everyone, torch.tensor(mine, dtype=torch.int64, device=device))
    at, key = everyone.tolist()[0::2], everyone.tolist()[1::2]  # -1: a replacement holding nothing; -2: built empty
    best = max(at)
    if best < 0:
        raise NothingToRecover("replica: no rank holds the training state (every replica was lost at once); "
                               "a strategy that checkpoints is needed to recover from this")
    # At position 0 nobody has stepped: every rank built the same initial state from the seed (but one built empty).
    behind = [r for r, p in enumerate(at) if p != best] if best > 0 else [r for r, p in enumerate(at) if p == -2]
    source = {r: _source(r, at, key, best, "shard" if stage is None else "stage") for r in range(world)}
    t0, nbytes = time.monotonic(), 0
    for dst in behind:
        if rank == source[dst]:
            nbytes += send_state(state, dst, device)
    if rank in behind:
        nbytes = recv_state(state, source[rank], device)
    return Reconciled(best, source[rank], rank in behind, nbytes, time.monotonic() - t0 if nbytes else 0.0)


def _source(rank: int, at: list[int], key: list[int], best: int, part: str) -> int:
    """The first rank holding ``rank``'s ``part`` (a shard, a stage) at position ``best`` (DDP: the first rank
    there, for every rank). None there: every rank says so alike (``ReplicasLost``), since each computes every
    rank's source from the same gathered positions."""
    holders = [r for r in range(len(at)) if key[r] == key[rank] and at[r] == best]
    if holders:
        return holders[0]
    kept = sorted({p for p, k in zip(at, key) if k == key[rank] and p >= 0})
    why = f"is at step {kept[-1]}, not with the others at {best}" if kept else "was lost (every replica of it)"
    raise ReplicasLost(f"replica: {part} {key[rank]} {why}; no rank holds its state of step {best}, and a strategy "
                       f"that checkpoints is needed to recover from this")


def buckets(slots: list[_Slot]) -> list[list[int]]:
    """Indices of ``slots`` grouped as they travel: a large tensor alone, consecutive small ones packed together."""
    out: list[list[int]] = []
    packed, size = [], 0
    for i, s in enumerate(slots):
        n = _nbytes(s)
        if n >= BUCKET_BYTES:
            out += [packed] if packed else []
            out.append([i])
            packed, size = [], 0
            continue
        packed.append(i)
        size += n
        if size >= BUCKET_BYTES:
            out.append(packed)
            packed, size = [], 0
    return out + ([packed] if packed else [])


def send_state(state: TrainState, dst: int, device: torch.device) -> int:
    """Send the model and optimizer state to rank ``dst`` (pipelined); return the bytes sent."""
    tensors: dict[str, torch.Tensor] = {}
    sharded: set[str] = set()
    skeleton = _hollow(localise(replica_state(state), sharded), tensors)
    dist.send_object_list([skeleton, sharded], dst=dst, device=device)
    flat = [t.detach().to(device).contiguous() for t in tensors.values()]
    works: list[tuple[Any, torch.Tensor]] = []  # each work with its buffer, alive until sent
    for group in buckets([_slot(t) for t in flat]):
        if len(works) >= WINDOW:
            works.pop(0)[0].wait()
        alone = len(group) == 1 and _nbytes(_slot(flat[group[0]])) >= BUCKET_BYTES
        buf = flat[group[0]] if alone else torch.cat([_bytes(flat[i]) for i in group])
        works.append((dist.isend(buf, dst=dst), buf))
    for work, _ in works:
        work.wait()
    return sum(t.numel() * t.element_size() for t in flat)


def recv_state(state: TrainState, src: int, device: torch.device) -> int:
    """Receive what ``send_state`` sends and load it into ``state``; return the bytes received. A tensor that
    matches this rank's own one at the same place is received (or unpacked) straight into it."""
    box: list[Any] = [None, None]
    dist.recv_object_list(box, src=src, device=device)
    own: dict[str, torch.Tensor] = {}
    _hollow(localise(replica_state(state), set()), own)
    slots: list[_Slot] = []
    _fill(box[0], slots.append)
    targets = [_target(own.get(s.path), s, device) for s in slots]
    pending: list[tuple[Any, list[int], torch.Tensor | None]] = []
    for group in buckets(slots):
        if len(pending) >= WINDOW:
            _unpack(*pending.pop(0), targets)
        if len(group) == 1 and _nbytes(slots[group[0]]) >= BUCKET_BYTES:
            pending.append((dist.irecv(targets[group[0]], src=src), group, None))
        else:
            staging = torch.empty(sum(_nbytes(slots[i]) for i in group), dtype=torch.uint8, device=device)
            pending.append((dist.irecv(staging, src=src), group, staging))
    for item in pending:
        _unpack(*item, targets)
    received = iter(t.to(s.device) for t, s in zip(targets, slots))  # no copy where the device is the same
    loaded = _fill(box[0], lambda _: next(received))
    if box[1]:  # shards: wrapped again with this rank's own mesh and placements
        load_local(state, loaded, box[1])
    else:
        _bare(state).load_state_dict(loaded["model"])
        state.optimizer.load_state_dict(loaded["optim"])
    state.parts.load_state_dict(loaded)
    return sum(_nbytes(s) for s in slots)


def _unpack(work: Any, group: list[int], staging: torch.Tensor | None, targets: list[torch.Tensor]) -> None:
    work.wait()
    if staging is None:
        return
    offset = 0
    for i in group:
        n = targets[i].numel() * targets[i].element_size()
        _bytes(targets[i]).copy_(staging[offset:offset + n])
        offset += n


def _target(mine: torch.Tensor | None, slot: _Slot, device: torch.device) -> torch.Tensor:
    """This rank's own tensor when it matches the slot (received in place), else a new one."""
    if (mine is not None and tuple(mine.shape) == slot.shape and mine.dtype == slot.dtype and mine.device == device
            and mine.is_contiguous()):
        return mine
    return torch.empty(slot.shape, dtype=slot.dtype, device=device)


def _slot(t: torch.Tensor) -> _Slot:
    return _Slot("", tuple(t.shape), t.dtype, str(t.device))


def _nbytes(slot: _Slot) -> int:
    return torch.Size(slot.shape).numel() * torch.empty((), dtype=slot.dtype).element_size()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's storage as flat bytes (a view: writing it writes the tensor)."""
    return t.detach().reshape(-1).view(torch.uint8) if t.dim() else t.detach().reshape(1).view(torch.uint8)
