"""The report's tables as DataFrames (also written as CSV): headline per strategy and per fault, inventory, environment.

Every number is a median over runs in state ``ok`` (see ``reports.methods.AGGREGATION``), with ``<m>_n`` (the runs it
is the median of), ``<m>_low`` / ``<m>_high`` (its interval) and ``<m>_level`` (the interval's confidence level:
0.95 where ``<m>_exact``, i.e. n >= 6; else the runs' range at its exact level, 0.75 at n=3; ``reports.stats``);
``*_vs_sync`` columns divide by the ``sync`` strategy's value in the same column (and fault), with
``*_vs_sync_low`` / ``_high`` / ``_level`` (the ratio's interval and its stated level) and ``*_vs_sync_verdict``
("lower" / "higher" only where the 95% intervals separate, else "no measurable difference", or "not compared:
fewer than 6 runs"); empty for sync itself and when there is no sync row. A strategy (or strategy and fault) the matrix asks for keeps its row when none of its cells is ok:
``note`` says "not measured" and why (not run, failed, error).
"""

from __future__ import annotations

import time
from typing import Any

import pandas as pd

from reports import stats
from resilience.record.environment import COLLECT_ENV_SHOWN

BASELINE = "sync"
# What python -m resilience.bench.probe measures; listed as "not probed" when unknown.
LIMIT_KEYS = ("write_GBps", "read_GBps", "memcpy_GBps", "rank_start_s")
# How many samples each limit is made of (resilience/bench/probe.py), where limits.json does not list them.
LIMIT_SAMPLES = {"read_GBps": "n=1", "memcpy_GBps": "best of n=5", "rank_start_s": "n=1", "p2p_GBps": "best of n=3"}
NOT_RUN = "not run"
# Why a row without an ok cell has no figures, by the states of its cells (invalid: the configuration was refused).
REASONS = {NOT_RUN: "not run", "failed": "failed", "invalid": "error", "unrecovered": "unrecovered"}
# The headline tables' medians, each with its n and interval.
STRATEGY_METRICS = ("ckpt_stall_s", "ckpt_durable_s", "ckpt_MB", "write_MBps", "write_pct_of_disk", "step_time_s",
                    "ettr_fault_free")
FAULT_METRICS = ("recovery_time_s", "lost_steps", "detection_latency_s", "ettr")


def col(frame: pd.DataFrame, name: str) -> pd.Series:
    """A column as numbers (NaN where absent), so that a matrix without e.g. faults still renders."""
    if name not in frame:
        return pd.Series(float("nan"), index=frame.index)
    return pd.to_numeric(frame[name], errors="coerce")


def ok_runs(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[frame["state"] == "ok"] if "state" in frame else frame.iloc[0:0]


def noisy(frame: pd.DataFrame) -> pd.Series:
    """Per row: the run was measured while the host was busy (result.json validity, resilience.record.host_load)."""
    return frame.get("validity.verdict", pd.Series(None, index=frame.index, dtype=object)).astype(str) == "noisy"


def timed_runs(frame: pd.DataFrame) -> pd.DataFrame:
    """The ok runs whose timings count: noisy ones are kept out of the headline figures (their bit-exact check
    still counts: a busy host changes times, not states)."""
    ok = ok_runs(frame)
    return ok[~noisy(ok)]


def order(frame: pd.DataFrame, column: str) -> list[str]:
    """Values of ``column`` in the matrix's order (first appearance), which the tables and figures keep."""
    return list(dict.fromkeys(frame[column].dropna())) if column in frame else []


def bit_exact(rows: pd.DataFrame) -> str:
    """"yes", "no (k of n)" or "-" (no run with a verdict) over the rows' ``matches_reference``; a run that by design
    cannot match (trained at reduced width, or at another world size: shrink, grow) is counted apart, never as a
    "no" (e.g. "yes; 2 not by design (world size or width changed)")."""
    apart = _not_by_design(rows)
    verdicts = [v for v in rows.loc[~apart].get("matches_reference", pd.Series(dtype=object))
                if v in (True, False, "True", "False")]
    skipped = f"{int(apart.sum())} not by design ({_why_not_by_design(rows.loc[apart])})" if apart.any() else ""
    if not verdicts:
        return skipped or "-"
    bad = sum(1 for v in verdicts if v in (False, "False"))
    said = "yes" if not bad else f"no ({bad} of {len(verdicts)})"
    return f"{said}; {skipped}" if skipped else said


def _why_not_by_design(rows: pd.DataFrame) -> str:
    """Why: the world size changed, or the runs' own reason (a reduced width, a lossy restore: quantized rows)."""
    said = [r if isinstance(r, str) else "" for r in rows.get("bit_exact", pd.Series(index=rows.index, dtype=object))]
    reasons = [r.removeprefix("not by design: ") for r in dict.fromkeys(said) if r.startswith("not by design: ")]
    return "; ".join(reasons) if reasons and len(reasons) == len(set(said)) else "world size or width changed"


def _not_by_design(rows: pd.DataFrame) -> pd.Series:
    """Runs whose result says they cannot end on the reference's state: ``bit_exact`` "not by design" (reduced
    width) or a world size that changed (``world_resizes``)."""
    reduced = rows.get("bit_exact", pd.Series(index=rows.index, dtype=object)).astype(str).str.startswith(
        "not by design")
    resized = rows.get("world_resizes", pd.Series(index=rows.index, dtype=object)).map(
        lambda v: isinstance(v, list) and len(v) > 0 or isinstance(v, str) and v.strip() not in ("", "[]", "nan"))
    return (reduced | resized).fillna(False).astype(bool)


def workarounds(rows: pd.DataFrame) -> str:
    """The workarounds the rows' library ran with (``peer_patches``, declared in each result.json; docs/peers.md),
    so that a library's row never reads as the library as shipped: "clone_loaded_state", or "" (none)."""
    import json

    names: dict[str, None] = {}
    for value in rows.get("peer_patches", pd.Series(dtype=object)).dropna():
        try:
            listed = json.loads(value) if isinstance(value, str) else value
        except ValueError:
            continue
        names.update(dict.fromkeys(p if isinstance(p, str) else p.get("name", "?") for p in listed or []))
    return ", ".join(names)


def finished(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows of cells that ran (a done.json: any state but ``not run``)."""
    return frame[frame["state"] != NOT_RUN] if "state" in frame else frame


def not_measured(rows: pd.DataFrame) -> str:
    """"" when some of ``rows`` is ok; else "not measured (<why>)", the reasons of its cells' states."""
    states = list(dict.fromkeys(rows["state"].dropna())) if "state" in rows else []
    if "ok" in states:
        ok = rows[rows["state"] == "ok"]
        return f"timings not measured: all {len(ok)} ok run(s) noisy" if noisy(ok).all() else ""
    return f"not measured ({' / '.join(dict.fromkeys(REASONS.get(s, str(s)) for s in states)) or NOT_RUN})"


INTERVAL_PARTS = ("n", "low", "high", "exact", "level")


def interval_columns(metrics: list[str]) -> list[str]:
    """The columns that carry each metric's n and interval (``reports.stats``)."""
    return [f"{m}_{part}" for m in metrics for part in INTERVAL_PARTS]


def medians(samples: dict[str, pd.Series]) -> dict[str, Any]:
    """Each sample's median, its n and its interval with the interval's level, as the table's columns."""
    out: dict[str, Any] = {}
    for name, values in samples.items():
        est = stats.median_interval(values)
        out.update({name: est.median, f"{name}_n": est.n, f"{name}_low": est.low, f"{name}_high": est.high,
                    f"{name}_exact": est.exact, f"{name}_level": est.level})
    return out


def with_ratios(table: pd.DataFrame, keys: list[str], metrics: list[str],
                 samples: list[dict[str, pd.Series]] | None = None) -> pd.DataFrame:
    """Add ``<metric>_vs_sync`` for each metric: the row's value over the sync row with the same ``keys``; with
    ``samples`` (each row's runs per metric, in the table's order), also the ratio's interval, its level and the
    verdict."""
    is_base = table["strategy"] == BASELINE
    for m in metrics:
        ratios, lows, highs, levels, verdicts = [], [], [], [], []
        for i, row in table.iterrows():
            same = is_base.copy()
            for k in keys:
                same &= table[k] == row[k]
            j = same[same].index[0] if same.any() else None
            ref = table.at[j, m] if j is not None else None
            both = row["strategy"] != BASELINE and pd.notna(row[m]) and ref is not None and pd.notna(ref)
            usable = both and ref
            ratios.append(row[m] / ref if usable else None)  # the baseline's own ratio (1) is left empty
            ends = stats.ratio_estimate(samples[i][m], samples[j][m]) if usable and samples else None
            lows.append(ends.low if ends else None)
            highs.append(ends.high if ends else None)
            levels.append(ends.level if ends else None)
            verdicts.append(stats.difference(stats.median_interval(samples[i][m]), stats.median_interval(
                samples[j][m])) if both and samples else None)
        table[f"{m}_vs_sync"] = ratios
        if samples is not None:
            table[f"{m}_vs_sync_low"], table[f"{m}_vs_sync_high"], table[f"{m}_vs_sync_level"] = lows, highs, levels
            table[f"{m}_vs_sync_verdict"] = verdicts
    return table


def disk_limit(limits: dict[str, Any], frame: pd.DataFrame) -> float | None:
    """The disk write bandwidth (MB/s) of the pipeline's probe snapshot (limits.json), else None.

    Never from elsewhere: limits probed by another process, at another time, describe other conditions.
    """
    value = limits.get("write_GBps")
    return float(value) * 1000.0 if limits.get("probed", True) and isinstance(value, (int, float)) else None


def probe_note(limits: dict[str, Any], frame: pd.DataFrame) -> str:
    """Where and when the limits were measured, and whether every finished cell ran under that snapshot."""
    if not limits.get("probed", True) or "measured_at" not in limits:
        return f"Limits not probed ({limits.get('reason', 'no probe snapshot')})."
    when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(limits["measured_at"]))
    snapshot = limits.get("snapshot")
    note = (f"Limits measured on {limits.get('host', '?')} in {limits.get('dir', '?')} at {when}"
            + (f" (probe snapshot {snapshot})" if snapshot else "") + ".")
    ran = finished(frame)
    under = ran["probe"].fillna("none recorded").astype(str) if "probe" in ran else \
        pd.Series("none recorded", index=ran.index)
    other = under[under != str(snapshot)]
    if snapshot and len(other):
        names = ", ".join(sorted(set(other)))
        note += f" {len(other)} of {len(ran)} finished cells ran under another snapshot ({names})."
    return note


def headline_strategies(frame: pd.DataFrame, limits: dict[str, Any]) -> pd.DataFrame:
    """One row per strategy: checkpoint costs, write bandwidth (and its share of the disk), step time and ETTR, from
    its fault-free runs only (a row never pools runs of different faults); bit-exactness over all its runs. The
    stall counts wherever a run measured one (in-memory snapshots stall training without a durable checkpoint)."""
    ok, disk = timed_runs(frame), disk_limit(limits, frame)
    rows, kept = [], []
    for strategy in order(frame, "cell.strategy"):
        mine, mine_ok = frame[frame["cell.strategy"] == strategy], ok[ok["cell.strategy"] == strategy]
        fault_free = mine_ok[mine_ok["cell.fault"] == "none"]
        saved = fault_free[col(fault_free, "ckpt_count") > 0]
        bandwidth = col(saved, "ckpt_bytes") / col(saved, "ckpt_durable_s") / 1e6
        samples = {"ckpt_stall_s": col(fault_free, "ckpt_stall_s"), "ckpt_durable_s": col(saved, "ckpt_durable_s"),
                   "ckpt_MB": col(saved, "ckpt_bytes") / 1e6, "write_MBps": bandwidth,
                   "write_pct_of_disk": 100 * bandwidth / disk if disk else pd.Series(dtype=float),
                   "step_time_s": col(fault_free, "step_time_s"), "ettr_fault_free": col(fault_free, "ettr")}
        kept.append(samples)
        rows.append({"strategy": strategy, "cells": len(mine), "runs": len(finished(mine)), "runs_ok": len(mine_ok),
                     **medians(samples), "bit_exact": bit_exact(mine), "workarounds": workarounds(mine),
                     "note": not_measured(mine)})
    metrics = list(STRATEGY_METRICS)
    table = pd.DataFrame(rows, columns=["strategy", "cells", "runs", "runs_ok", *metrics, "bit_exact", "workarounds",
                                        "note", *interval_columns(metrics)])
    return with_ratios(table, [], ["ckpt_stall_s", "ckpt_durable_s", "write_MBps", "step_time_s", "ettr_fault_free"],
                       kept)


# The recovery and launcher of "our" way: another (torchrun's restart, NVRx's in-process restart) is another row.
USUAL_WAY = {"cell.recovery": ("restart", "rollback"), "cell.supervisor.launcher": ("local",)}


def way(frame: pd.DataFrame) -> pd.Series:
    """Each cell's strategy, with its recovery or launcher in brackets where it is not ours ("sync (torchrun)"): a
    restart by torchrun or in process by NVRx is another technique, not more runs of the strategy's recovery, and
    its ratio to sync is then to our restart of the same fault."""
    if "cell.strategy" not in frame:
        return pd.Series(index=frame.index, dtype=object)
    label = frame["cell.strategy"].astype(str)
    for key, usual in USUAL_WAY.items():
        if key in frame:
            value = frame[key]
            other = value.notna() & ~value.astype(str).isin(usual)
            label = label.where(~other, label + " (" + value.astype(str) + ")")
    if "cell.checkpoint.every" in frame:  # an interval chosen as the run goes is another technique, not more runs
        auto = frame["cell.checkpoint.every"].astype(str) == "auto"
        label = label.where(~auto, label + " (every=auto)")
    return label


def headline_faults(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per (strategy, fault): recovery time, lost steps, detection latency, ETTR, bit-exactness."""
    ok = timed_runs(frame)
    ways = way(frame)
    rows, kept = [], []
    for fault in [f for f in order(frame, "cell.fault_label") if f != "none"]:
        for strategy in order(frame.assign(way=ways), "way"):
            mine = frame[(ways == strategy) & (frame["cell.fault_label"] == fault)]
            if mine.empty:
                continue
            mine_ok = ok.loc[ok.index.intersection(mine.index)]
            samples = {"recovery_time_s": col(mine_ok, "recovery_time_s"), "lost_steps": col(mine_ok, "lost_steps"),
                       "detection_latency_s": col(mine, "detection_latency_s"), "ettr": col(mine_ok, "ettr")}
            kept.append(samples)
            rows.append({
                "strategy": strategy, "fault": fault, "cells": len(mine), "runs": len(finished(mine)),
                "recovered": int((mine.get("recovered", pd.Series(dtype=object)) == True).sum()),  # noqa: E712
                **medians(samples), "bit_exact": bit_exact(mine), "note": not_measured(mine),
            })
    metrics = list(FAULT_METRICS)
    table = pd.DataFrame(rows, columns=["strategy", "fault", "cells", "runs", "recovered", *metrics, "bit_exact",
                                        "note", *interval_columns(metrics)])
    return with_ratios(table, ["fault"], ["recovery_time_s", "lost_steps", "ettr"], kept)


def false_alarms(frame: pd.DataFrame) -> tuple[int, int]:
    """(detections before any fault, runs with a result): a detector that fires on a healthy run costs a restart."""
    with_result = frame[col(frame, "false_alarms").notna()]
    return int(col(with_result, "false_alarms").sum()), len(with_result)


def false_alarm_note(frame: pd.DataFrame) -> str:
    """The line under the detection figure."""
    alarms, runs = false_alarms(frame)
    return f"<p class=\"note\">False alarms (a detection before any fault was injected): {alarms} in {runs} runs.</p>"


def inventory(frame: pd.DataFrame) -> pd.DataFrame:
    """Every cell of the matrix, problems first (failed, invalid, not run): how it ended and why."""
    columns = ["cell", "state", "status", "attempts", "steps_completed", "steps", "wall_time_s", "elapsed_s",
               "matches_reference", "validity.verdict", "validity.reasons", "error", "error_detail"]
    table = frame.reindex(columns=columns).copy()
    if "unrecoverable" in frame:  # why the supervisor gave up (result.json): the unrecovered run's error text
        table["error"] = table["error"].where(table["error"].notna(), frame["unrecoverable"])
    rank = table["state"].map({"failed": 0, "invalid": 1, NOT_RUN: 2, "unrecovered": 3}).fillna(4)
    return table.iloc[rank.argsort(kind="stable")].reset_index(drop=True)


def limit_text(key: str, value: float, limits: dict[str, Any]) -> str:
    """A probed limit with its n: "0.244 (median of [0.0989, 0.663] n=3 at 75%)" where limits.json keeps the
    samples (``<name>_samples_<unit>``), else how many samples the probe takes for it."""
    name, _, unit = key.rpartition("_")
    samples = limits.get(f"{name}_samples_{unit}")
    if isinstance(samples, list) and samples:
        return f"{value:.3g} (median of {stats.median_interval(samples).text()})"
    return f"{value:.3g} ({LIMIT_SAMPLES[key]})" if key in LIMIT_SAMPLES else f"{value:.3g}"


def environment_table(env: dict[str, Any], limits: dict[str, Any], frame: pd.DataFrame) -> pd.DataFrame:
    """Where the numbers were measured, and the physical limits they are compared with ("not probed" if unknown)."""
    rows = [{"group": "environment", "key": k, "value": v} for k, v in env.items() if not isinstance(v, dict)]
    rows += [{"group": "collect_env", "key": k, "value": v} for k, v in (env.get("collect_env") or {}).items()
             if k in COLLECT_ENV_SHOWN]  # the rest (package lists, lscpu) stays in environment.json
    probed = bool(limits.get("probed", True)) and any(k in limits for k in LIMIT_KEYS)
    for key in list(LIMIT_KEYS) + sorted(k for k in limits if k not in LIMIT_KEYS and k != "probed"):
        if probed and key in limits:
            value = limits[key]
            if isinstance(value, list):
                value = ", ".join(f"{x:.3g}" if isinstance(x, float) else str(x) for x in value)
            elif key == "measured_at" and isinstance(value, (int, float)):
                value = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(value))
            elif isinstance(value, float):
                value = limit_text(key, value, limits)
        elif key == "reason":
            value = limits[key]
        else:
            value = "not probed"
        rows.append({"group": "limits", "key": key, "value": value})
    return pd.DataFrame(rows, columns=["group", "key", "value"])
