"""In-process restart (``recovery=nvrx_inprocess``): which mechanism recovered the run, NVRx's in the same processes
or the supervisor's restart of the processes, and what NVRx was run with. ``resilience.record.metrics`` adds the
``inprocess`` field to every result (None for every other recovery)."""

from __future__ import annotations

from typing import Any

from resilience.record.query import first

FALLBACK = ("the supervisor restarted every rank's process: NVRx restarts only live processes in place (a dead or "
            "killed rank, or the in-process budget spent, ends its restart)")


def inprocess_recovery(events: list[dict]) -> dict[str, Any]:
    """``inprocess``: the library and version, its settings and the workarounds applied (``patches``), the number of
    in-process restarts, and for the run's first fault ``recovered_by`` ("in_process" when the first attempt after
    the fault ran in the same processes, "process_restart" when the supervisor started new ones, with ``fallback``
    saying why) and NVRx's ``restart_s`` (fault -> the new attempt's start on rank 0, inside the recovery time)."""
    attempts = [e for e in events if e["kind"] == "inprocess_attempt" and e["rank"] == 0]
    if not attempts:
        return {"inprocess": None}
    out: dict[str, Any] = {"library": attempts[0]["library"], "version": attempts[0]["version"],
                           "settings": attempts[0]["settings"], "patches": [p["name"] for p in attempts[0]["patches"]],
                           "restarts": sum(1 for e in attempts if e["iteration"] > 0),
                           "recovered_by": None, "fallback": None, "restart_s": None}
    fault = first(events, "fault_injected")
    after = next((e for e in attempts if fault is not None and e["attempt"] > fault["attempt"]), None)
    if after is not None:
        in_place = after["iteration"] > 0
        out.update(recovered_by="in_process" if in_place else "process_restart",
                   fallback=None if in_place else FALLBACK, restart_s=after["t_mono"] - fault["t_mono"])
    return {"inprocess": out}
