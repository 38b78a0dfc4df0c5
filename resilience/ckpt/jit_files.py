"""What just-in-time checkpointing (``strategy=jit``) writes at a failure: a shard file on disk, and which shard of the
training state is this rank's (each rank's own parts, kept step by step in shared memory: ``jit_parts``).

**The shard file** (``shard-<k>-of-<S>.jit`` in ``<ckpt_dir>/step_NNNNNNNN/``): the state of one shard of the
training state at one step, as a survivor of a failure holds it (data-parallel replicas are identical, so one
survivor per shard writes it). A header (magic, where the skeleton and the data lie), the pickled skeleton (the
native state dicts with every tensor replaced by a ``codec.TensorRef``, as the in-memory snapshots lay it out), then
every tensor's bytes at an ``ALIGN``-ed offset. Written as a stream, each tensor's own bytes straight from its memory
(no staging copy: a survivor writes it inside the launcher's grace period), through the checkpoint file system with
its checksum summed as it is written (``dcp_files.ChecksumFileSystem``); read back once, verified
(``verified.read_verified``), then copied straight into the live tensors (``codec.StateCodec.decode``).
"""

from __future__ import annotations

import struct
from typing import Any, BinaryIO

import torch

from resilience.ckpt.codec import StateCodec, TensorRef, layout
from resilience.ckpt.shm_store import ALIGN
from resilience.ckpt.verified import CorruptFile
from resilience.state.train import TrainState

SHARD_SUFFIX = ".jit"
SHARD_MAGIC = b"RBJIT01\0"
SHARD_HEAD = struct.Struct("<8sQQQQ")  # magic, meta offset, meta length, data offset, data length
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


def shard_of(state: TrainState) -> tuple[int, int]:
    """Which shard of the training state this rank holds, and of how many: (0, 1) where every rank holds all of it
    (DDP); under HSDP its coordinate on the mesh's shard dimension (the ranks with the same one, one per replica
    group, hold the same shard: ``replica_shards.shard_key``)."""
    from torch.distributed.tensor import DTensor

    p = next(iter(state.model.parameters()))
    if not isinstance(p, DTensor):
        return 0, 1
    mesh = p.device_mesh
    names = mesh.mesh_dim_names or ()
    if "shard" in names:
        return mesh.get_local_rank("shard"), mesh.size(names.index("shard"))
    return mesh.get_rank(), mesh.size()  # each shard held once (fsdp): the table refuses it, no survivor holds it

