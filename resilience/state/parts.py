"""The job's state beyond model and optimizer: named parts, each a ``Stateful`` (``state_dict``/``load_state_dict``).

What real recoveries lose is this state (issue "whole job state"): the LR schedule's position, the RNG streams, the
data loader's position, the gradient scaler, the step and token counters. Job-wide parts (the same on every rank)
are checkpointed once under ``job``; per-rank parts (RNG, data loader) under ``rank.<r>``, as torchtitan keys its
data loader by data-parallel rank, so that each rank loads its own back. Every part travels as one ``bytes`` value
(its state pickled): DCP, torch.save, torchsnapshot and our in-memory codec all carry a bytes leaf as it is, whatever
nesting the part's own state has (a data loader's state changes shape as it iterates; DCP loads a tensor only into
a target of the same shape, a bytes value into any).
"""

from __future__ import annotations

import hashlib
import io
import random
from typing import Any, Iterable, Protocol, runtime_checkable

import numpy as np
import torch

MODEL, OPTIMIZER = "model", "optimizer"  # the two parts every checkpoint holds (TrainState's own)
JOB, RANK = "job", "rank"  # the keys of the job-wide and the per-rank parts in a state dict
# the parts besides model and optimizer, job-wide then per-rank (which a run has depends on its ``train`` settings)
JOB_PARTS = ("lr_scheduler", "scaler", "train_state")
RANK_PARTS = ("rng", "dataloader")


def require_parts(setting: str, value: Any) -> tuple[str, ...]:
    """``value`` as a tuple of part names, or a ValueError naming ``setting`` and the parts there are."""
    names = [value] if isinstance(value, str) else list(value) if isinstance(value, Iterable) else None
    known = (*JOB_PARTS, *RANK_PARTS)
    if names is None or any(n not in known for n in names):
        raise ValueError(f"{setting}={value}: must be all, or a list of the parts {', '.join(known)} "
                         f"(model and optimizer are always saved)")
    return tuple(names)


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, sd: dict[str, Any]) -> None: ...


class RngState:
    """This rank's random streams: Python's, NumPy's, torch's CPU generator and, where present, the CUDA one."""

    def __init__(self, seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)  # seeds CUDA's generators too

    def state_dict(self) -> dict[str, Any]:
        sd = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            sd["cuda"] = torch.cuda.get_rng_state_all()
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        random.setstate(sd["python"])
        np.random.set_state(sd["numpy"])
        torch.set_rng_state(sd["torch"])
        if "cuda" in sd:
            torch.cuda.set_rng_state_all(sd["cuda"])


class Counters:
    """The job's progress: optimizer steps, samples and tokens trained on (over every rank), and the epoch."""

    FIELDS = ("step", "samples", "tokens", "epoch")

    def __init__(self) -> None:
        self.step = self.samples = self.tokens = self.epoch = 0

    def advance(self, samples: int, tokens: int, epoch: int) -> None:
        self.step += 1
        self.samples += samples
        self.tokens += tokens
        self.epoch = epoch

    def state_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.FIELDS}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for f in self.FIELDS:
            setattr(self, f, int(sd[f]))


def encode(part: Stateful) -> bytes:
    """A part's state as the one bytes value a checkpoint carries (tensors saved with torch.save)."""
    buf = io.BytesIO()
    torch.save(part.state_dict(), buf)
    return buf.getvalue()


def decode(blob: bytes) -> dict[str, Any]:
    # weights_only=False: the parts are the run's own (NumPy's RNG state is not a tensor); never a foreign file,
    # since a load accepts only its own run's checkpoints (RunIdentity)
    return torch.load(io.BytesIO(bytes(blob)), weights_only=False)


class JobParts:
    """The named parts of one rank, besides model and optimizer; empty for the replayable loop (``train.rng=
    reseed``, data from the step), whose checkpoints and hashes stay what they were."""

    def __init__(self, rank: int, job: dict[str, Stateful] | None = None,
                 per_rank: dict[str, Stateful] | None = None) -> None:
        self.rank, self.job, self.per_rank = rank, dict(job or {}), dict(per_rank or {})

    def names(self) -> list[str]:
        return [*self.job, *self.per_rank]

    def __bool__(self) -> bool:
        return bool(self.job or self.per_rank)

    def state_dict(self, only: Iterable[str] | None = None) -> dict[str, Any]:
        """``{"job": {name: bytes}, "rank": {"<r>": {name: bytes}}}`` for the parts in ``only`` (None: all)."""
        keep = set(self.names() if only is None else only)
        sd: dict[str, Any] = {}
        job = {n: encode(p) for n, p in self.job.items() if n in keep}
        mine = {n: encode(p) for n, p in self.per_rank.items() if n in keep}
        if job:
            sd[JOB] = job
        if mine:
            sd[RANK] = {str(self.rank): mine}
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Load every part ``sd`` holds (a strategy that carries fewer parts leaves the others as they are)."""
        for name, blob in sd.get(JOB, {}).items():
            self.job[name].load_state_dict(decode(blob))
        for name, blob in sd.get(RANK, {}).get(str(self.rank), {}).items():
            self.per_rank[name].load_state_dict(decode(blob))

    def hashes(self) -> dict[str, str]:
        """SHA-256 of each part's encoded state (per-rank parts: this rank's)."""
        return {n: hashlib.sha256(encode(p)).hexdigest() for n, p in {**self.job, **self.per_rank}.items()}


def without_parts(sd: dict[str, Any]) -> dict[str, Any]:
    """A state dict's model and optimizer alone."""
    return {k: v for k, v in sd.items() if k not in (JOB, RANK)}
