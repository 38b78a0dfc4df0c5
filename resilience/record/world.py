"""The world sizes a run trained at (``recovery=shrink|grow``): per attempt, the steps trained at each size, and
how long taking a returned node back took (``world_resized`` events, docs/sharded.md)."""

from __future__ import annotations

from typing import Any

from resilience.record.query import first, load_window, loads


def world_sizes(events: list[dict], launch: dict | None) -> dict[str, Any]:
    """Nothing for a run that kept its size; else ``world_sizes``: one entry per attempt that started (its size,
    when it started, the steps it trained); ``steps_at_world_size``: steps trained at each size (rank 0's, a
    replayed step counted again); ``world_resizes``: each change with the checkpoint step the new world resumed
    from; ``grow_s``: the way back up."""
    resizes = [e for e in events if e["kind"] == "world_resized" and "direction" in e]
    if not resizes:
        return {}
    t0 = launch["t_mono"] if launch else events[0]["t_mono"]
    spans, per_size = [], {}
    for start in (e for e in events if e["kind"] == "run_start" and e["rank"] == 0 and "world_size" in e):
        steps = [e["step"] for e in events if e["kind"] == "step_end" and e["rank"] == 0
                 and e["attempt"] == start["attempt"]]
        size = start["world_size"]
        spans.append({"attempt": start["attempt"], "world_size": size, "start_s": start["t_mono"] - t0,
                      "first_step": min(steps, default=None), "last_step": max(steps, default=None),
                      "steps_trained": len(steps)})
        per_size[str(size)] = per_size.get(str(size), 0) + len(steps)
    return {"world_sizes": spans, "steps_at_world_size": per_size,
            "world_resizes": [{"direction": e["direction"], "world_size": e["world_size"], "previous": e["previous"],
                               "step": e["step"], "fault_step": e.get("fault_step"), "t_s": e["t_mono"] - t0}
                              for e in resizes],
            "grow_s": _grow_time(events)}


def _grow_time(events: list[dict]) -> dict[str, float] | None:
    """From the node's return to the full world's first step: waiting for the checkpoint boundary (the return to
    the commit), the supervisor noticing the commit, stopping the small world and starting every rank process,
    their set-up (process group, model), the resharded load (critical path), the first step."""
    up = next((e for e in events if e["kind"] == "world_resized" and e.get("direction") == "up"), None)
    fault = first(events, "fault_injected")
    if up is None or fault is None or fault.get("return_after_s") is None:
        return None
    returned = fault["t_mono"] + fault["return_after_s"]
    commit = next((e for e in events if e["kind"] == "ckpt_durable" and e["step"] == up["step"]
                   and e["t_mono"] <= up["t_mono"]), None)
    mine = [e for e in events if e["attempt"] == up["attempt"] and e["rank"] is not None]
    started = max((e["t_mono"] for e in mine if e["kind"] == "run_start"), default=None)
    load = load_window(loads(mine))  # its critical path, as a recovery's
    step = next((e for e in mine if e["kind"] == "step_end" and e["rank"] == 0), None)
    if commit is None or started is None or load is None or step is None:
        return None
    load_start, loaded = load
    return {"boundary_wait": commit["t_mono"] - returned, "notice": up["t_mono"] - commit["t_mono"],
            "restart": started - up["t_mono"], "set_up": load_start - started, "load": loaded - load_start,
            "first_step": step["t_mono"] - loaded, "total": step["t_mono"] - returned}
