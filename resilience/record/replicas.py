"""Replica recovery without a checkpoint, measured the same way for torchft (``replica_torchft``) and ours
(``replica``): the survivors' view of the fault, the replacement's start and heal, the steps at reduced width, and
whether every replica ended consistent. ``resilience.record.metrics`` adds these fields to every result."""

from __future__ import annotations

from typing import Any

from resilience.record.query import first


def replica_groups(events: list[dict], world_size: int) -> dict[str, Any]:
    """Replica groups that train on at reduced width while a dead one is replaced (torchft): the survivors' view of
    the fault (the quorum without it, their stall), the replacement's start and heal, the steps committed by fewer
    than all groups, the final loss, and whether every replica held the same state after each change of the quorum
    and at the end. A run with a step committed at reduced width is not bit-exact with the fault-free one by design
    (its trajectory differs); without one (fault-free, or ``min_replicas`` = all) it is held to the bit-exact check."""
    out: dict[str, Any] = {"bit_exact": None, "replicas_consistent": None, "reduced_width_steps": None,
                           "quorum_detection_s": None, "survivors_stall_s": None, "replacement_start_s": None,
                           "heal_s": None, "heal_transfer_s": None, "heal_bytes": None}
    steps = [e for e in events if e["kind"] == "ft_step"]
    if not steps:
        return out
    by_step: dict[int, set[str]] = {}
    for e in events:
        if e["kind"] == "ft_state":
            by_step.setdefault(e["step"], set()).add(e["sha256"])
    final = {e["rank"]: e["final_state_sha256"] for e in events if e["kind"] == "run_end"}  # each rank's last
    reduced = {e["step"] for e in steps if e["committed"] and e["participants"] < world_size}
    out.update(bit_exact="not by design" if reduced else None, reduced_width_steps=len(reduced),
        replicas_consistent=all(len(h) == 1 for h in by_step.values()) and len(final) == world_size
        and len(set(final.values())) == 1)
    fault = first(events, "fault_injected")
    if fault is None:
        return out
    t0, victim = fault["t_mono"], fault.get("target_rank", fault["rank"])
    later = [e for e in events if e["t_mono"] >= t0]
    shrunk = next((e for e in later if e["kind"] == "ft_quorum" and e["participants"] < e["previous"]), None)
    stepped = next((e for e in later if e["kind"] == "ft_step" and e["committed"] and e["rank"] != victim), None)
    heal = next((e for e in later if e["kind"] == "ft_heal"), None)
    out.update(quorum_detection_s=shrunk["t_mono"] - t0 if shrunk else None,
               survivors_stall_s=stepped["t_mono"] - t0 if stepped else None,
               replacement_start_s=_replacement_start_s(later), **_heal(heal))
    return out


def _replacement(later: list[dict]) -> tuple[dict, dict] | None:
    """The supervisor's ``restart`` and the replacement's ``run_start`` after it, among the events after a fault."""
    restart = next((e for e in later if e["kind"] == "restart" and e["rank"] is None), None)
    started = next((e for e in later if e["kind"] == "run_start" and restart and e["t_mono"] >= restart["t_mono"]),
                   None)
    return (restart, started) if started else None


def _replacement_start_s(later: list[dict]) -> float | None:
    """The replacement's spawn -> its ``run_start`` (interpreter, torch, model; a warm spare only joins)."""
    found = _replacement(later)
    return found[1]["t_mono"] - spawned_at(found[0]) if found else None


def spawned_at(restart: dict) -> float:
    """When the supervisor started the replacements of a ``restart`` (``t_mono``): before the event when it
    started them while their incident settled."""
    return restart["t_mono"] - restart.get("spawned_s_before", 0.0)


def replacement_parts(events: list[dict]) -> dict[str, float] | None:
    """The replacement's start after the first fault, in parts: ``exec_s`` its spawn -> the process created (its
    ``run_start`` age back from it: to 10 ms), ``process_s`` its interpreter, imports and roles, ``join_s`` the
    group's forming with the survivors (``run_start``'s ``age_s`` and ``join_s``)."""
    fault = first(events, "fault_injected")
    found = _replacement([e for e in events if fault and e["t_mono"] >= fault["t_mono"]])
    if found is None or "age_s" not in found[1]:
        return None
    restart, started = found
    return {"exec_s": started["t_mono"] - started["age_s"] - spawned_at(restart),
            "process_s": started["age_s"] - started["join_s"], "join_s": started["join_s"]}


def _heal(heal: dict | None) -> dict[str, Any]:
    """The replacement's heal (``ft_heal`` or ``replica_heal``): its whole call, the transfer alone, the bytes."""
    return {"heal_s": heal["heal_s"] if heal else None, "heal_transfer_s": heal["transfer_s"] if heal else None,
            "heal_bytes": heal["bytes"] if heal else None}


def replica_recovery(events: list[dict], world_size: int) -> dict[str, Any]:
    """The measures of ``_replica_groups`` for our ``replica``, which emits none of torchft's events. The survivors
    either wait for the replacement (``while_replacing=wait``: no reduced-width step; held to the bit-exact check)
    or train on in a group of their own (``continue``: each ``step_end`` of a survivor between its
    ``reduced_group`` and its ``rejoined`` is a reduced-width step; then ``bit_exact`` is "not by design").
    ``quorum_detection_s``: the fault -> the survivors' group without the dead rank; ``survivors_stall_s``: the
    fault -> a survivor's first step after it lost the peer; replicas are consistent when every rank ends with
    the same state hash (a heal copies the whole state, so there is no state in between to compare)."""
    modes = {e["while_replacing"] for e in events if e["kind"] == "replica_mode"}
    if not modes:
        return {}
    reduced: set[int] = set()
    for e in events:
        if e["kind"] == "reduced_group":
            healed = next((r["t_mono"] for r in events if r["kind"] == "rejoined" and r["rank"] == e["rank"]
                           and r["t_mono"] > e["t_mono"]), float("inf"))
            reduced |= {s["step"] for s in events if s["kind"] == "step_end" and s["rank"] == e["rank"]
                        and e["t_mono"] < s["t_mono"] < healed}
    final = {e["rank"]: e["final_state_sha256"] for e in events if e["kind"] == "run_end"}  # each rank's last
    out: dict[str, Any] = {
        "while_replacing": modes.pop(), "bit_exact": "not by design" if reduced else None,
        "reduced_width_steps": len(reduced),
        "replicas_consistent": len(final) == world_size and len(set(final.values())) == 1,
        "quorum_detection_s": None, "survivors_stall_s": None, "replacement_start_s": None, **_heal(None)}
    fault = first(events, "fault_injected")
    if fault is None:
        return out
    t0, victim = fault["t_mono"], fault.get("target_rank", fault["rank"])
    later = [e for e in events if e["t_mono"] >= t0]
    shrunk = next((e for e in later if e["kind"] == "reduced_group"), None)
    lost = next((e for e in later if e["kind"] == "peer_lost" and e["rank"] != victim), None)
    stepped = next((e for e in later if lost and e["kind"] == "step_end" and e["rank"] == lost["rank"]
                    and e["t_mono"] > lost["t_mono"]), None)
    out.update(quorum_detection_s=shrunk["t_mono"] - t0 if shrunk else None,
               survivors_stall_s=stepped["t_mono"] - t0 if stepped else None,
               replacement_start_s=_replacement_start_s(later),
               **_heal(next((e for e in later if e["kind"] == "replica_heal"), None)))
    return out
