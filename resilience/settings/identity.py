"""The identity of one run, recorded in every checkpoint it commits: a load accepts only its own run's."""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

# Which run this is, which of its jobs, and what it is compared with, not what it computes: every job of one run
# (resume=) differs from the first only here (resilience.supervise.resume compares the rest).
NOT_TRAINING = ("run_dir", "run_id", "resume", "job", "reference")
# Also where its checkpoints go and the names of the options chosen (their settings are hashed): two runs that differ
# only in these train the same thing.
_NOT_CONFIG = (*NOT_TRAINING, "checkpoint.dir", "choices")


def new_run_id() -> str:
    return uuid.uuid4().hex[:16]


def job_first_attempt(cfg: DictConfig) -> int:
    """The number of this job's first attempt: a job that resumes the run (``resume=``) numbers its attempts on
    from the jobs before it (``job.first_attempt``, set by resilience.supervise.resume); 0 for a run's first job."""
    return int(OmegaConf.select(cfg, "job.first_attempt", default=0))


def config_hash(cfg: DictConfig) -> str:
    """SHA-256 (first 16 hex digits) of the resolved configuration, without where the run lives."""
    data = OmegaConf.to_container(cfg, resolve=True)
    for key in _NOT_CONFIG:
        *parents, last = key.split(".")
        node = data
        for p in parents:
            node = node.get(p, {})
        node.pop(last, None)
    return hashlib.sha256(OmegaConf.to_yaml(OmegaConf.create(data)).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class RunIdentity:
    run_id: str
    config_hash: str
    world_size: int
    seed: int

    @classmethod
    def of(cls, cfg: DictConfig) -> RunIdentity:
        """The identity of the run whose resolved configuration (with its ``run_id``) is ``cfg``."""
        return cls(str(cfg.run_id), config_hash(cfg), int(cfg.world_size), int(cfg.seed))

    def as_dict(self) -> dict:
        return {"run_id": self.run_id, "config_hash": self.config_hash, "world_size": self.world_size,
                "seed": self.seed}
