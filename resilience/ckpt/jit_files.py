"""What just-in-time checkpointing (``strategy=jit``) keeps, and where: a shard file on disk, written at a failure,
and each rank's own parts of the job's state in its node's shared memory, step by step.

**The shard file** (``shard-<k>-of-<S>.jit`` in ``<ckpt_dir>/step_NNNNNNNN/``): the state of one shard of the
training state at one step, as a survivor of a failure holds it (data-parallel replicas are identical, so one
survivor per shard writes it). A header (magic, where the skeleton and the data lie), the pickled skeleton (the
native state dicts with every tensor replaced by a ``codec.TensorRef``, as the in-memory snapshots lay it out), then
every tensor's bytes at an ``ALIGN``-ed offset. Written as a stream, each tensor's own bytes straight from its memory
(no staging copy: a survivor writes it inside the launcher's grace period), through the checkpoint file system with
its checksum summed as it is written (``dcp_files.ChecksumFileSystem``); read back once, verified
(``verified.read_verified``), then copied straight into the live tensors (``codec.StateCodec.decode``).

**The per-rank parts** (``RankParts``): a rank's RNG streams and data loader position are on no replica, so every
rank keeps its own, as they stand at a step's boundary, in a small file of its node's shared memory (``/dev/shm``:
it outlives the rank's process, as the in-memory strategy's areas do) and a copy in the next node's (which
``node_loss`` does not take with it). Two slots by the step's parity: the state at the step being trained and at the
one before, each written whole and renamed into place (never torn), with a checksum. Names follow
``shm_store.area_path``, so the run's clean-up and a node's loss (``node_memory``) find them as they find areas.
"""

from __future__ import annotations

import pickle
import struct
from pathlib import Path
from typing import Any, BinaryIO

import torch

from resilience.ckpt import sealed
from resilience.ckpt.codec import StateCodec, TensorRef, layout
from resilience.ckpt.node_memory import NodeMemory
from resilience.ckpt.shm_store import ALIGN, area_path
from resilience.ckpt.verified import CorruptFile

SHARD_SUFFIX = ".jit"
SHARD_MAGIC = b"RBJIT01\0"
SHARD_HEAD = struct.Struct("<8sQQQQ")  # magic, meta offset, meta length, data offset, data length
PARTS_MAGIC = b"RBPRT01\0"
_ZEROS = bytes(ALIGN)


def shard_name(shard: int, shards: int) -> str:
    return f"shard-{shard:05d}-of-{shards:05d}{SHARD_SUFFIX}"


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def write_shard(stream: BinaryIO, sd: dict[str, Any]) -> int:
    """Write ``sd`` (tensors and plain values) to ``stream`` as one shard file; return its length in bytes."""
    meta, tensors, data_len = layout(sd)
    meta_off = SHARD_HEAD.size
    data_off = _aligned(meta_off + len(meta))
    stream.write(SHARD_HEAD.pack(SHARD_MAGIC, meta_off, len(meta), data_off, data_len))
    stream.write(meta)
    stream.write(_ZEROS[:data_off - meta_off - len(meta)])
    at = 0
    for ref, t in tensors:
        if not ref.nbytes:
            continue
        stream.write(_ZEROS[:ref.offset - at])
        src = t.detach()
        src = src.cpu() if src.device.type != "cpu" else src  # a CUDA tensor: one host copy, then written
        stream.write(memoryview(src.contiguous().reshape(-1).view(torch.uint8).numpy()))
        at = ref.offset + ref.nbytes
    stream.write(_ZEROS[:data_len - at])
    return data_off + data_len


def read_shard(buf: memoryview, live: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The state dict of a verified shard file's bytes ``buf``; a tensor whose key is in ``live`` is read into that
    tensor (``StateCodec.decode``'s contract), any other into a new CPU tensor."""
    if len(buf) < SHARD_HEAD.size:
        raise CorruptFile("a just-in-time shard shorter than its header")
    magic, meta_off, meta_len, data_off, data_len = SHARD_HEAD.unpack_from(buf, 0)
    if magic != SHARD_MAGIC or data_off + data_len > len(buf) or meta_off + meta_len > data_off:
        raise CorruptFile("not a just-in-time shard (its header)")

    def read(ref: TensorRef, dst: torch.Tensor) -> None:
        direct = dst.device.type == "cpu" and dst.is_contiguous()
        target = dst if direct else torch.empty(dst.shape, dtype=dst.dtype)
        if ref.nbytes:
            view = memoryview(target.reshape(-1).view(torch.uint8).numpy())
            view[:] = buf[data_off + ref.offset:data_off + ref.offset + ref.nbytes]
        if not direct:
            dst.copy_(target)

    return StateCodec().decode(bytes(buf[meta_off:meta_off + meta_len]), read, live)


class RankParts:
    """One rank's own parts of the job's state at a step (``{name: part.state_dict()}``, pickled as they are: a
    fifth of ``torch.save``'s cost, which a per-step copy would pay), in its node's shared memory and in a copy on
    the next node (``ranks_per_node`` apart; none when every rank is on one node). ``put`` keeps the two latest
    steps (slot = step % 2); ``get`` finds a step in the own copy, else the peer's."""

    def __init__(self, rid: str, rank: int, world_size: int, ranks_per_node: int, memory: NodeMemory) -> None:
        self.rid, self.rank, self.rpn, self.memory = rid, rank, ranks_per_node, memory
        self.node = rank // ranks_per_node
        holder = (rank + ranks_per_node) % world_size
        self.peer = holder if holder // ranks_per_node != self.node else None

    def _path(self, holder: int, slot: int) -> Path:
        path = area_path(self.rid, holder // self.rpn, holder, self.rank)
        return path.with_name(f"{path.name}-parts{slot}")

    def put(self, step: int, attempt: int, parts: dict[str, Any]) -> int:
        """Keep ``parts`` as the state at ``step``; return the bytes of one copy."""
        payload = pickle.dumps(parts, protocol=pickle.HIGHEST_PROTOCOL)
        seal = sealed.head(PARTS_MAGIC, step, attempt, payload)
        nbytes = sealed.write_whole(self._path(self.rank, step % 2), seal, payload)
        if self.peer is not None and not self.memory.lost(self.peer // self.rpn):  # a lost node holds nothing
            sealed.write_whole(self._path(self.peer, step % 2), seal, payload)
        return nbytes

    def get(self, step: int) -> tuple[dict[str, Any], str] | None:
        """The parts at ``step`` and where they were (``memory``: own node, ``peer_memory``), or None."""
        for holder, where in ((self.rank, "memory"), (self.peer, "peer_memory")):
            if holder is None:
                continue
            found = _read_parts(self._path(holder, step % 2), step)
            if found is not None:
                return found, where
        return None


def _read_parts(path: Path, step: int) -> dict[str, Any] | None:
    found = sealed.read(path, PARTS_MAGIC)
    if found is None or found[0] != step:
        return None  # none, another step's, or wiped (a node loss zeroes the file before it goes)
    return pickle.loads(found[2])
