"""Resume in a new job: ``python -m resilience ... resume=DIR`` continues the run in DIR after its whole job died.

The new job is the same run: it keeps the run directory, the run id (``config.yaml``'s ``run_id``, which every
checkpoint's commit record names, so "never load another run's checkpoint" still holds), the event log (appended
to, attempts numbered on) and the checkpoint directory (its lock, ``resilience.ckpt.lock``, says no live job holds
it). Its training settings must be the first job's: they are part of the run's identity (``config_hash``), and a
checkpoint of other settings would be refused anyway, only later and less clearly. A job whose supervisor was
killed wrote no end: the resume records it (``job_lost``) before its own start (``job_resumed``).

``resume=auto`` is the form a scheduler's requeue can repeat unchanged: it resumes ``hydra.run.dir`` if that holds
a run, and starts the run there if not; so it needs a ``hydra.run.dir`` the requeued command names again (e.g. one
derived from the scheduler's job id), never the default one, which is the clock's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from resilience.config import ConfigError
from resilience.proc.started import process_started_wall
from resilience.record.events import EVENTS_FILE, EventLog, read_events
from resilience.record.query import first, job_death, last_job
from resilience.settings.command_line import overrides_of
from resilience.settings.identity import NOT_TRAINING

AUTO = "auto"
RUN_DIR = "hydra.run.dir"


def _overrides(argv: list[str]) -> dict[str, Any]:
    """key -> value of the plain ``key=value`` overrides (a malformed line is Hydra's to report)."""
    try:
        parsed = OverridesParser.create().parse_overrides(overrides_of(argv))
    except Exception:
        return {}
    return {ov.key_or_group: ov.value() for ov in parsed if not ov.is_sweep_override()}


def names_run_dir(overrides: list[str]) -> bool:
    """Whether the command line names its run directory (``resume=auto`` needs one the requeue names again)."""
    return RUN_DIR in _overrides(list(overrides))


def with_run_dir(argv: list[str]) -> list[str]:
    """``resume=DIR`` names the run directory: the arguments with ``hydra.run.dir=DIR`` when they name none."""
    given = _overrides(argv)
    value = given.get("resume")
    if value in (None, AUTO) or RUN_DIR in given:
        return argv
    return [*argv, f"{RUN_DIR}='{Path(str(value)).resolve()}'"]  # quoted: a path may hold '=' or ','


@dataclass(frozen=True)
class Resume:
    """A new job of the run in ``run_dir``: its number, its first attempt, what the job before it left."""

    run_dir: Path
    run_id: str
    job: int
    first_attempt: int
    lost: dict[str, Any] | None  # the job before it ended without an end record: job_lost's fields

    @classmethod
    def of(cls, cfg: DictConfig, run_dir: Path, names_dir: bool, multirun: bool = False) -> Resume | None:
        """The resume that the resolved ``cfg`` asks for (None: a fresh run), checked before anything is written:
        ``ConfigError``, one line naming the setting, for a run that cannot be resumed."""
        value = cfg.get("resume")
        if value is None:
            return None
        said = f"resume={value}"
        if multirun:
            raise ConfigError(f"{said}: continues one run; not with --multirun")
        if value == AUTO:
            if not names_dir:
                raise ConfigError(f"{said}: needs hydra.run.dir=DIR, a directory that the requeued command names "
                                  f"again (the default one is the clock's, which a requeue does not find)")
            if not (run_dir / EVENTS_FILE).exists():
                return None  # the run's first job: it starts there
        elif Path(str(value)).resolve() != run_dir:
            raise ConfigError(f"{said}: the run directory is the resumed one; hydra.run.dir={run_dir} differs "
                              f"(leave it out)")
        if not run_dir.is_dir():
            raise ConfigError(f"{said}: no such run directory")
        old_path = run_dir / "config.yaml"
        if not old_path.is_file() or not (run_dir / EVENTS_FILE).is_file():
            raise ConfigError(f"{said}: holds no run of this command (no config.yaml and events.jsonl)")
        old = OmegaConf.load(old_path)
        differs = first_difference(old, cfg)
        if differs is not None:
            raise ConfigError(f"{said}: {differs}; a resume trains the same run: give the first job's command "
                              f"line ({old_path})")
        return cls._after(read_events(run_dir), run_dir, str(old.run_id), said)

    @classmethod
    def _after(cls, events: list[dict], run_dir: Path, run_id: str, said: str) -> Resume:
        """The job after those whose ``events`` the log holds."""
        if first(events, "launch") is None:
            raise ConfigError(f"{said}: no job of this run launched ranks here (supervisor.launcher=external?); "
                              f"nothing to resume")
        job = last_job(events)
        end, death = first(job, "supervisor_end"), job_death(job)
        if end is not None and end["outcome"] != "interrupted":
            raise ConfigError(f"{said}: the run has ended ({end['outcome']}); nothing to resume")
        lost = None
        if end is None and death is not None:  # its supervisor was killed: the resume learns of it first
            lost = {"died_t_wall": death.last["t_wall"], "last_attempt": death.attempt, "last_step": death.step}
        jobs = 1 + sum(1 for e in events if e["kind"] == "job_resumed")
        return cls(run_dir, run_id, jobs + 1, 1 + max(e["attempt"] for e in events), lost)

    def settings(self) -> dict[str, int]:
        """``job`` in the new job's config.yaml: the ranks and the supervisor number their attempts from it."""
        return {"number": self.job, "first_attempt": self.first_attempt}

    def record(self) -> None:
        """Write the end of the job before (when it wrote none) and this job's start into the run's event log."""
        events = EventLog(self.run_dir, rank=None, attempt=self.first_attempt)
        try:
            if self.lost is not None:  # an event of the job that died: its last attempt
                events.attempt = self.lost["last_attempt"]
                events.emit("job_lost", step=self.lost["last_step"], found_by="resume", **self.lost)
                events.attempt = self.first_attempt
            events.emit("job_resumed", job=self.job, first_attempt=self.first_attempt,
                        started_t_wall=process_started_wall(), fsync=True)
        finally:
            events.close()


def first_difference(old: DictConfig, new: DictConfig) -> str | None:
    """The first setting (in key order) whose value differs between the first job's resolved configuration and
    this one's, as ``key=new differs from the first job's key=old``; None when they train the same run."""
    a, b = _flat(OmegaConf.to_container(old, resolve=True)), _flat(OmegaConf.to_container(new, resolve=True))
    # a group's option first: a changed strategy= changes its settings too, and the option says it best
    for key in sorted(set(a) | set(b), key=lambda k: (not k.startswith("choices."), k)):
        if key.split(".")[0] in NOT_TRAINING or a.get(key) == b.get(key):
            continue
        shown = key.removeprefix("choices.")  # a group's option: strategy=sync
        return (f"{shown}={_said(b.get(key, '(not set)'))} differs from the first job's "
                f"{shown}={_said(a.get(key, '(not set)'))}")
    return None


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        return {k: v for key, value in node.items() for k, v in _flat(value, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): node}


def _said(value: Any) -> str:
    """A value as the command line writes it."""
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)
