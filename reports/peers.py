"""Ours against the libraries: for each technique family, our implementation next to each library that a user
would adopt instead, on the same faults and the same bit-exact check.

One row per (workload, strategy): the library and version (``-`` for ours), the workarounds applied to it, the
median stall, time to durable, load time and recovery time and lost steps over its runs, the host memory its
fault-free runs used (peak PSS of the run's processes, ``resilience.record.memory``), each with its n and interval
(``reports.stats``), whether every run ended bit-exact, and ratios to ``sync`` and to the best library of the family
on the same workload, each with its interval and that interval's level. The note under the
figure lists the findings: a library run that is not bit-exact, that failed, or that left processes behind, each
with the command that reproduces it.
"""

from __future__ import annotations

import html
import json
from functools import cache

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.figure import Figure

from reports import stats
from reports.figures import interval_bars
from reports.tables import bit_exact, col, finished, medians, noisy, order, way, with_ratios
from resilience import compat

MEASURES = {"stall_s": "ckpt_stall_s", "durable_s": "ckpt_durable_s", "load_s": "recovery_load_s",
            "recovery_s": "recovery_time_s", "lost_steps": "lost_steps"}
AFTER_A_FAULT = ("load_s", "recovery_s", "lost_steps")  # over the faults every strategy of the workload met
TIMED = ("stall_s", "durable_s", "recovery_s")  # drawn, and compared with sync


@cache
def families() -> dict[str, str]:
    """The technique each strategy option implements, as its class declares it (``caps.family``); a strategy without
    one (none, replica) is not a checkpointing technique."""
    return {name: o.caps.family for name, o in compat.options("strategy").items() if o.caps.family}


def family(strategy: str) -> str | None:
    """The technique family of an option (a variant's is its role's); None for a strategy that does not checkpoint."""
    return families().get(strategy)


def not_applicable() -> str:
    """Cells no matrix may hold: what the table of rules refuses of a fault for a strategy (the command refuses
    them in one line, resilience/compat/), said here, never a silent pass."""
    said = [f"{refused} ({r.doc.rstrip('.')})" for r in compat.RULES if set(r.reads) == {"fault", "strategy"}
            if (refused := compat.refused(r))]
    return f"Not applicable: {html.escape('; '.join(said), quote=False)}." if said else ""


def checkpointing(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows of checkpointing strategies (a family of their own)."""
    if not len(frame) or "cell.strategy" not in frame or "cell.workload" not in frame:
        return frame.iloc[0:0]
    return frame[frame["cell.strategy"].map(lambda s: family(str(s)) is not None)]


def peers_table(frame: pd.DataFrame) -> pd.DataFrame:
    """The comparison table (see the module docstring); empty when the matrix ran no checkpointing strategy."""
    runs = finished(checkpointing(frame))
    runs = runs[~runs.get("is_reference", pd.Series(False, index=runs.index)).astype(bool)] if len(runs) else runs
    if runs.empty:
        return pd.DataFrame()
    # our recovery and launcher only: torchrun's restart or NVRx's in-process one is a recovery peer (its own figure)
    runs = runs[way(runs) == runs["cell.strategy"].astype(str)]
    rows, samples = [], []
    shared = _shared_faults(runs)
    for (workload, strategy), group in runs.groupby(["cell.workload", "cell.strategy"], sort=False):
        library = group.get("peer.library", pd.Series(dtype=object)).dropna()
        row = {"workload": workload, "family": family(strategy), "strategy": strategy,
               "library": library.iloc[0] if len(library) else "-",
               "version": _first(group, "peer.version"), "patches": _patches(group), "runs": len(group),
               "bit_exact": bit_exact(group)}
        timed = group[~noisy(group)]  # a busy host's timings stay out; its bit-exact check counts
        # never a row that pools different faults: the costs of saving from the fault-free runs, the recovery from
        # the faults every strategy of the workload met (sync alone also meets hangs and bit flips)
        label = timed.get("cell.fault_label", pd.Series("none", index=timed.index)).astype(str)
        free, hit = timed[label == "none"], timed[label.isin(shared.get(workload, set()))]
        samples.append({name: col(hit if name in AFTER_A_FAULT else free, source) for name, source in MEASURES.items()})
        row.update(medians(samples[-1]))  # each with its n and 95% interval (reports.stats)
        row["noisy_runs"] = int(noisy(group).sum())
        # Peak PSS of the run's processes (ranks, supervisor, the library's helpers), fault-free runs only: a
        # recovery's second set of processes is not what a strategy costs.
        free = group[group.get("cell.fault", pd.Series("none", index=group.index)).astype(str) == "none"]
        row.update(medians({"host_MB": col(free if len(free) else group, "host_memory_peak_bytes") / 1e6}))
        rows.append(row)
    table = pd.DataFrame(rows)
    if table.empty:
        return table
    table = with_ratios(table, ["workload"], list(TIMED), samples)  # the ratio's interval and verdict
    for measure in TIMED:
        best = [_best_library(table, i, measure) for i in table.index]
        ests = [stats.ratio_estimate(samples[i][measure], samples[j][measure]) if j is not None else None
                for i, j in zip(table.index, best)]
        name = f"{measure}_vs_best_library"
        table[name] = [table.at[i, measure] / table.at[j, measure] if j is not None else float("nan")
                       for i, j in zip(table.index, best)]
        for part in ("low", "high", "level"):  # the ratio's interval and its stated level (reports.stats)
            table[f"{name}_{part}"] = [getattr(e, part) if e else None for e in ests]
    return table


def _shared_faults(runs: pd.DataFrame) -> dict[str, set[str]]:
    """Per workload: the fault labels every checkpointing strategy of it was run with (none excluded)."""
    out = {}
    for workload, rows in runs.groupby("cell.workload", sort=False):
        labels = rows.get("cell.fault_label", pd.Series("none", index=rows.index)).astype(str)
        each = [set(labels[rows["cell.strategy"] == s]) - {"none"} for s in rows["cell.strategy"].unique()]
        out[workload] = set.intersection(*each) if each else set()
    return out


def peers(frame: pd.DataFrame) -> tuple[Figure, pd.DataFrame]:
    table = peers_table(frame)
    if table.empty:
        fig, ax = plt.subplots(figsize=(8, 1.6))
        ax.axis("off")
        ax.text(0.5, 0.5, "Ours against the libraries\nno data: the matrix ran no checkpointing strategy",
                ha="center", va="center")
        return fig, table
    workloads = order(table, "workload")
    fig, axes = plt.subplots(1, len(workloads), figsize=(6.5 * len(workloads), 0.6 * table["strategy"].nunique()
                                                         + 2), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        mine = table[table["workload"] == workload].reset_index(drop=True)
        interval_bars(ax, mine, list(TIMED), [f"{s}  (n={_runs(r)})" for s, r in zip(mine["strategy"],
                                                                                   mine.itertuples())])
        ax.set(title=workload, xlabel="seconds (median over n runs; bars: its CI, 95% from 6 runs,\nelse the "
                                      "runs' range at its own level: 75% at n=3; levels in peers.csv)")
        ax.set_xscale("symlog", linthresh=0.01)
    fig.tight_layout()
    return fig, table


def _runs(row) -> str:
    """The timed runs behind a row's bars: one n when every measure has the same, else each measure's."""
    ns = {m: int(getattr(row, f"{m}_n")) for m in TIMED}
    return str(next(iter(ns.values()))) if len(set(ns.values())) == 1 else ", ".join(f"{m} {n}" for m, n in
                                                                                     ns.items())


def peers_note(frame: pd.DataFrame) -> str:
    """The findings about the libraries, each with its reproducer; the workarounds in force."""
    runs = checkpointing(frame)
    libraries = runs[runs["peer.library"].notna()] if "peer.library" in runs else runs.iloc[0:0]
    items = []
    for _, run in libraries.iterrows():
        problems = []
        if run.get("state") != "ok":
            problems.append(f"ended {run.get('state')}: {run.get('error') or ''}")
        if run.get("matches_reference") in (False, "False"):
            problems.append("final state differs from the fault-free run")
        orphans = json.loads(run.get("orphans_killed") or "[]") if isinstance(run.get("orphans_killed"), str) else []
        if orphans:
            problems.append(f"left {len(orphans)} process(es) behind when its rank died (killed by the supervisor)")
        if problems:
            items.append(f"<li><b>{html.escape(str(run['cell.strategy']))}</b> ({html.escape(str(run['cell']))}, "
                         f"patches: {html.escape(_patches(run.to_frame().T) or 'none')}): "
                         f"{html.escape('; '.join(problems))}<br><code>{html.escape(str(run.get('command', '')))}"
                         f"</code></li>")
    found = f"<ul>{''.join(items)}</ul>" if items else "<p>No finding: every library run ended bit-exact.</p>"
    return (f"<p class=\"note\">Findings about the libraries (reproduce each with its command):</p>{found}"
            f"<p class=\"note\">{not_applicable()}</p>")


def _first(group: pd.DataFrame, column: str) -> str:
    values = group.get(column, pd.Series(dtype=object)).dropna()
    return str(values.iloc[0]) if len(values) else "-"


def _patches(group: pd.DataFrame) -> str:
    names = set()
    for value in group.get("peer_patches", pd.Series(dtype=object)).dropna():
        names.update(json.loads(value) if isinstance(value, str) else value)
    return ", ".join(sorted(names))


def _best_library(table: pd.DataFrame, i: int, measure: str) -> int | None:
    """The row of the best (lowest positive median) library of row ``i``'s family on its workload, or None."""
    row = table.loc[i]
    same = table[(table["workload"] == row["workload"]) & (table["family"] == row["family"])
                 & (table["library"] != "-")]
    base = pd.to_numeric(same[measure], errors="coerce")
    base = base[base > 0]
    return None if base.empty or pd.isna(row[measure]) else base.idxmin()
