"""Which parts of the job's state a run restored, and whether it trained on every sample exactly once.

A run of the real loop (``train=real``) hashes each part of its state (model, optimizer, LR schedule, RNG, data
loader, scaler, counters) at its checked points: every checkpoint step, right after every load or in-place
recovery, and the end (``parts_hashed`` events). The fault-free reference of the same training hashes at the same
steps. A part is exact when every checked point both runs share agrees, else lost from the first step where it
differs. Records of every attempt count: a state loaded at step 10 after a kill is checked at step 10.

The ledger (``resilience.data.ledger``) holds the sample ids each rank trained on at each step, from the attempt
that committed it; a recovered run must have trained on the reference's samples at the reference's steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from resilience.record.events import read_events


def part_records(run_dir: Path) -> dict[tuple[int, int], list[dict[str, str]]]:
    """{(rank, step): [the part hashes of every attempt that checked that step]}."""
    out: dict[tuple[int, int], list[dict[str, str]]] = {}
    for e in read_events(run_dir):
        if e["kind"] == "parts_hashed":
            out.setdefault((e["rank"], e["step"]), []).append(e["parts"])
    return out


def state_parts(run_dir: Path, reference_dir: Path) -> dict[str, Any] | None:
    """``{part: {"exact": bool, "first_diff_step": N|None, "checked_points": n}}``, or None when the run hashed
    no parts (the replayable loop: model and optimizer are its whole state, which the final hash covers)."""
    mine, ref = part_records(run_dir), part_records(reference_dir)
    if not mine:
        return None
    names = sorted({p for recs in mine.values() for rec in recs for p in rec})
    out: dict[str, Any] = {}
    for part in names:
        diffs, checked = [], 0
        for point, recs in mine.items():
            expected = next((r[part] for r in ref.get(point, []) if part in r), None)
            for rec in (r for r in recs if part in r and expected is not None):
                checked += 1
                if rec[part] != expected:
                    diffs.append(point[1])
        out[part] = {"exact": not diffs if checked else None, "first_diff_step": min(diffs, default=None),
                     "checked_points": checked}
    return out


def ledger(run_dir: Path, reference_dir: Path) -> dict[str, Any] | None:
    """The exactly-once verdict of the samples trained on, or None when the run kept no ledger."""
    from resilience.data.ledger import compare_ledgers, read_ledger

    if not (run_dir / "ledger").is_dir():
        return None
    return compare_ledgers(read_ledger(run_dir), read_ledger(reference_dir))


def job_state_verdict(run_dir: Path, reference_dir: Path | None) -> dict[str, Any]:
    """``result.json``'s ``state_parts`` and ``ledger`` (null for both without a reference to compare with)."""
    if reference_dir is None or Path(reference_dir).resolve() == Path(run_dir).resolve():
        return {"state_parts": None, "ledger": None}
    return {"state_parts": state_parts(run_dir, Path(reference_dir)), "ledger": ledger(run_dir, Path(reference_dir))}


def lost_parts(result: dict[str, Any]) -> list[str]:
    """The parts a run did not restore, each with the first step it differs at (for the console and the report)."""
    parts = result.get("state_parts") or {}
    return [f"{name} (from step {v['first_diff_step']})" for name, v in parts.items() if v.get("exact") is False]
