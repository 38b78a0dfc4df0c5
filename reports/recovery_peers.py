"""Recovery without a checkpoint: ours against torchft and NVRx, beside checkpoint-restart and the stock torchrun.

One row per (way of recovering, fault) over the matrix's faulted runs of ``sync`` (checkpoint-restart by our
supervisor, by the stock torchrun: ``supervisor.launcher=torchrun``, or in the same processes by NVRx:
``recovery=nvrx_inprocess``, whose column ``restarted_by`` says whether NVRx or, after a kill, the supervisor's
restart recovered the run), ``replica`` (with and without a warm
spare) and ``replica_torchft``, and of any strategy whose hang detector is NVRx's (``nvrx_heartbeat``): who
detected the fault and how fast, the recovery time and its parts, whether the survivors were restarted, the steps
lost, the steps trained at reduced width, the final loss against the fault-free reference, and the verdict: bit-exact,
or (torchft at reduced width, by design) whether every replica ended consistent.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure

from reports import stats
from reports.figures import n_label
from reports.tables import col, finished, medians, noisy

STRATEGIES = ("sync", "replica", "replica_torchft")


def label(run: pd.Series) -> str:
    """The way a run recovered: its strategy and what of the launcher, spares and hang detector is not ours."""
    text = str(run["cell.strategy"])
    if str(run.get("cell.supervisor.launcher")) in ("torchrun", "ft_launcher"):
        text += f" via {run['cell.supervisor.launcher']}"
    if (pd.to_numeric(run.get("cell.supervisor.spares"), errors="coerce") or 0) > 0:
        text += " + warm spare"
    if str(run.get("cell.detectors", "")).startswith("nvrx_heartbeat"):
        text += " (NVRx detects)"
    if str(run.get("cell.recovery")) == "nvrx_inprocess":
        text += " + NVRx in-process restart"
    return text


def rows_of(frame: pd.DataFrame) -> pd.DataFrame:
    """The faulted runs this section compares (with their label)."""
    if frame.empty or "cell.strategy" not in frame:
        return frame.iloc[0:0]
    frame = finished(frame)
    faulted = frame[(frame.get("cell.fault", pd.Series("none", index=frame.index)) != "none")
                    & ~frame.get("is_reference", pd.Series(False, index=frame.index)).astype(bool)]
    nvrx = faulted.get("cell.detectors", pd.Series("", index=faulted.index)).astype(str).str.contains("nvrx")
    mine = faulted[faulted["cell.strategy"].isin(STRATEGIES) | nvrx]
    return mine.assign(way=mine.apply(label, axis=1)) if len(mine) else mine


def recovery_peers_table(frame: pd.DataFrame) -> pd.DataFrame:
    runs = rows_of(frame)
    if runs.empty:
        return pd.DataFrame()
    loss = dict(zip(frame["cell"], col(frame, "final_loss"))) if "cell" in frame else {}
    out = []
    for (way, fault), group in runs.groupby(["way", "cell.fault_label"], sort=False):
        ended = group[_ended(group)]  # an unrecovered or failed run has no final state and no steps lost to it
        ref_loss = pd.Series([loss.get(r, float("nan")) for r in ended.get("reference_cell", [])], dtype=float)
        delta = col(ended, "final_loss").reset_index(drop=True) - ref_loss
        timed = ended[~noisy(ended)]  # a busy host's timings stay out; its verdicts count
        out.append({
            "way": way, "fault": fault, "n": len(group),
            "detected_by": ", ".join(sorted({str(d) for d in group.get("detector", pd.Series()).dropna()})) or "-",
            **medians({"detection_s": col(group[~noisy(group)], "detection_latency_s"),  # each with n, interval
                       "recovery_s": col(timed, "recovery_time_s"),
                       "restart_s": col(timed, "recovery_breakdown_s.restart"),
                       "load_or_heal_s": col(timed, "recovery_load_s"),
                       "replay_s": col(timed, "recovery_breakdown_s.replay"),
                       "lost_steps": col(ended, "lost_steps"),
                       "reduced_width_steps": col(ended, "reduced_width_steps").fillna(0),
                       "final_loss_delta": delta}),
            "survivors_restarted": _yes_no(group.get("survivors_restarted")),
            "restarted_by": _counts(group.get("inprocess.recovered_by")),
            "verdict": _verdict(group), "noisy_runs": int(noisy(group).sum()),
        })
    return pd.DataFrame(out)


def recovery_peers(frame: pd.DataFrame) -> tuple[Figure, pd.DataFrame]:
    table = recovery_peers_table(frame)
    if table.empty:
        fig, ax = plt.subplots(figsize=(8, 1.6))
        ax.axis("off")
        ax.text(0.5, 0.5, "Recovery without a checkpoint\nno data: the matrix ran no replica, torchft, torchrun or "
                          "NVRx row", ha="center", va="center")
        return fig, table
    runs = rows_of(frame)
    runs = runs[~noisy(runs)].assign(recovery_s=col(runs, "recovery_time_s"))
    # One bar per (way, fault), each on its own labelled row: no legend to cover a bar, no bar a slot off its label.
    bars = []
    for (way, fault), group in runs.groupby(["way", "cell.fault_label"], sort=False):
        est = stats.median_interval(group["recovery_s"])
        if est.n:
            bars.append((n_label(f"{way}: {fault}", [est.n], "bar"), est))
    fig, ax = plt.subplots(figsize=(13, 0.4 * len(bars) + 1.8))
    for y, (name, est) in enumerate(bars):
        ax.barh(y, est.median, color=sns.color_palette()[y % 10])
        ax.errorbar(est.median, y, xerr=[[est.median - est.low], [est.high - est.median]], color="black",
                    capsize=3)
    ax.set_yticks(range(len(bars)), [name for name, _ in bars])
    ax.invert_yaxis()
    ax.set(xlabel="recovery time, fault to training again (s, median; noisy runs left out)\n"
                  "bar: the median's CI, 95% from 6 runs, else the runs' range at its own level (75% at n=3)",
           ylabel="")
    fig.tight_layout()
    return fig, table


def _yes_no(values: pd.Series | None) -> str:
    seen = {bool(v) for v in (values.dropna() if values is not None else [])}
    return {frozenset({True}): "yes", frozenset({False}): "no"}.get(frozenset(seen), "mixed" if seen else "-")


def _counts(values: pd.Series | None) -> str:
    """How often each value occurs ("in_process 3/3"); "-" where the runs have none (not NVRx's rows)."""
    seen = values.dropna().astype(str) if values is not None else pd.Series(dtype=str)
    return ", ".join(f"{v} {n}/{len(values)}" for v, n in seen.value_counts().items()) if len(seen) else "-"


def _verdict(group: pd.DataFrame) -> str:
    """Bit-exact or not over the runs that recovered; the others counted apart by how they ended, with the reason
    the supervisor gave (a run that never recovered has no final state to compare: it is not a "NOT bit-exact")."""
    ended = _ended(group)
    parts = [_not_ended(group[~ended], len(group))] if (~ended).any() else []
    group = group[ended]
    absent = pd.Series(None, index=group.index, dtype=object)
    by_design = group.get("bit_exact", absent).astype(str).eq("not by design")
    exact = group.get("matches_reference", absent)
    if by_design.any():
        consistent = group.get("replicas_consistent", absent)[by_design]
        parts.append(f"not bit-exact by design (reduced width) in {int(by_design.sum())}/{len(group)}; replicas "
                     f"consistent in {int((consistent.astype(str) == 'True').sum())}/{int(by_design.sum())}")
    held = group[~by_design]
    if len(held):
        ok = int((exact[~by_design].astype(str) == "True").sum())
        parts.append(f"bit-exact {ok}/{len(held)}" if ok == len(held) else f"NOT bit-exact in {len(held) - ok}/"
                     f"{len(held)}")
    return "; ".join(parts)


def _ended(group: pd.DataFrame) -> pd.Series:
    """Per run: it ended with the training done (state ``ok``), so it has a final state and a verdict."""
    return group.get("state", pd.Series("ok", index=group.index)).astype(str).eq("ok")


def _not_ended(runs: pd.DataFrame, n: int) -> str:
    """"unrecovered in 6/6 (not recoverable: <why>)": each state's count, with the reasons the supervisor recorded
    (result.json ``unrecoverable``) where it recorded one."""
    why = sorted({str(r) for r in runs.get("unrecoverable", pd.Series(dtype=object)).dropna()})
    counts = ", ".join(f"{state} in {k}/{n}" for state, k in runs["state"].astype(str).value_counts().items())
    return counts + (f" (not recoverable: {'; '.join(why)})" if why else "")
