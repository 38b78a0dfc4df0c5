"""The training state that checkpoints hold and recoveries must restore bit for bit."""

from __future__ import annotations

import copy
import hashlib
import json
import zlib
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import nn

from resilience.state.parts import MODEL, OPTIMIZER, JobParts


@dataclass
class TrainState:
    """Model and optimizer of one rank, and the job's other parts (``JobParts``: LR schedule, RNG, data loader,
    scaler, counters; none in the replayable loop, where the data position is the step alone)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    parts: JobParts = field(default_factory=lambda: JobParts(0))
    # The optimizer's state keyed by parameter name throughout (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``):
    # a pipeline stage's keys are then its own. Nested, ``param_groups`` is one list under the same key on every
    # stage with different contents, and DCP, which writes each key once, would give every stage one stage's list.
    flat_optim: bool = False
    # Built with storage but no values (``resilience.state.uninitialised``), until a heal fills every byte.
    uninitialised: bool = False

    def state_dict(self, parts: Iterable[str] | None = None) -> dict[str, Any]:
        """``{"model": ..., "optim": ..., "job": ..., "rank": ...}`` keyed by fully qualified parameter names
        (loadable with plain DCP); ``parts``: the other parts to hold (None: all of them).

        Only call this once the optimizer has state (after a step) or right before loading: on a fresh optimizer
        PyTorch initialises the state with a zero-learning-rate step, which would advance Adam's step count.
        """
        # ~0.5 s to import: only when used
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer,
                                            options=StateDictOptions(flatten_optimizer_state_dict=self.flat_optim))
        return {"model": model_sd, "optim": optim_sd, **self.parts.state_dict(parts)}

    def full_state_dict(self) -> dict[str, Any]:
        """The global state, gathered on every rank where the model is sharded (``parallel=fsdp``), with the
        job-wide parts (not the per-rank ones, which differ between ranks): what the final hash covers, so that it
        does not depend on how the state is cut. Unsharded: ``state_dict()`` without the per-rank parts."""
        from torch.distributed.tensor import DTensor

        job = self.parts.state_dict(self.parts.job)  # {"job": ...}, or {} without job-wide parts
        if not any(isinstance(p, DTensor) for p in self.model.parameters()):
            return {**self.state_dict(parts=()), **job}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer,
                                            options=StateDictOptions(full_state_dict=True))
        return {"model": model_sd, "optim": optim_sd, **job}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        self.parts.load_state_dict(sd)


class RestorePoint:
    """The optimizer's state as it was before a load, put back when the load ends without loading.

    Building a load target steps a fresh optimizer (``TrainState.state_dict``: Adam's step count becomes 1), so a
    load that then rejects every checkpoint would leave the training that follows on another state. The model is
    not copied (dlrm_emb's 563 MB took 1.5-3 s to copy on a 2-core host, at every load): every ``_load`` verifies
    a checkpoint before it writes into the model, which ``tests/test_rejected_load.py`` holds for every strategy.
    """

    def __init__(self, state: TrainState) -> None:
        optim = self.optimizer = state.optimizer
        # An uninitialised state has nothing to put back: copying it (dlrm_emb's 563 MB of Adagrad sums, 0.2-0.6 s)
        # would only delay the heal that fills it; ``restore`` leaves the optimizer's tensors as they are.
        self.state = None if state.uninitialised else {
            p: map_tensors(lambda t: t.detach().clone(), dict(s)) for p, s in optim.state.items()}
        self.groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in optim.param_groups]
        self.job_parts, self.parts = state.parts, state.parts.state_dict()  # small: LR schedule, RNG, loader

    def restore(self) -> None:
        if self.state is not None:
            self.optimizer.state.clear()  # a fresh optimizer stays fresh
            self.optimizer.state.update({p: dict(s) for p, s in self.state.items()})
        for group, saved in zip(self.optimizer.param_groups, self.groups):
            group.update(saved)
        self.job_parts.load_state_dict(self.parts)


def part_hashes(state: TrainState, whole: bool = True) -> dict[str, str]:
    """SHA-256 of each named part: model and optimizer (whole, however sharded: a collective where sharded; left
    out with ``whole=False``), then the job's other parts."""
    if not whole:
        return state.parts.hashes()
    full = state.full_state_dict()
    return {MODEL: state_sha256({"model": full["model"]}), OPTIMIZER: state_sha256({"optim": full["optim"]}),
            **state.parts.hashes()}


def state_sha256(sd: dict[str, Any]) -> str:
    """SHA-256 over every tensor (name, dtype, shape, bytes) and every scalar, in sorted-key order."""
    h = hashlib.sha256()
    for key, value in sorted(_flatten(sd)):
        h.update(key.encode())
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(value, bytes):  # a job part (resilience.state.parts)
            h.update(value)
        else:
            h.update(json.dumps(value, sort_keys=True, default=str).encode())
    return h.hexdigest()


def map_tensors(fn: Any, obj: Any) -> Any:
    """``obj`` (nested dicts, lists, tuples) with ``fn`` applied to every tensor in it; other values as they are."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(fn, v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(fn, v) for v in obj)
    return obj


def tensor_bytes(sd: dict[str, Any]) -> int:
    """The bytes of every tensor in a nested state: what a load from memory moved."""
    return sum(v.numel() * v.element_size() for _, v in _flatten(sd) if isinstance(v, torch.Tensor))


def state_crc32(sd: dict[str, Any]) -> int:
    """CRC32 over every tensor's bytes and every scalar, in sorted-key order: a fast fingerprint (about 1 GB/s)
    that a state loaded back must reproduce exactly."""
    crc = 0
    for key, value in sorted(_flatten(sd)):
        crc = zlib.crc32(key.encode(), crc)
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            crc = zlib.crc32(t.reshape(-1).view(torch.uint8).numpy(), crc)
        else:
            crc = zlib.crc32(json.dumps(value, sort_keys=True, default=str).encode(), crc)
    return crc


def _flatten(obj: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(obj, dict):
        return [kv for k, v in obj.items() for kv in _flatten(v, f"{prefix}{k}.")]
    if isinstance(obj, (list, tuple)):
        return [kv for i, v in enumerate(obj) for kv in _flatten(v, f"{prefix}{i}.")]
    return [(prefix.rstrip("."), obj)]
