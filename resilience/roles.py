"""The roles of one run, built from its configuration in one place: validation, the rank and the spare use it.

A role is one class behind its group's small interface, chosen by one YAML in ``conf/<group>/``: a workload, a
checkpoint strategy, a fault injector, a recovery policy, detectors. Building a role validates its settings (a bad
value raises ``ValueError`` naming the key); ``build_roles`` runs the table of which roles go together
(``resilience.compat``), over what each role declares (``caps``).
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from injectors.base import Injector
from resilience.compat import Combination, check
from resilience.detectors.base import Detector
from resilience.parallel.base import Parallelism
from resilience.parallel.ddp import DataParallel
from resilience.recovery.base import RecoveryPolicy
from resilience.settings.build import instantiate  # Hydra's, without its import where it need not
from resilience.strategies.base import CheckpointStrategy
from resilience.strategies.interval import AutoInterval, interval_of
from resilience.workloads.base import Workload


@dataclass(frozen=True)
class Roles:
    workload: Workload
    strategy: CheckpointStrategy
    injector: Injector
    policy: RecoveryPolicy
    detectors: list[Detector]
    parallel: Parallelism


def build_roles(cfg: DictConfig) -> Roles:
    """Every role of the run in ``cfg`` (a resolved configuration), checked against each other.

    Raises ``ValueError`` naming the setting, with Hydra's wrapping of constructor errors taken off."""
    try:
        roles = Roles(
            workload=instantiate(cfg.workload, seed=cfg.seed),
            # partial: the interval is an object (checkpoint.every=auto's), which Hydra's config cannot carry
            strategy=instantiate(cfg.strategy, _partial_=True)(
                every=interval_of(cfg.checkpoint.every, OmegaConf.select(cfg, "checkpoint.auto")),
                keep=cfg.checkpoint.keep),
            injector=instantiate(cfg.fault),
            policy=instantiate(cfg.recovery),
            detectors=[instantiate(d) for d in cfg.detectors.values()],
            # a configuration written before the parallel group existed is data parallel
            parallel=instantiate(cfg.parallel) if "parallel" in cfg else DataParallel(),
        )
    except ValueError:
        raise
    except Exception as exc:  # Hydra wraps constructor errors; unwrap to the one line that matters
        cause = exc.__cause__ or exc
        if isinstance(cause, ValueError):
            raise cause from None
        raise ValueError(f"{type(cause).__name__}: {cause}") from None
    strategy = roles.strategy
    check(combination(cfg, roles))  # the table of which roles go together (resilience.compat)
    roles.parallel.check_workload(roles.workload, int(cfg.world_size))  # a pipeline: micro-batches, layers
    if strategy.caps.saves:
        strategy.interval.check()
    if isinstance(strategy.interval, AutoInterval) and "during_checkpoint" in getattr(roles.injector, "phases", ()):
        raise ValueError("fault.phase=during_checkpoint: needs a fixed checkpoint.every (with auto no step is known "
                         "to be a checkpoint's before the run)")
    roles.injector.validate(int(cfg.world_size), int(cfg.steps), strategy.every if strategy.caps.saves else None)
    roles.injector.check_workload(roles.workload)
    return roles


def combination(cfg: DictConfig, roles: Roles) -> Combination:
    """The run's roles as the table of rules sees them: their names, what they declare, the run's settings."""
    names = {"workload": str(OmegaConf.select(cfg, "choices.workload", default="workload")),
             "parallel": roles.parallel.name, "strategy": roles.strategy.name, "fault": roles.injector.name,
             "recovery": roles.policy.name}
    return Combination(names=names, workload=roles.workload.caps, parallel=roles.parallel.caps,
                       strategy=roles.strategy.caps, fault=roles.injector.caps, recovery=roles.policy.caps,
                       detectors={d.name: d.caps for d in roles.detectors}, world_size=int(cfg.world_size),
                       launcher=cfg.supervisor.launcher, spares=int(cfg.supervisor.spares),
                       ranks_per_node=int(OmegaConf.select(cfg, "ranks_per_node", default=1)),
                       resume=OmegaConf.select(cfg, "resume", default=None),
                       on_notice=bool(OmegaConf.select(cfg, "checkpoint.on_notice", default=False)),
                       clip_norm=OmegaConf.select(cfg, "train.clip_norm", default=None),
                       grad_accum=int(OmegaConf.select(cfg, "train.grad_accum", default=1)),
                       **{f: str(OmegaConf.select(cfg, f"train.{f}", default=getattr(Combination, f)))
                          for f in ("rng", "precision", "data", "lr_schedule")})
