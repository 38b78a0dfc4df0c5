"""``python -m resilience [hydra overrides]``: run one experiment and write ``result.json`` in its run directory.

Exit status: 0 when the harness worked (whatever the injected fault did, "unrecovered" included), 1 when the
harness itself failed, 2 for a configuration error (one line on stderr naming the setting).
"""

from __future__ import annotations

import sys

from resilience.proc import pool  # the standard library only, as the zygote
from resilience.proc.zygote import Zygote

# The interpreter the first attempt's ranks fork from, started before this command imports Hydra and the rest: its
# imports (~2.3 s) are what the first step waits for (resilience/proc/zygote.py). Only as the command, not on import.
_zygote: Zygote | None = Zygote.early_for(sys.argv[1:]) if __name__ == "__main__" else None
if __name__ == "__main__":
    pool.guard()  # forked from the pipeline's pool: dies with its stub, now that its zygote is forked

# The imports below come after the zygote's start on purpose.
import logging
import os
import shutil
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict

from resilience.ckpt.lock import DirectoryInUse, DirectoryLock, holds_checkpoints
from resilience.settings.command_line import MULTIRUN, CommandLineError, compose_checked, jobs_of, only_prints
from resilience.settings.cli_help import HELP_FLAGS, help_text
from resilience.config import CONF_DIR, ConfigError, check_group_choices, resolve
from resilience.settings.identity import new_run_id
from resilience.record.quick_exit import exit_now
from resilience.record.events import EVENTS_FILE
from resilience.record.fsio import atomic_write_bytes
from resilience.record.reference import judge
from resilience.record.result import summarize, write_result
from resilience.supervise.resume import Resume, names_run_dir, with_run_dir

if TYPE_CHECKING:
    from resilience.roles import Roles
    from resilience.supervise.supervisor import Supervisor

log = logging.getLogger(__name__)



def _fail_config(exc: ConfigError) -> None:
    if _zygote is not None:
        _zygote.close()
    print(f"error: {exc}", file=sys.stderr)
    sys.exit(2)


# An absolute path: relative to the calling file, the console script (in the venv's bin/) would find no conf/.
@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> None:
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir).resolve()
    choices = {k: v for k, v in hc.runtime.choices.items() if not k.startswith("hydra")}
    try:
        cfg = resolve(cfg, run_dir, choices)
        resume = Resume.of(cfg, run_dir, names_run_dir(list(hc.overrides.hydra)), hc.mode == RunMode.MULTIRUN)
        check_places(cfg, run_dir, resume)
        with open_dict(cfg):  # a resumed job is the same run: its id, and attempts numbered on
            cfg.run_id = resume.run_id if resume else new_run_id()
            cfg.job = resume.settings() if resume else {"number": 1, "first_attempt": 0}
        lock = own_checkpoint_dir(cfg, run_dir, resume)
    except ConfigError as exc:
        _fail_config(exc)
    config_path = run_dir / "config.yaml"
    atomic_write_bytes(config_path, OmegaConf.to_yaml(cfg).encode())
    if resume:
        resume.record()
    # Imported once the command is known to run: the roles and the supervisors import torch (--help, a bad
    # override, a config error end without it).
    from resilience.roles import build_roles
    from resilience.supervise.observer import say

    roles = build_roles(cfg)
    if cfg.supervisor.launcher == "external":
        print(torchrun_command(cfg, config_path, recovery_budget=roles.policy.max_restarts))
        return
    say(f"{choices['strategy']} / fault {choices['fault']} / {choices['workload']}: {cfg.steps} steps on "
        f"{cfg.world_size} ranks, seed {cfg.seed}, run dir {run_dir}")
    if resume:
        say(f"job {resume.job} of run {resume.run_id}: resuming it from its newest complete checkpoint")
    supervisor = supervisor_for(cfg, config_path, roles)
    supervisor.zygote = _zygote
    supervisor.fault = roles.injector
    for caveat in [*roles.policy.caveats(roles.injector), *supervisor.caveats()]:
        print(f"warning: {caveat}", file=sys.stderr, flush=True)
    outcome = supervisor.run()
    # with Hydra's own overrides: a reference run needs the plug-ins' hydra.searchpath (record/reference.py)
    result = write_result(run_dir, judge=lambda r: judge(cfg, run_dir, r, [*hc.overrides.task, *hc.overrides.hydra]))
    lock.release()  # held until here: the directory was this run's while anything could write to it
    drop_checkpoints(cfg, multirun=hc.mode == RunMode.MULTIRUN)
    if outcome == "interrupted":  # Ctrl-C or SIGTERM: one line, the exit status of a process the signal ended
        print(f"interrupted by {supervisor.interrupted_by}: ranks stopped; what was measured so far is in "
              f"{run_dir / 'result.json'}", file=sys.stderr, flush=True)
        leave(128 + signal.Signals[supervisor.interrupted_by].value, hc.mode)
    print(summarize(result), flush=True)
    if result["status"] == "error":
        say(f"harness failure: see {run_dir / 'logs'} and {run_dir / 'supervisor.log'}")
        leave(1, hc.mode)
    leave(0, hc.mode)


def leave(code: int, mode: RunMode) -> None:
    """End the command once result.json is durable: a single run skips the interpreter's teardown (seconds after
    torch on a busy host: ``resilience.record.quick_exit``); a sweep's job returns to Hydra, which runs the next one."""
    if mode == RunMode.RUN:
        exit_now(code)
    if code:
        sys.exit(code)


def drop_checkpoints(cfg: DictConfig, multirun: bool) -> None:
    """A sweep's jobs remove their checkpoints like pipeline cells (``checkpoint.keep_after_run``): the results
    come from the event log, and a sweep's checkpoints fill disks."""
    keep = cfg.checkpoint.keep_after_run
    if keep is False or (keep == "auto" and multirun):
        shutil.rmtree(cfg.checkpoint.dir, ignore_errors=True)


def check_places(cfg: DictConfig, run_dir: Path, resume: Resume | None = None) -> None:
    """The run directory holds no run yet (unless this job resumes it), and no live run holds the checkpoint
    directory (nothing is created)."""
    if resume is None and (run_dir / EVENTS_FILE).exists():
        raise ConfigError(f"hydra.run.dir={run_dir}: already holds a run ({EVENTS_FILE}); choose a new directory")
    holder = DirectoryLock(Path(cfg.checkpoint.dir)).holder()
    if holder is not None:
        raise ConfigError(f"checkpoint.dir={cfg.checkpoint.dir}: in use by another run ({holder})")


def precheck(argv: list[str], on_composed: Callable[[DictConfig, Path], None] | None = None) -> Resume | None:
    """The whole validation, before Hydra creates anything: for every job of the command line (one, or each point
    of a ``--multirun`` sweep), compose, resolve, check where the run would go; the resume it asks for, if any."""
    if only_prints(argv):
        return None
    resume = None
    multirun = any(a in MULTIRUN for a in argv)
    for num, job in enumerate(jobs_of(argv)):
        composed = compose_checked(CONF_DIR, "config", job)
        if multirun:  # Hydra's sweep puts job ``num`` in <sweep.dir>/<sweep.subdir>
            with open_dict(composed):
                composed.hydra.job.num = num
            run_dir = Path(str(composed.hydra.sweep.dir), str(composed.hydra.sweep.subdir)).resolve()
        else:
            run_dir = Path(str(composed.hydra.run.dir)).resolve()
        choices = {k: v for k, v in composed.hydra.runtime.choices.items() if not k.startswith("hydra")}
        with open_dict(composed):
            del composed["hydra"]
        if on_composed is not None and not multirun:
            on_composed(composed, run_dir)
        cfg = resolve(composed, run_dir, choices)
        resume = Resume.of(cfg, run_dir, names_run_dir(job), multirun)
        check_places(cfg, run_dir, resume)
    return resume


def own_checkpoint_dir(cfg: DictConfig, run_dir: Path, resume: Resume | None = None) -> DirectoryLock:
    """Lock the run's checkpoint directory for the life of this command (see ``resilience.ckpt.lock``); a fresh
    run's must be empty, a resumed one's holds its checkpoints."""
    ckpt = Path(cfg.checkpoint.dir)
    lock = DirectoryLock(ckpt)
    try:
        lock.acquire({"run_id": cfg.run_id, "run_dir": str(run_dir), "pid": os.getpid()})
    except DirectoryInUse as exc:
        raise ConfigError(f"checkpoint.dir={ckpt}: {exc}") from None
    if resume is None and holds_checkpoints(ckpt):
        lock.release()
        raise ConfigError(f"checkpoint.dir={ckpt}: is not empty; a run starts from an empty directory")
    return lock


def start_zygote(cfg: DictConfig, run_dir: Path) -> None:
    """The interpreter the first attempt's ranks fork from (``supervisor.first_start=preloaded``, our launcher),
    and every later start too under ``supervisor.restarts=preloaded``; started from the composed command of a
    single run; a sweep's runs start cold."""
    global _zygote
    from resilience.proc.zygote import PRELOAD

    early, _zygote = _zygote, None
    try:
        local, restarts = cfg.supervisor.launcher == "local", cfg.supervisor.restarts == "preloaded"
        wanted = local and (cfg.supervisor.first_start == "preloaded" or restarts)
        ranks, strategy = int(cfg.world_size), str(cfg.strategy._target_).rsplit(".", 1)[0]
    except Exception:  # noqa: BLE001 (a setting validation will name in its own words: no zygote then)
        wanted = False
    if not wanted or (early is not None and early.config_path != run_dir / "config.yaml"):
        if early is not None:
            early.close()
        early = None
    if not wanted:
        return
    serve = None if restarts else ranks  # None: every start while the command lives
    if early is not None:
        early.confirm(serve, [strategy])  # PRELOAD is on its way already
        _zygote = early
    else:
        _zygote = Zygote.start(serve, run_dir / "config.yaml", [*PRELOAD, strategy])


def supervisor_for(cfg: DictConfig, config_path: Path, roles: Roles) -> Supervisor:
    """The supervisor the run's strategy needs: one that replaces only the failed ranks for a strategy that
    recovers in place, PyTorch's elastic agent (every rank restarted) for the others; the stock torchrun when
    ``supervisor.launcher=torchrun`` asks for the unobserved baseline."""
    from resilience.supervise.elastic import ElasticSupervisor
    from resilience.supervise.ft_launcher import FtLauncherSupervisor
    from resilience.supervise.replacing import ReplacingSupervisor
    from resilience.supervise.torchrun import TorchrunSupervisor

    if cfg.supervisor.launcher == "ft_launcher":  # NVRx's: torchrun's agent with its rank monitors
        return FtLauncherSupervisor(cfg, config_path, roles.strategy, roles.detectors, roles.policy)
    if cfg.supervisor.launcher == "torchrun":
        return TorchrunSupervisor(cfg, config_path, roles.strategy, roles.detectors, roles.policy)
    kind = ReplacingSupervisor if roles.strategy.caps.recovers_in_place else ElasticSupervisor
    return kind(cfg, config_path, roles.strategy, roles.detectors, roles.policy)


def torchrun_command(cfg: DictConfig, config_path: Path, recovery_budget: int) -> str:
    """How to run the prepared experiment across nodes with torchrun (the run directory must be shared)."""
    return (
        f"Prepared {config_path}. On each of N nodes (the run directory must be on a shared file system), run:\n\n"
        f"  TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=N --nproc-per-node=P --rdzv-backend=c10d \\\n"
        f"      --rdzv-endpoint=HOST:29400 --rdzv-id=JOB_ID --max-restarts={recovery_budget} \\\n"
        f"      -m resilience.rank {config_path}\n\n"
        f"with N x P = world_size = {cfg.world_size}. Afterwards: python -m resilience.result {config_path.parent}"
    )


def cli() -> None:
    if any(a in HELP_FLAGS for a in sys.argv[1:]):
        print(help_text(CONF_DIR))
        return
    try:
        _run(with_run_dir(sys.argv[1:]))  # resume=DIR: the run directory is DIR
    finally:  # a run ends it with its supervisor; a command that ends before (an error) ends it here
        if _zygote is not None:
            _zygote.close()


def _run(argv: list[str]) -> None:
    try:
        check_group_choices(argv)
        resume = precheck(argv, on_composed=start_zygote)  # before validation imports torch: beside it
    except (ConfigError, CommandLineError) as exc:
        _fail_config(exc)
    if resume is not None:  # Hydra's record of this job's command line beside the first job's, not over it
        argv.append(f"hydra.output_subdir=.hydra/job{resume.job}")
    sys.argv[1:] = argv
    main()


if __name__ == "__main__":
    cli()
