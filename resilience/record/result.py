"""``result.json``: written after a run, and recomputable from its event log with ``python -m resilience.result DIR``."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from omegaconf import OmegaConf

from resilience.record import environment
from resilience.record.events import read_events
from resilience.record.job_state import job_state_verdict, lost_parts
from resilience.record.fsio import atomic_write_json
from resilience.record.metrics import compute_result
from resilience.record.reference import said

RESULT_FILE = "result.json"


def run_identity(run_dir: Path) -> dict[str, Any]:
    """The fields that name a run, from the resolved config the ranks received."""
    cfg = OmegaConf.load(run_dir / "config.yaml")
    return {
        "strategy": cfg.choices.strategy,
        "fault": cfg.choices.fault,
        "workload": cfg.choices.workload,
        "recovery": cfg.choices.recovery,
        "seed": int(cfg.seed),
        "world_size": int(cfg.world_size),
        "steps": int(cfg.steps),
        "checkpoint_every": cfg.checkpoint.every if cfg.checkpoint.every == "auto" else int(cfg.checkpoint.every),
        "device": cfg.device,
        "backend": cfg.backend,
        "parallel": parallel_identity(cfg),
    }


def parallel_identity(cfg: Any) -> dict[str, Any]:
    """How the model was spread at launch: name, mesh shape (replicate x shard for hsdp, replicas x stages for
    pp_dp) and the shards one replica holds the state in (1 for ddp; a pipeline's stages). After ``recovery=shrink``
    the world is smaller; this is the launch setting."""
    name = str(cfg.choices.get("parallel", "ddp"))
    world = int(cfg.world_size)
    replicate = {"hsdp": int(cfg.parallel.get("replicate", 1)),
                 "pp_dp": int(cfg.parallel.get("replicas", 1))}.get(name, 1)
    shards = 1 if name == "ddp" else world // replicate
    mesh = [replicate, shards] if name in ("hsdp", "pp_dp") else [world]
    return {"name": name, "mesh": mesh, "shards_per_replica": shards}


def provenance(run_dir: Path, events: list[dict[str, Any]]) -> dict[str, Any]:
    """Where, when and with what code the run was measured.

    Start time and host come from the run's first event (the supervisor's ``launch``), so they are the run's own
    on a recomputation too; the commit and versions are those of the process that wrote the result first (kept
    from an existing result.json: a recomputation with newer code does not claim the run used it)."""
    first = next((e for e in events if e.get("kind") == "launch"), events[0] if events else {})
    started = first.get("t_wall")
    out: dict[str, Any] = {
        "started": datetime.fromtimestamp(started, timezone.utc).isoformat(timespec="seconds") if started else None,
        "host": first.get("host"),
    }
    kept = _previous(run_dir).get("provenance") or {}
    if kept.get("git_commit"):
        return {**kept, **out}
    return {**out, **environment.git_commit(), "torch": _torch_version(), "python": platform.python_version(),
            "environment": _environment_file(run_dir)}


def _previous(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((run_dir / RESULT_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _torch_version() -> str | None:
    torch = sys.modules.get("torch")  # the supervisor may not import torch; its metadata says the same
    if torch is not None:
        return str(torch.__version__)
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def _environment_file(run_dir: Path) -> str:
    """environment.json's path relative to the run directory: the one runs share (``RB_ENVIRONMENT``: the
    pipeline's probe snapshot, a test session's), else the run's own. Either is captured by the first run that
    needs it (torch.utils.collect_env: 0.4-0.6 s on a quiet machine, 3-4 s on a busy one)."""
    shared = os.environ.get(environment.ENV_VAR)
    path = Path(shared) if shared else run_dir / environment.ENVIRONMENT_FILE
    if not path.exists():
        environment.write(path)
    return os.path.relpath(path.resolve(), run_dir.resolve())


def write_result(run_dir: str | Path, judge: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Compute the run's result from its events and write it atomically to ``result.json``; ``judge`` gives its
    ``reference`` verdict (``record.reference.judge``; a recomputation keeps the verdict the run was given)."""
    run_dir = Path(run_dir)
    # From the run directory alone: the machine's limits are the pipeline's (its probe rule), not the run's.
    events = read_events(run_dir)
    result = compute_result(events, run_identity(run_dir))
    result["provenance"] = provenance(run_dir, events)
    previous = {} if judge else _previous(run_dir)
    result["reference"] = judge(result) if judge else previous.get("reference") or {
        "matches": None, "why": "not judged (result recomputed from the event log)"}
    reference_dir = result["reference"].get("run_dir")
    result.update(job_state_verdict(run_dir, Path(reference_dir) if reference_dir else None) if judge else
                  {k: previous.get(k) for k in ("state_parts", "ledger")})
    atomic_write_json(run_dir / RESULT_FILE, result)
    return result


def _fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}{unit}"
    return f"{value}{unit}"


def summarize(r: dict[str, Any]) -> str:
    """A few human-readable lines about one result."""
    lines = [f"result: {r['status']}  ({r['strategy']}, fault {r['fault']}, {r['workload']}, seed {r['seed']}, "
             f"{r['steps_completed']}/{r['steps']} steps, {r['attempts']} attempt(s))"]
    if r["fault_injected"]:
        b = r["recovery_breakdown_s"]
        if not r.get("supervised", True):
            lines.append("  (no detection events: torchrun's agent, not ours, watched the ranks)")
        lines.append(f"  fault at step {r['fault_step']} on rank {r['fault_rank']}: detected={r['detected']} by "
                     f"{r['detector']} (blamed rank {r['detected_rank']}) after {_fmt(r['detection_latency_s'], ' s')}; "
                     f"recovered={r['recovered']} in {_fmt(r['recovery_time_s'], ' s')} "
                     f"(detect {_fmt(b['detect'])} + restart {_fmt(b['restart'])} + load {_fmt(b['load'])} + "
                     f"replay {_fmt(b['replay'])}); lost steps {r['lost_steps']}")
    if r.get("faults_injected", 0) > 1:  # a schedule of faults (fault.at_step=[...]): the line above is the first's
        each = ", ".join(f"step {f['step']} {f['phase']} ({'recovered' if f['recovered'] else 'not recovered'})"
                         for f in r["faults"])
        lines.append(f"  {r['faults_injected']} faults, {r['recoveries']} recovered: {each}")
    for j in r.get("job_restarts") or []:  # resume=: the whole job died, a new one went on
        b = j["breakdown_s"]
        lines.append(f"  job {j['job']} resumed the run from the checkpoint of step {j['loaded_step']} (the job before "
                     f"died at step {j['died_at_step']}; lost steps {j['lost_steps']}): back in "
                     f"{_fmt(j['job_restart_s'], ' s')} (gap {_fmt(b['gap'])} + start-up {_fmt(b['startup'])} + "
                     f"load {_fmt(b['load'])} + replay {_fmt(b['replay'])})")
    if r.get("notice"):  # fault=preempt: the SIGTERM came with a grace period
        n = r["notice"]
        saved = (f"saved step {n['step']} {_fmt(n['saved_s'], ' s')} after it "
                 f"({'within' if n['fitted'] else 'NOT within'} the grace period)" if n["step"] is not None
                 else "no save on it (checkpoint.on_notice=false)")
        lines.append(f"  preempted with {_fmt(n['grace_s'], ' s')} of notice: {saved}")
    if r.get("drain"):  # fault=drain: the node's maintenance came with notice
        d = r["drain"]
        moved = (f"rank(s) {d['ranks']} moved to spares at step {d['step']}, {_fmt(d['left_s'], ' s')} after it; "
                 f"training stopped {_fmt(d['stopped_s'], ' s')}" if d["moved"] else
                 "its ranks had not moved when the node went: recovered as from a node loss")
        lines.append(f"  node maintenance with {_fmt(d['notice_s'], ' s')} of notice: {moved}")
    if r.get("unrecoverable"):
        lines.append(f"  not recoverable: {r['unrecoverable']}")
    pressure = (f" (of it {r['ckpt_persist_waits']} waited for the previous persist: "
                f"{_fmt(r['ckpt_persist_wait_s'], ' s')} a checkpoint on average)" if r.get("ckpt_persist_waits") else "")
    lines.append(f"  checkpoints {r['ckpt_count']} x {_fmt(r['ckpt_bytes'], ' B')}, stall {_fmt(r['ckpt_stall_s'], ' s')}"
                 f"{pressure}, "
                 f"durable {_fmt(r['ckpt_durable_s'], ' s')}; step {_fmt(r['step_time_s'], ' s')}; "
                 f"wall {_fmt(r['wall_time_s'], ' s')}; goodput {_fmt(r['goodput'])}")
    lines.append(f"  final_state_sha256 {r['final_state_sha256']}")
    if r.get("reference"):
        lines.append(said(r["reference"]))
    if r.get("state_parts"):
        lost = lost_parts(r)
        lines.append(f"  parts of the job's state restored: {'every one' if not lost else 'NOT ' + ', '.join(lost)}"
                     f" ({', '.join(r['state_parts'])})")
    if r.get("ledger"):
        once = r["ledger"]["exactly_once"]
        lines.append(f"  samples trained on: {'exactly once' if once else 'NOT exactly once'}, as in the fault-free "
                     f"run ({', '.join(f'{k} {v}' for k, v in r['ledger'].items() if k != 'exactly_once')})")
    p = r.get("provenance") or {}
    if p:
        lines.append(f"  started {p['started']} on {p['host']}; commit {p['git_commit']}"
                     + (" (modified)" if p.get("git_dirty") else "") + f"; torch {p['torch']}, Python {p['python']}")
    validity = r.get("validity") or {}
    if validity.get("verdict") == "noisy":  # timings above are not the technique's alone
        reasons = validity["reasons"]  # over the run first, then each window: the first three, and how many more
        more = f"; and {len(reasons) - 3} more (result.json validity.reasons)" if len(reasons) > 3 else ""
        lines.append(f"  NOISY measurement: {'; '.join(reasons[:3])}{more} (thresholds: validity.*)")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    """``python -m resilience.result RUN_DIR``."""
    if len(argv) != 2 or not (Path(argv[1]) / "events.jsonl").exists():
        sys.exit("usage: python -m resilience.result RUN_DIR  (a directory holding events.jsonl and config.yaml)")
    print(summarize(write_result(argv[1])))
