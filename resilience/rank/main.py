"""Entry point of one rank process: ``python -m resilience.rank RUN_DIR/config.yaml``.

Started by the supervisor's elastic agent, or by ``torchrun`` across nodes; either way the rank's identity comes
from the environment that torchelastic sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT,
TORCHELASTIC_RESTART_COUNT) and its configuration from the fully resolved YAML the supervisor wrote.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from resilience.runtime.rank import DRAIN_EXIT, NOTHING_TO_RECOVER_EXIT, NOTICE_EXIT, RECOVERY_EXIT
from resilience.rank.detectors import RankDetectors, RecoveryRequested
from resilience.rank.notice import NoticeHonoured
from resilience.rank.handover import Drained
from resilience.proc.zygote import preload_s, preloaded
from resilience.record.events import EventLog, read_events
from resilience.record.torch_workarounds import declare_acted
from resilience.rank.group import RankGroup
from resilience.rank.orphan import die_with_parent
from resilience.record.board import Beater
from resilience.settings.identity import RunIdentity, job_first_attempt
from resilience.settings.node import on_this_node
from resilience.settings.build import instantiate
from resilience.roles import build_roles
from resilience.runtime.rank import RankRuntime
from resilience.rank.process import configure_determinism, redirect_output
from resilience.rank.spare import SPARE_ENV, Prepared, wait_as_spare
from resilience.state import uninitialised
from resilience.state.train import TrainState
from resilience.runtime.step import OwnsStep
from resilience.ckpt.replica_transfer import NothingToRecover
from resilience.rank.trainer import Trainer
from resilience.data import fork_server
from resilience.proc.started import process_started_wall


def agreed_attempt(local: int, device: torch.device) -> int:
    """The attempt number all ranks agree on: the highest local restart count.

    Under torchrun each node's agent counts its own restarts, and a node restarted because a peer node joined a
    new rendezvous round does not count one (pytorch/pytorch#135712); the maximum is the group's true attempt.
    """
    t = torch.tensor([local], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def run_rank(cfg: DictConfig, prepared: Prepared | None = None) -> None:
    """Run this rank's attempts as the recovery policy runs them: one per process, or several in it (NVRx's
    in-process restart, ``recovery=nvrx_inprocess``); an attempt records why it failed before this process exits."""
    policy = prepared.roles.policy if prepared else instantiate(cfg.recovery)
    try:
        # A spare's prepared model serves its first attempt only: a restart in the process builds afresh.
        policy.run_attempts(lambda again: run_attempt(cfg, None if again else prepared), Path(cfg.run_dir))
    except RecoveryRequested as req:  # a detector found corrupt state: the supervisor restarts the ranks
        sys.exit(RECOVERY_EXIT if req.reaction in ("restart", "rollback") else 1)
    except NothingToRecover:  # recorded (rank_error); the supervisor stops restarting
        sys.exit(NOTHING_TO_RECOVER_EXIT)
    except NoticeHonoured:  # saved on a preemption's notice: the job is ending, a new one goes on
        sys.exit(NOTICE_EXIT)
    except Drained:  # left its node on a maintenance notice: a spare takes the rank on
        sys.exit(DRAIN_EXIT)
    except Exception:  # the supervisor sees the failure
        sys.exit(1)


def run_attempt(cfg: DictConfig, prepared: Prepared | None = None) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    # the agent counts this job's restarts; a resumed job numbers its attempts on from the jobs before it
    attempt = job_first_attempt(cfg) + int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    run_dir = Path(cfg.run_dir)
    redirect_output(run_dir, f"rank{rank}", f"rank {rank} attempt {attempt}")
    # ranks beyond the node's GPUs share them (over gloo: NCCL refuses two ranks on one device, config.on_this_node)
    device = torch.device("cuda", local_rank % torch.cuda.device_count()) if cfg.device == "cuda" \
        else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    configure_determinism(device, int(cfg.threads_per_rank))

    events = EventLog(run_dir, rank, attempt)
    detectors: RankDetectors | None = None
    try:
        roles = build_roles(cfg) if prepared is None else prepared.roles
        # before the group's threads and sockets exist: the loader's server forked from this rank (data.fork_server)
        fork_server.start_for(cfg.train, device.type)
        strategy, injector = roles.strategy, roles.injector
        owns_step = isinstance(strategy, OwnsStep)  # it forms the groups across ranks and wraps the model itself
        group = RankGroup(cfg.backend, rank, world, float(cfg.timeouts.collective_s), solo=owns_step)
        joining = time.monotonic()
        group.join()
        joined = time.monotonic()
        # In place, the supervisor numbers the generations; under an elastic agent the ranks agree on it.
        events.attempt = group.generation if group.in_place else agreed_attempt(attempt, device)
        # the start's parts: the process's age (its interpreter, imports, roles) and the group's forming in it
        events.emit("run_start", pid=os.getpid(), world_size=world, device=str(device), backend=cfg.backend,
                    preloaded=preloaded(), preload_s=preload_s(), age_s=round(time.time() - process_started_wall(), 3),
                    join_s=round(joined - joining, 4))
        if prepared is None:  # a spare watches from the start
            die_with_parent(lambda: strategy.clean_up_run(run_dir))
        detectors = RankDetectors(roles.detectors, roles.policy)
        # a pipeline's stage and its groups (None: the rank holds the whole model)
        layout = roles.parallel.layout(rank, world, group.timeout)
        # Each service comes from the role that provides it; the runtime is frozen from here on.
        rt = RankRuntime(rank=rank, world_size=world, device=device, run_dir=run_dir,
                         ckpt_dir=Path(cfg.checkpoint.dir), events=events, identity=RunIdentity.of(cfg),
                         fault_hook=injector,
                         load_max_step=rollback_bound(run_dir, events.attempt),
                         ckpt_fs=injector.checkpoint_fs(rank), node_memory=strategy.node_memory(run_dir),
                         ckpt_rejected=detectors.rejection_report(), group=group,
                         wrap_model=bare if owns_step else roles.parallel.wrapper(
                             device, world, injector, in_place=group.in_place, workload=roles.workload,
                             layout=layout),
                         build_model=roles.workload.build_model, layout=layout)
        injector.attach(rt)
        if prepared and prepared.model is not None:  # a spare built them before it had a rank
            ddp = rt.wrap_model(prepared.model)
            # under a pipeline the wrap keeps the rank's stage alone: its optimizer is built over that stage (the
            # spare's was over the whole model, a stage it did not know yet)
            optimizer = prepared.optimizer if layout is None else roles.workload.build_optimizer(ddp)
            state = TrainState(ddp, optimizer, flat_optim=layout is not None)
        else:  # a replacement whose state the strategy overwrites skips the initialisation
            wl, flat = roles.workload, layout is not None
            built = uninitialised.build(wl, device, rt.wrap_model) \
                if uninitialised.wanted(events.attempt, strategy.caps) else None
            if built is not None:
                state = TrainState(*built, flat_optim=flat, uninitialised=True)
            else:
                ddp = rt.wrap_model(wl.build_model().to(device))
                state = TrainState(ddp, wl.build_optimizer(ddp), flat_optim=flat)
        runner = roles.parallel.step_runner(rt, state, roles.workload)  # a pipeline's schedule runs the step
        injector.arm(state)
        detectors.attach(rt, state)
        strategy.attach(rt)
        strategy.attach_runner(runner)
        beater = Beater(run_dir, rank)
        try:
            Trainer(cfg, rt, roles.workload, state, strategy, detectors, beater, runner).run()
        finally:
            beater.close()
            strategy.close()
            injector.cleanup()
        dist.destroy_process_group()
    except RecoveryRequested as req:
        events.emit("recovery_requested", reaction=req.reaction, detector=req.detection.detector,
                    rollback_to=req.detection.rollback_to, fsync=True)
        raise
    except (NoticeHonoured, Drained):  # not a failure: recorded (notice_saved, drained)
        raise
    except Exception as exc:  # record why this rank stopped, then fail the attempt
        if detectors is not None:
            detectors.on_exception(exc)
        events.emit("rank_error", error=f"{type(exc).__name__}: {exc}"[:2000], fsync=True)
        traceback.print_exc()
        raise
    finally:
        declare_acted(events)  # the torch workarounds that acted in this rank without its log at hand
        events.close()


def bare(module: torch.nn.Module) -> torch.nn.Module:
    """The model as built: a strategy that owns the step wraps it for its own replica group."""
    return module


def rollback_bound(run_dir: Path, attempt: int) -> int | None:
    """The step a rollback requested by the previous attempt must not load past (None: no rollback)."""
    bounds = [e["rollback_to"] for e in read_events(run_dir)
              if e["kind"] == "recovery_requested" and e["reaction"] == "rollback" and e["attempt"] == attempt - 1]
    return min(bounds) if bounds else None


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        sys.exit("usage: python -m resilience.rank RUN_DIR/config.yaml")
    # torchrun across nodes: the prepared config says ``auto`` and this node decides (resilience.config)
    cfg = on_this_node(OmegaConf.load(argv[1]), local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    prepared = wait_as_spare(cfg) if SPARE_ENV in os.environ else None
    run_rank(cfg, prepared)

