"""Incremental checkpoints of embedding tables (Check-N-Run, Eisenman et al., NSDI'22): what a link of a chain holds,
how its files are laid out, how rows are quantized, and how a chain is pruned.

The state splits in two (``split_state``). *Row tensors*: each parameter whose gradient is sparse (an
``nn.Embedding(sparse=True)``: a table) and every optimizer state tensor of the same shape (Adagrad's ``sum``), all
indexed by the table's rows. *Dense state*: everything else, in the native state dicts (the dense parameters, the
optimizer's other state and its param groups, the job's parts: LR schedule, scaler, counters, RNG, data loader).

A *base* link holds every row; an *increment* holds the rows touched since the previous link of its chain (with
their indices) and the whole dense state again. Restoring is the base's rows, then each increment's rows in order,
then the last link's dense state: the state of the last link, bit for bit where the rows are stored raw.

One link is the directory of one step (``commit.CheckpointDir``): ``rank<r>.rows`` (raw tensor bytes) and
``rank<r>.index`` (what is where: pickled) from each rank, and rank 0's ``.metadata`` (JSON: the link's kind and
its chain, each link as ``[step, id]``; a link written anew at the same step has another id, so an older chain that
named the old one is seen to be broken). Table ``j`` is written by rank ``j % world_size``; the dense state by rank
0; a rank's own parts (RNG, data loader) by that rank. Every file is summed as it is written (``ChecksumFileSystem``)
and the directory is committed like ``sync``'s.

Row values may be stored quantized (``quantize``): per-row min/max affine 8-bit (each row: ``lo``, ``scale`` and one
byte per element), as Check-N-Run does, or fp16. The optimizer's row state is always stored raw.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import uuid
from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple

import numpy as np
import torch
from torch import nn

from resilience.ckpt.commit import CheckpointDir, CheckpointEntry
from resilience.state.train import TrainState

LINK_META = ".metadata"  # the link's own record (rank 0): in commit.METADATA_FILES, so a fault can aim at it
BASE, INCREMENT = "base", "increment"
CODECS = ("raw", "q8", "f16")


def rows_file(rank: int) -> str:
    return f"rank{rank}.rows"


def index_file(rank: int) -> str:
    return f"rank{rank}.index"


def new_link_id() -> str:
    return uuid.uuid4().hex[:16]


# ---- the state, split ---------------------------------------------------------------------------------------------

def sparse_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters whose gradient is sparse (``nn.Embedding``/``EmbeddingBag`` with ``sparse=True``), in the
    module's order: the tables (as ``detectors.replica_fingerprint.sparse_grad_params`` finds them)."""
    seen: set[int] = set()
    out = []
    for m in model.modules():
        if getattr(m, "sparse", False) is True:
            for p in m.parameters(recurse=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
    return out


class RowMarker(NamedTuple):
    """In a dense skeleton: the place of a row tensor, restored from the chain's rows."""

    key: str


class TensorRef(NamedTuple):
    """Where a tensor's bytes lie in a rank's ``.rows`` file."""

    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


@dataclass
class RowTensor:
    key: str  # model/<name> or optim/<index>/<state name>
    tensor: torch.Tensor  # the live tensor, rows along dim 0
    table: int  # the number of the table it follows (its writer: table % world_size)
    values: bool  # the table's own values (which ``quantize`` may store approximately), not optimizer state


def split_state(state: TrainState) -> tuple[dict[str, Any], dict[str, Any], list[RowTensor]]:
    """(dense job-wide state, this rank's own parts, row tensors): native state dicts, every row tensor replaced by a
    ``RowMarker`` in the dense state; the tensors are the live ones (no copy)."""
    model, optimizer = state.model, state.optimizer
    tables = sparse_params(model)
    number = {id(p): j for j, p in enumerate(tables)}
    names = {id(p): n for n, p in model.named_parameters()}
    model_sd = model.state_dict()
    rows: list[RowTensor] = []
    for j, p in enumerate(tables):
        name = names[id(p)]
        rows.append(RowTensor(f"model/{name}", model_sd[name], j, True))
        model_sd[name] = RowMarker(f"model/{name}")
    optim_sd = optimizer.state_dict()
    order = [p for g in optimizer.param_groups for p in g["params"]]
    states = dict(optim_sd["state"])
    for i, p in enumerate(order):
        if id(p) not in number or i not in states:
            continue
        own = dict(states[i])
        for k, v in own.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == p.shape:
                rows.append(RowTensor(f"optim/{i}/{k}", v, number[id(p)], False))
                own[k] = RowMarker(f"optim/{i}/{k}")
        states[i] = own
    optim_sd = {**optim_sd, "state": states}
    dense = {"model": model_sd, "optim": optim_sd, **state.parts.state_dict(list(state.parts.job))}
    return dense, state.parts.state_dict(list(state.parts.per_rank)), rows


# ---- quantization -------------------------------------------------------------------------------------------------

def quantize(values: torch.Tensor, bits: int | None) -> tuple[str, dict[str, torch.Tensor]]:
    """Rows ``values`` (n x d) as stored: ``raw`` (bits None), ``f16`` (16: clamped to fp16's range), or ``q8`` (8:
    per row ``lo`` = its min, ``scale`` = (max - min) / 255, and ``q`` = round((x - lo) / scale) in one byte; a
    constant row has scale 0 and q 0). Error per element: fp16 rounding; q8 at most ``scale / 2`` (plus fp32's
    rounding of ``lo + q * scale``)."""
    if bits is None:
        return "raw", {"values": values}
    if bits == 16:
        big = torch.finfo(torch.float16).max
        return "f16", {"values": values.float().clamp(-big, big).to(torch.float16)}
    if bits != 8:
        raise ValueError(f"bits={bits}: must be 8 or 16")
    x = values.float().reshape(values.shape[0], -1)
    if x.shape[0] == 0 or x.shape[1] == 0:
        empty = torch.zeros(x.shape[0], dtype=torch.float32)
        return "q8", {"q": torch.zeros(values.shape, dtype=torch.uint8), "lo": empty, "scale": empty.clone()}
    lo, hi = x.amin(dim=1), x.amax(dim=1)
    scale = (hi - lo) / 255.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = ((x - lo[:, None]) / safe[:, None]).round_().clamp_(0, 255).to(torch.uint8)
    return "q8", {"q": q.reshape(values.shape), "lo": lo, "scale": scale}


def dequantize(codec: str, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The rows ``quantize`` stored, as ``dtype``."""
    if codec == "raw":
        return parts["values"]
    if codec == "f16":
        return parts["values"].to(dtype)
    if codec == "q8":
        q = parts["q"]
        flat = q.reshape(q.shape[0], -1).float()
        x = parts["lo"][:, None] + flat * parts["scale"][:, None]
        return x.reshape(q.shape).to(dtype)
    raise ValueError(f"unknown row codec {codec!r}")


# ---- a rank's files -----------------------------------------------------------------------------------------------

def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of ``t`` (no copy where it is contiguous)."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


class TensorWriter:
    """Appends tensors' raw bytes to one stream, returning where each went."""

    def __init__(self, stream: Any) -> None:
        self.stream, self.offset = stream, 0

    def put(self, t: torch.Tensor) -> TensorRef:
        data = tensor_bytes(t)
        ref = TensorRef(self.offset, data.nbytes, str(t.dtype).removeprefix("torch."), tuple(t.shape))
        if data.nbytes:
            self.stream.write(data)
        self.offset += data.nbytes
        return ref

    def skeleton(self, obj: Any) -> Any:
        """``obj`` with every tensor written and replaced by its ``TensorRef`` (markers and other leaves kept)."""
        if isinstance(obj, torch.Tensor):
            return self.put(obj)
        if isinstance(obj, RowMarker):
            return obj
        if isinstance(obj, dict):
            return {k: self.skeleton(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)) and not isinstance(obj, TensorRef):
            return type(obj)(self.skeleton(v) for v in obj)
        return obj


def read_tensor(buf: memoryview, ref: TensorRef, into: torch.Tensor | None = None) -> torch.Tensor:
    """The tensor ``ref`` points at in ``buf``, copied into ``into`` (same dtype and shape) or a new tensor."""
    dtype = getattr(torch, ref.dtype)
    out = torch.empty(ref.shape, dtype=dtype) if into is None else into
    if into is not None and (into.dtype != dtype or tuple(into.shape) != tuple(ref.shape)):
        raise ValueError(f"a stored {ref.dtype}{list(ref.shape)} does not fit {into.dtype}{list(into.shape)}")
    if ref.nbytes:
        if ref.offset + ref.nbytes > len(buf):
            raise ValueError(f"a tensor at [{ref.offset}, {ref.offset + ref.nbytes}) lies past the file's end")
        dst = out.view(-1).view(torch.uint8).numpy()
        dst[:] = np.frombuffer(buf, dtype=np.uint8, count=ref.nbytes, offset=ref.offset)
    return out


def filled(skeleton: Any, buf: memoryview) -> Any:
    """A skeleton with every ``TensorRef`` read from ``buf`` into a new tensor (markers kept)."""
    if isinstance(skeleton, TensorRef):
        return read_tensor(buf, skeleton)
    if isinstance(skeleton, RowMarker):
        return skeleton
    if isinstance(skeleton, dict):
        return {k: filled(v, buf) for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(filled(v, buf) for v in skeleton)
    return skeleton


def markers_to(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """``obj`` with every ``RowMarker`` replaced by its tensor in ``tensors``."""
    if isinstance(obj, RowMarker):
        return tensors[obj.key]
    if isinstance(obj, dict):
        return {k: markers_to(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(markers_to(v, tensors) for v in obj)
    return obj


def write_index(stream: Any, index: dict[str, Any]) -> int:
    data = pickle.dumps(index, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(data)
    return len(data)


def read_index(buf: memoryview) -> dict[str, Any]:
    # A verified file of this run's own (its checksum in a commit record that names this run): never a foreign one.
    return pickle.load(io.BytesIO(buf))


def synced(stream: Any) -> None:
    """Flush ``stream`` and fsync its file (through a disk fault's layer too: its stream passes ``fileno``)."""
    stream.flush()
    os.fsync(stream.fileno())


# ---- the chain ----------------------------------------------------------------------------------------------------

Link = tuple[int, str]  # (step, id)


def link_meta(kind: str, chain: list[Link], world_size: int, bits: int | None) -> dict[str, Any]:
    return {"link": kind, "chain": [[s, i] for s, i in chain], "world_size": world_size, "bits": bits}


def parse_meta(raw: bytes | memoryview) -> dict[str, Any]:
    """A link's ``.metadata``, checked for shape; ``ValueError`` saying what is wrong."""
    meta = json.loads(bytes(raw))
    chain = meta.get("chain") if isinstance(meta, dict) else None
    if not isinstance(chain, list) or not chain or not all(isinstance(c, list) and len(c) == 2 for c in chain) \
            or meta.get("link") not in (BASE, INCREMENT) or not isinstance(meta.get("world_size"), int):
        raise ValueError("malformed link metadata")
    if (meta["link"] == BASE) != (len(chain) == 1):
        raise ValueError("link metadata: a base is a chain of one")
    meta["chain"] = [(int(s), str(i)) for s, i in chain]
    return meta


def read_meta(entry: CheckpointEntry) -> dict[str, Any]:
    return parse_meta((entry.path / LINK_META).read_bytes())


def chain_kept(dirs: CheckpointDir, chain: list[Link], keep: int) -> set[int]:
    """The steps to keep after ``chain`` was committed: its links, and while that makes fewer than ``keep`` restore
    points, the newest older committed links with their whole chains (where readable and complete)."""
    kept = {s for s, _ in chain}
    points = len(chain)
    committed = {e.step: e for e in dirs.entries() if e.committed}
    for step in sorted(committed, reverse=True):
        if points >= keep:
            break
        if step >= chain[0][0] or step in kept:
            continue
        try:
            older = [s for s, _ in read_meta(committed[step])["chain"]]
        except (OSError, ValueError, KeyError):
            continue
        if all(s in committed for s in older):
            kept |= set(older)
            points += 1
    return kept


def prune(dirs: CheckpointDir, keep_steps: Iterable[int]) -> list[int]:
    """Delete every checkpoint directory whose step is not in ``keep_steps``, committed or not, older or newer (a newer
    one is of a trajectory this chain replaced: a rejected, rolled-back or interrupted save)."""
    import shutil

    from resilience.record.fsio import fsync_dir

    keep = set(keep_steps)
    doomed = [e for e in dirs.entries() if e.step not in keep]
    for e in doomed:
        shutil.rmtree(e.path, ignore_errors=True)
    if doomed:
        fsync_dir(dirs.root)
    return [e.step for e in doomed]


def link_files(world_size: int) -> list[str]:
    """The files of a link written by ``world_size`` ranks (every one a load reads)."""
    return [LINK_META, *(name for r in range(world_size) for name in (index_file(r), rows_file(r)))]
