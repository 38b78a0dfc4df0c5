"""Gantt timelines drawn from ``events.jsonl``: one representative run per strategy, every rank and the supervisor.

The representative run of a strategy is its first recovered run in matrix order (the first fault, the lowest
seed); without one, its first run with an injected fault; without that, its first fault-free run. Under the
figure, each one's Perfetto / Chrome trace (``python -m resilience.trace``), embedded, to download and open.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from reports.figures import empty  # noqa: E402
from reports.html import esc  # noqa: E402
from reports.tables import order  # noqa: E402
from resilience.record.events import read_events  # noqa: E402
from resilience.record.query import durable_times, stalls  # noqa: E402
from resilience.trace import trace  # noqa: E402

_PAL = sns.color_palette("colorblind")
COLORS = {"step": _PAL[0], "lost step": "#f4a3a3", "start-up": "#c8c8c8", "checkpoint stall": _PAL[1],
          "until durable": _PAL[8], "checkpoint load": _PAL[2], "supervisor": "#e8e8e8"}
MARKS = {"fault injected": ("X", "#d62728"), "restart": ("s", "#555555"), "fault detected": ("v", _PAL[4]),
         "resumed": ("^", _PAL[2])}  # drawn in this order: a detection sits on top of the restart that follows it


def representatives(frame: pd.DataFrame) -> pd.DataFrame:
    """One row of ``frame`` per strategy (see module docstring), in the matrix's strategy order."""
    picks = []
    has_events = frame["run_dir"].map(lambda d: (Path(str(d)) / "events.jsonl").exists())
    for strategy in order(frame, "cell.strategy"):
        mine = frame[(frame["cell.strategy"] == strategy) & has_events]
        flag = lambda name: mine.get(name, pd.Series(False, index=mine.index)).isin([True, "True"])  # noqa: E731
        for pick in (mine[flag("recovered") & (mine["state"] == "ok")], mine[flag("fault_injected")],
                     mine[(mine["cell.fault"] == "none") & (mine["state"] == "ok")], mine):
            if not pick.empty:
                picks.append(pick.iloc[0])
                break
    return pd.DataFrame(picks)


def segments(events: list[dict]) -> pd.DataFrame:
    """Bars (start_s < end_s) and instants (start_s == end_s) of one run, in seconds since its launch."""
    if not events:
        return pd.DataFrame(columns=["row", "kind", "start_s", "end_s", "attempt", "step"])
    launch = next((e for e in events if e["kind"] == "launch"), events[0])
    t0 = launch["t_mono"]
    row = lambda e: "supervisor" if e["rank"] is None else f"rank {e['rank']}"  # noqa: E731
    out: list[dict] = []
    add = lambda e, kind, start, end: out.append({"row": row(e), "kind": kind, "start_s": start - t0,  # noqa: E731
                                                  "end_s": end - t0, "attempt": e["attempt"], "step": e["step"]})
    last_attempt = {}
    for e in events:
        if e["kind"] == "step_end":
            last_attempt[(e["rank"], e["step"])] = max(last_attempt.get((e["rank"], e["step"]), -1), e["attempt"])
    starts = {0: t0} | {e["attempt"]: e["t_mono"] for e in events if e["kind"] == "restart"}
    end = next((e for e in events if e["kind"] == "supervisor_end"), events[-1])
    add(launch, "supervisor", t0, end["t_mono"])
    for e in events:
        kind, t = e["kind"], e["t_mono"]
        if kind == "step_end":
            lost = last_attempt[(e["rank"], e["step"])] > e["attempt"]
            add(e, "lost step" if lost else "step", t - e.get("duration_s", 0.0), t)
        elif kind == "run_start":
            add(e, "start-up", starts.get(e["attempt"], t), t)
        elif kind == "ckpt_loaded":
            add(e, "checkpoint load", t - e.get("duration_s", 0.0), t)
        elif kind in ("fault_injected", "fault_detected", "restart", "resumed"):
            add(e, kind.replace("_", " "), t, t)
    for label, saves in (("checkpoint stall", stalls(events)), ("until durable", durable_times(events))):
        for s in saves:
            add(s.closing, label, s.start, s.end)
    return pd.DataFrame(out)


def _draw(ax, segs: pd.DataFrame, title: str) -> None:
    rows = ["supervisor"] + sorted({r for r in segs["row"] if r != "supervisor"}, key=lambda r: int(r.split()[1]))
    y = {r: len(rows) - 1 - i for i, r in enumerate(rows)}
    for s in segs.itertuples():
        if s.kind in COLORS:
            lane = y[s.row] + (-0.28 if s.kind == "until durable" else 0)
            height = 0.14 if s.kind == "until durable" else 0.56
            ax.broken_barh([(s.start_s, max(s.end_s - s.start_s, 1e-3))], (lane - height / 2, height),
                           color=COLORS[s.kind], linewidth=0)
        elif s.kind in MARKS:
            marker, color = MARKS[s.kind]
            ax.plot(s.start_s, y[s.row], marker=marker, color=color, markersize=10, markeredgecolor="white",
                    zorder=5 + list(MARKS).index(s.kind))
            if s.kind in ("fault injected", "fault detected"):
                ax.axvline(s.start_s, color=color, linestyle="--", linewidth=1, alpha=0.7)
    ax.set_yticks(list(y.values()), list(y.keys()))
    ax.set_ylim(-0.7, len(rows) - 0.3)
    ax.set_title(title, loc="left", fontsize=10)
    ax.grid(axis="y", visible=False)


def timeline(frame: pd.DataFrame) -> tuple[Figure, pd.DataFrame]:
    """One Gantt chart per strategy (stacked), and all their segments as one table."""
    reps = representatives(frame) if "run_dir" in frame and not frame.empty else pd.DataFrame()
    parts = []
    for _, r in reps.iterrows():
        segs = segments(read_events(Path(str(r["run_dir"]))))
        segs.insert(0, "cell", r["cell"])
        segs.insert(0, "strategy", r["cell.strategy"])
        parts.append(segs)
    data = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()
    if data.empty:
        return empty("Timeline", "no run with an event log"), data
    runs = list(dict.fromkeys(zip(data["strategy"], data["cell"])))
    heights = [1 + data[data["cell"] == c]["row"].nunique() * 0.5 for _, c in runs]
    # One time axis for all: the strategies' recoveries are compared by eye.
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, sum(heights) + 1.2), height_ratios=heights, squeeze=False,
                             sharex=True)
    for ax, (strategy, cell) in zip(axes[:, 0], runs):
        _draw(ax, data[data["cell"] == cell], f"{strategy}: {cell} (one run, n=1)")
    axes[-1, 0].set_xlabel("seconds since launch")
    handles = [Patch(color=c, label=k) for k, c in COLORS.items()] + [
        Line2D([], [], marker=m, color=c, linestyle="", markersize=9, label=k) for k, (m, c) in MARKS.items()]
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.6 / (sum(heights) + 1.2)))
    fig.legend(handles=handles, loc="upper center", ncols=6, frameon=False, fontsize=9)
    return fig, data


def trace_links(frame: pd.DataFrame) -> str:
    """HTML under the timeline: each representative run's trace as a download embedded in the report (it stays
    self-contained), to open in ui.perfetto.dev or chrome://tracing, and the command that writes it."""
    reps = representatives(frame) if "run_dir" in frame and not frame.empty else pd.DataFrame()
    links = []
    for _, r in reps.iterrows():
        run_dir = Path(str(r["run_dir"]))
        data = json.dumps(trace(run_dir), separators=(",", ":")).encode()
        href = "data:application/json;base64," + base64.b64encode(data).decode()
        links.append(f'<a download="trace-{esc(run_dir.name)}.json" href="{href}">{esc(r["cell.strategy"])}</a>')
    if not links:
        return ""
    return ("<p class=\"caption\">The same runs as traces, one track per rank, with steps, checkpoints, the fault, its "
            "detection and the recovery phases (download, then open in ui.perfetto.dev or chrome://tracing): "
            + ", ".join(links) + ". Any run: <code>python -m resilience.trace RUN_DIR</code>.</p>")
