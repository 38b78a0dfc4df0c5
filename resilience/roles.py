"""The roles of one run, built from its configuration in one place: validation, the rank and the spare use it.

A role is one class behind its group's small interface, chosen by one YAML in ``conf/<group>/``: a workload, a
checkpoint strategy, a fault injector, a recovery policy, detectors. Building a role validates its settings (a bad
value raises ``ValueError`` naming the key); ``build_roles`` adds the checks that need two roles at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from hydra.utils import instantiate
from omegaconf import DictConfig

from injectors.base import Injector
from resilience.detectors.base import Detector
from resilience.parallel.base import Parallelism
from resilience.parallel.ddp import DataParallel
from resilience.recovery.base import RecoveryPolicy
from resilience.strategies.base import CheckpointStrategy
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
            strategy=instantiate(cfg.strategy, every=cfg.checkpoint.every, keep=cfg.checkpoint.keep),
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
    roles.injector.validate(int(cfg.world_size), int(cfg.steps), strategy.every if strategy.saves else None)
    _check_together(cfg, roles)
    roles.parallel.check(int(cfg.world_size), roles.workload, strategy, roles.injector, roles.detectors)
    if hasattr(roles.policy, "world_after") and (strategy.recovers_in_place or cfg.supervisor.launcher != "local"):
        raise ValueError(f"recovery={roles.policy.name}: restarts fewer ranks through the local supervisor's elastic "
                         f"agent; needs supervisor.launcher=local and a strategy that restarts every rank (not "
                         f"strategy={strategy.name} with supervisor.launcher={cfg.supervisor.launcher})")
    if hasattr(roles.policy, "check_resharding"):  # recovery=grow: down to the survivors and back (recovery/grow.py)
        roles.policy.check_resharding(int(cfg.world_size), roles)
    return roles


def _check_together(cfg: DictConfig, roles: Roles) -> None:
    """What one role's settings mean for another's."""
    strategy, spares = roles.strategy, cfg.supervisor.spares
    if spares and not strategy.recovers_in_place:
        raise ValueError(f"supervisor.spares={spares}: only a strategy that recovers in place "
                         f"(strategy=replica) uses spare ranks; set supervisor.spares=0")
    if roles.injector.acts_on_checkpoint_fs and strategy.saves and not strategy.writes_through_checkpoint_fs():
        # never a silent pass: the fault would fire and change nothing this strategy writes
        raise ValueError(f"fault={roles.injector.name}: not applicable to strategy={strategy.name}, whose checkpoint "
                         f"files do not go through DCP's file-system layer that this fault acts on (docs/peers.md)")
    if not strategy.keeps_world_group():
        crossing = [d.name for d in roles.detectors if d.compares_ranks]
        if crossing:  # a rank alone in its group would be compared with itself, a shrunk group's ranks misnamed
            raise ValueError(f"detector={','.join(crossing)}: compares the ranks over the whole world's group, which "
                             f"strategy={strategy.name} does not keep (its own groups, or a shrunk one); leave it out "
                             f"of the detector list")
    hosted = [r.name for r in (strategy, *roles.detectors) if r.agent_service() is not None
              and not (cfg.supervisor.launcher == "ft_launcher" and r.name == "nvrx_heartbeat")]  # its own monitors
    if cfg.supervisor.launcher != "local" and hosted:
        raise ValueError(f"supervisor.launcher={cfg.supervisor.launcher}: {', '.join(hosted)} runs part of itself in "
                         f"the local supervisor across rank restarts (see its option file); use "
                         f"supervisor.launcher=local")
    if strategy.recovers_in_place:
        if roles.policy.restarts_in_process:  # both would re-form the group after a failure, each its own way
            raise ValueError(f"recovery={roles.policy.name}: restarts every rank's training in its process; "
                             f"strategy={strategy.name} recovers in place itself; use recovery=restart")
        if roles.policy.on_silent == "rollback":
            raise ValueError(f"recovery={roles.policy.name}: strategy={strategy.name} keeps no "
                             f"checkpoint to roll back to; use recovery=restart or recovery=fail")
        if cfg.supervisor.launcher != "local":
            raise ValueError(f"supervisor.launcher={cfg.supervisor.launcher}: strategy={strategy.name} needs the "
                             f"local supervisor, which replaces failed ranks (torchrun restarts every rank)")
