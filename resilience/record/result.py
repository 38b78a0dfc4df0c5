"""``result.json``: written after a run, and recomputable from its event log with ``python -m resilience.result DIR``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from resilience.record.events import read_events
from resilience.record.fsio import atomic_write_json
from resilience.record.metrics import compute_result

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
        "checkpoint_every": int(cfg.checkpoint.every),
        "device": cfg.device,
        "backend": cfg.backend,
    }


def write_result(run_dir: str | Path) -> dict[str, Any]:
    """Compute the run's result from its events and write it atomically to ``result.json``."""
    run_dir = Path(run_dir)
    # From the run directory alone: the machine's limits are the pipeline's (its probe rule), not the run's.
    result = compute_result(read_events(run_dir), run_identity(run_dir))
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
    lines.append(f"  checkpoints {r['ckpt_count']} x {_fmt(r['ckpt_bytes'], ' B')}, stall {_fmt(r['ckpt_stall_s'], ' s')}, "
                 f"durable {_fmt(r['ckpt_durable_s'], ' s')}; step {_fmt(r['step_time_s'], ' s')}; "
                 f"wall {_fmt(r['wall_time_s'], ' s')}; goodput {_fmt(r['goodput'])}")
    lines.append(f"  final_state_sha256 {r['final_state_sha256']}")
    validity = r.get("validity") or {}
    if validity.get("verdict") == "noisy":  # timings above are not the technique's alone
        lines.append(f"  NOISY measurement: {'; '.join(validity['reasons'])} (thresholds: validity.*)")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    """``python -m resilience.result RUN_DIR``."""
    if len(argv) != 2 or not (Path(argv[1]) / "events.jsonl").exists():
        sys.exit("usage: python -m resilience.result RUN_DIR  (a directory holding events.jsonl and config.yaml)")
    print(summarize(write_result(argv[1])))
