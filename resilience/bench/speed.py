"""``python -m resilience.bench.speed [--quick]``: every speed figure of issue 16, its goal, MET or MISSED, in one run.

Each row is measured by the benchmark that owns the mechanism, called as a function (``bench.cell``,
``bench.sync_write``, ``bench.inmemory_load``, ``bench.replica_peers``, ``bench.detectors``) or, where that bench
only prints, by the same experiments run here. The host's load is sampled over the whole run and printed under the
table: figures taken beside other work say so. A row that fails or cannot be measured in a reasonable time says
why instead of a verdict. ``--quick`` runs each row on fewer or smaller runs (minutes, not tens of minutes): its
verdicts are indicative only and labelled so.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from resilience.bench.cell import describe_load
from resilience.record.events import read_events
from resilience.record.host_load import HostLoadSampler
from resilience.record.query import stalls

MET, MISSED, UNMEASURED = "MET", "MISSED", "NOT MEASURED"


@dataclass(frozen=True)
class Row:
    """One figure of the table: its value as shown, its goal, whether the value meets it (None: not measured)."""

    figure: str
    value: str
    goal: str
    met: bool | None
    note: str = ""

    @property
    def verdict(self) -> str:
        return UNMEASURED if self.met is None else MET if self.met else MISSED


def unmeasured(figure: str, goal: str, why: str) -> Row:
    return Row(figure, "-", goal, None, why)


def render(rows: list[Row], header: str, footer: list[str]) -> str:
    """The table as Markdown (it goes into docs/performance.md as printed), with the run's context around it."""
    lines = [header, "", "| figure | value | goal | verdict | how measured |", "|---|---|---|---|---|"]
    cell = lambda text: " ".join(str(text).split()).replace("|", "\\|")  # noqa: E731 (one Markdown cell)
    lines += [f"| {cell(r.figure)} | {cell(r.value)} | {r.goal} | {r.verdict} | {cell(r.note)} |" for r in rows]
    counts = {v: sum(r.verdict == v for r in rows) for v in (MET, MISSED, UNMEASURED)}
    return "\n".join([*lines, "", ", ".join(f"{n} {v}" for v, n in counts.items()), *footer])


# --- the rows ---------------------------------------------------------------------------------------------------

def cell_rows(out: Path, quick: bool) -> list[Row]:
    from resilience.bench.cell import breakdown, table

    b = breakdown([], repeats=1 if quick else 3, root=out)
    print(table(b), flush=True)
    p = b["phases"]
    return [Row("fault-free cell wall time / training time inside it, gpt_tiny 30 steps", f"{b['ratio']:.2f}x",
                "<= 2x", b["ratio"] <= 2,
                f"bench.cell, median of {b['repeats']}: wall {b['wall_s']:.2f} s, training {p['training']:.2f} s "
                f"(steps alone {b['steps_s']:.2f} s: {b['wall_s'] / b['steps_s']:.1f}x); "
                f"supervisor start {p['supervisor start']:.2f} s, rank start {p['rank start']:.2f} s, "
                f"teardown {p['teardown']:.2f} s, result {p['result']:.2f} s, exit {p['exit']:.2f} s")]


def matrix_row(results: Path) -> list[Row]:
    """The default matrix's last measured span, from its cells' done.json (the probe and report not included)."""
    figure, goal = "default matrix wall time on 2 idle cores", "<= 15 min"
    done = [json.loads(p.read_text()) for p in sorted((results / "runs").glob("*/done.json"))]
    if not done:
        return [unmeasured(figure, goal, f"not measured in this run: no cell in {results}/runs; measure with "
                           "`time snakemake --cores 2` (docs/pipeline.md), then rerun this bench")]
    start = min(d["started"] for d in done)
    span_min = (max(d["started"] + d["elapsed_s"] for d in done) - start) / 60
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(start))
    noisy = sum(d.get("validity") == "noisy" for d in done)
    where = f"results/{results.name}" if results.parent.name == "results" else results.name  # no host path in docs
    return [Row(figure, f"{span_min:.1f} min", goal, span_min <= 15,
                f"last pipeline run in {where} ({when}): {len(done)} cells' span from their done.json, the probe "
                f"and report not included; {noisy} of them noisy (other processes' CPU over validity's limit)")]


def sync_write_rows(out: Path, quick: bool) -> list[Row]:
    from resilience.bench.sync_write import measure

    r = measure("dlrm_emb", rounds=1 if quick else 3, out_dir=out)
    ratio = r["ratio_now_probe1"]
    return [Row("sync durable write bandwidth / probed disk write bandwidth, dlrm_emb", f"{ratio:.0%}", ">= 70%",
                ratio >= 0.70, f"bench.sync_write, median of {len(r['rounds'])} interleaved round(s): sync "
                f"{r['GBps']['now']:.2f} GB/s, probe (1 GiB, fsync) {r['GBps']['probe_1']:.2f} GB/s")]


def rank0_stalls(run_dir: Path) -> list[float]:
    """Rank 0's stall of every checkpoint, in order."""
    return [s.seconds for s in stalls(read_events(run_dir)) if s.rank == 0]


def snapshot_stalls(run_dir: Path) -> tuple[list[float], list[float]]:
    """Rank 0's checkpoints in order: each one's snapshot stall (the stall without the wait for the previous
    persist) and that wait (back-pressure: the interval was shorter than the persist)."""
    events = read_events(run_dir)
    waited = {(e["attempt"], e["step"]): e["duration_s"] for e in events
              if e["rank"] == 0 and e["kind"] == "ckpt_persist_waited"}
    taken = [s for s in stalls(events) if s.rank == 0]
    waits = [waited.get((s.attempt, s.step), 0.0) for s in taken]
    return [s.seconds - w for s, w in zip(taken, waits)], waits


SHORT_EVERY = 5  # the default matrix's interval: too short for dlrm_emb's persist (back-pressure)
FLOOR_PROBES = 3  # rank probes for the replica floor (when no cached probe of this host serves)


def async_rows(out: Path, quick: bool) -> list[Row]:
    from resilience.bench.experiment import run_experiment

    rows = []
    for workload in ("dlrm_emb", "gpt_small"):
        common = [f"workload={workload}", "world_size=2", "seed=0", "detector=[process_exit]"]
        sync = run_experiment(out / f"stall-{workload}-sync", [*common, "strategy=sync", "steps=20",
                                                               f"checkpoint.every={SHORT_EVERY}"])
        base = statistics.median(rank0_stalls(out / f"stall-{workload}-sync"))
        # an interval the persist sustains: async persists what sync writes in its stall, so 1.5x sync's time to
        # durable, in steps
        every = max(SHORT_EVERY, math.ceil(1.5 * sync["ckpt_durable_s"] / sync["step_time_s"]))
        found = {}
        for name, interval in (("sustained", every), ("short", SHORT_EVERY)):
            run_dir = out / f"stall-{workload}-async-every{interval}"
            if not (run_dir / "result.json").exists():  # the persist may sustain the short interval itself
                run_experiment(run_dir, [*common, "strategy=async", f"steps={4 * interval}",
                                         f"checkpoint.every={interval}"])
            found[name] = snapshot_stalls(run_dir)
        snaps, waits = found["sustained"]
        worst = max(snaps) / base
        rows.append(Row(f"async snapshot stall / sync stall, {workload} (every checkpoint, the first included; at "
                        f"an interval the persist sustains)", f"{worst:.2%} (worst)", "<= 5%", worst <= 0.05,
                        f"one fault-free run each, rank 0: async at checkpoint.every={every} (1.5x sync's "
                        f"{sync['ckpt_durable_s']:.2f} s to durable over its {sync['step_time_s'] * 1e3:.0f} ms "
                        f"step), {len(snaps)} checkpoints, snapshot stalls "
                        + ", ".join(f"{x * 1e3:.0f}" for x in snaps)
                        + f" ms, waits for the previous persist {sum(w > 0 for w in waits)}; sync's median stall "
                        f"{base * 1e3:.0f} ms"))
        snaps, waits = found["short"]
        worst = max(snaps) / base
        rows.append(Row(f"async back-pressure at checkpoint.every={SHORT_EVERY}, {workload}: the wait for the "
                        f"previous persist, apart from the snapshot stall", f"{statistics.mean(waits) * 1e3:.0f} ms "
                        f"a checkpoint ({sum(w > 0 for w in waits)} of {len(waits)} waited)",
                        "apart; snapshot <= 5%", worst <= 0.05,
                        "the same run's snapshot stalls " + ", ".join(f"{x * 1e3:.0f}" for x in snaps)
                        + " ms (worst " + f"{worst:.2%} of sync's), waits " + ", ".join(f"{w * 1e3:.0f}" for w in waits)
                        + " ms: at this interval the stall a training step sees is their sum"))
    return rows


def inmemory_rows(out: Path, quick: bool) -> list[Row]:
    from resilience.bench.inmemory_load import one_run

    rows = []
    # One run each (a dlrm_emb run is minutes on a busy host); bench.inmemory_load --repeats N for medians. Both
    # verify what they load with the same checksum (xxh3_64), sync from a warm page cache.
    for workload in ("gpt_small",) if quick else ("gpt_small", "dlrm_emb"):
        sync_s, mem_s = (one_run(out, workload, s, "kill", 0, False)["load_s"] for s in ("sync", "inmemory"))
        rows.append(Row(f"inmemory load / sync load speed, {workload}", f"{sync_s / mem_s:.1f}x", ">= 5x",
                        sync_s / mem_s >= 5, f"bench.inmemory_load.one_run, kill of rank 1 at step 12, one run "
                        f"each: sync {sync_s:.3f} s, inmemory {mem_s:.3f} s (critical path of the load; both "
                        f"verified with xxh3_64, sync from a warm page cache)"))
    return rows


def replica_rows(out: Path, quick: bool) -> list[Row]:
    from resilience.bench.experiment import run_experiment
    from resilience.bench import probe
    from resilience.bench.replica_peers import BASE, WAYS, floor_s
    from resilience.record.events import read_events
    from resilience.record.replicas import replacement_parts

    # replica_peers.floor_limits, with room for a busy host: its rank probe's 60 s limit is not enough there
    cached = probe.cached_limits(out) or {}
    if {"rank_start_s", "p2p_GBps"} <= set(cached):
        limits = {"rank_start_s": cached["rank_start_s"], "p2p_GBps": cached["p2p_GBps"], "source": "cached"}
    else:  # one probe's rank start moved from 0.95 to 1.57 s within a day: the floor is their median
        probes = [probe.measure_ranks(timeout_s=600) for _ in range(FLOOR_PROBES)]
        limits = {key: statistics.median(p[key] for p in probes) for key in ("rank_start_s", "p2p_GBps")}
        starts = ", ".join(f"{p['rank_start_s']:.2f}" for p in probes)
        limits["source"] = f"median of {FLOOR_PROBES} measured now: {starts} s"
    rows = []
    for workload in ("gpt_small",) if quick else ("gpt_small", "dlrm_emb"):
        r = run_experiment(out / f"replica-{workload}", [f"workload={workload}", *BASE, *WAYS["replica"]],
                           timeout_s=900)
        floor = floor_s(r.get("heal_bytes"), limits)
        if r.get("recovery_time_s") is None or floor is None:
            rows.append(unmeasured(f"replica recovery / (replacement start + transfer floor), {workload}", "<= 1.5x",
                                   f"run status {r['status']}: no recovery time or heal bytes to compare"))
            continue
        ratio = r["recovery_time_s"] / floor
        parts = replacement_parts(read_events(out / f"replica-{workload}"))
        split = ("" if parts is None else
                 f"; replacement start {r['replacement_start_s']:.2f} s = restart -> process {parts['exec_s']:.2f} s"
                 f" + interpreter, imports, roles {parts['process_s']:.2f} s + group re-formed {parts['join_s']:.2f} s"
                 f", heal {r['heal_s']:.2f} s (transfer {r['heal_transfer_s']:.2f} s)")
        rows.append(Row(f"replica recovery / (replacement start + transfer floor), {workload}", f"{ratio:.2f}x",
                        "<= 1.5x", ratio <= 1.5 and r.get("survivors_restarted") is not True,
                        f"one kill of rank 1 at step 13: recovery {r['recovery_time_s']:.2f} s, floor {floor:.2f} s "
                        f"(rank start {limits['rank_start_s']:.2f} s, probe {limits['source']}, + "
                        f"{r['heal_bytes'] / 1e6:.0f} MB at {limits['p2p_GBps']:.2f} GB/s); survivors restarted: "
                        f"{r.get('survivors_restarted')}{split}"))
    return rows


def fingerprint_rows(out: Path, quick: bool) -> list[Row]:
    """The verdict from within the run that pays for it: the median check (fingerprint + all-gather, the
    ``fingerprint_check`` events) over the median step period of the same run, a ratio host load tilts on both
    sides alike, where a pair of runs swings by more than the 2% goal on this host. The pair stays beside it as a
    cross-check, and the CPU time of a check against a step's (``bench.detectors.cpu_cost``, one process)."""
    from resilience.bench.detectors import FP_STEPS, coverage, cpu_cost, step_period_s
    from resilience.bench.experiment import run_experiment

    rows = []
    for workload in ("gpt_tiny",) if quick else tuple(FP_STEPS):
        c = cpu_cost(workload)
        period = {}
        for label, dets in (("without", "process_exit"), ("with", "process_exit,replica_fingerprint")):
            run_dir = out / f"fp-{workload}-{label}"
            run_experiment(run_dir, [f"workload={workload}", "world_size=2", "strategy=none", "seed=0",
                                     f"steps={FP_STEPS[workload]}", f"detector=[{dets}]"])
            period[label] = step_period_s(run_dir)
        events = read_events(out / f"fp-{workload}-with")
        # Every check of the run after the first 3 steps (warm-up), calibration included, over those steps: the
        # share of the training time the detector costs at its default (every=auto decides the interval).
        checks = [e for e in events if e["kind"] == "fingerprint_check" and e["rank"] == 0 and e["step"] > 3]
        steps = sum(1 for e in events if e["kind"] == "step_end" and e["rank"] == 0 and e["step"] > 3)
        check_s = statistics.median(e["compute_s"] + e["gather_s"] for e in checks)
        compute_s = statistics.median(e["compute_s"] for e in checks)
        share = sum(e["compute_s"] + e["gather_s"] for e in checks) / (steps * period["with"])
        cov = coverage(out / f"fp-{workload}-with") or {}
        every = next((f"every={e['every']} from step {e['anchor']}" for e in events
                      if e["kind"] == "fingerprint_interval"), f"every={c['every']}")
        wall = (period["with"] - period["without"]) / period["without"]
        rows.append(Row(f"fingerprint overhead at default every, {workload}", f"{share:+.2%}", "<= 2% of step",
                        share <= 0.02, f"in the run, rank 0: {len(checks)} checks in {steps} steps ({every}), "
                        f"median {check_s * 1e3:.2f} ms (fingerprint {compute_s * 1e3:.2f} ms + all-gather), step "
                        f"{period['with'] * 1e3:.1f} ms; coverage in {cov.get('coverage_steps', '-')} steps. "
                        f"Cross-checks: CPU time in one process {c['check_s'] * 1e3:.2f} ms per step of "
                        f"{c['step_s'] * 1e3:.1f} ms CPU ({c['check_s'] / c['step_s']:+.1%}, no communication in "
                        f"the step); a pair of runs {period['with'] * 1e3:.1f} ms with, "
                        f"{period['without'] * 1e3:.1f} ms without ({wall:+.1%}, moves with the host)"))
    return rows


def detection_rows(out: Path, quick: bool) -> list[Row]:
    from resilience.bench.detectors import BASE
    from resilience.bench.experiment import run_experiment

    kill = run_experiment(out / "kill", [*BASE, "seed=0", "steps=30", "fault=kill", "fault.at_step=13"])
    hang = run_experiment(out / "hang", [*BASE, "seed=0", "steps=30", "fault=hang", "fault.at_step=13",
                                         "timeouts.heartbeat_s=2"])
    rows = []
    for what, r, limit, goal in (("process-death detection", kill, 1.0, "<= 1 s"),
                                 ("hang detection (heartbeat_s=2)", hang, 3.0, "<= heartbeat_s + 1 s = 3 s")):
        lat = r.get("detection_latency_s")
        if lat is None:
            rows.append(unmeasured(what, goal, f"not detected (run status {r['status']})"))
            continue
        rows.append(Row(what, f"{lat:.3f} s", goal, lat <= limit and r.get("detected_rank_correct") is True,
                        f"one run, gpt_tiny: detected by {r['detector']}, blamed rank {r['detected_rank']} "
                        f"(injected {r['fault_rank']})"))
    return rows


SECTIONS: dict[str, Callable[[Path, bool], list[Row]]] = {
    "cell": cell_rows, "sync_write": sync_write_rows, "async": async_rows, "inmemory": inmemory_rows,
    "replica": replica_rows, "fingerprint": fingerprint_rows, "detection": detection_rows}
FIGURES = {"cell": "fault-free cell wall time / training time, gpt_tiny 30 steps",
           "sync_write": "sync durable write bandwidth / probed disk write bandwidth, dlrm_emb",
           "async": "async snapshot stall / sync stall, dlrm_emb and gpt_small; back-pressure apart",
           "inmemory": "inmemory load / sync load speed",
           "replica": "replica recovery / (replacement start + transfer floor)",
           "fingerprint": "fingerprint overhead at default every", "detection": "process-death; hang detection"}
GOALS = {"cell": "<= 2x", "sync_write": ">= 70%", "async": "<= 5%", "inmemory": ">= 5x", "replica": "<= 1.5x",
         "fingerprint": "<= 2% of step", "detection": "<= 1 s; <= heartbeat_s + 1 s"}


def measure(section: str, out: Path, quick: bool) -> list[Row]:
    """One section's rows; a section that fails is one row saying why (the others still run)."""
    t0 = time.monotonic()
    print(f"[speed] {section} ...", flush=True)
    try:
        (out / section).mkdir(parents=True, exist_ok=True)
        rows = SECTIONS[section](out / section, quick)
    except Exception as exc:  # noqa: BLE001 (one broken bench must not hide the other figures)
        traceback.print_exc()
        rows = [unmeasured(FIGURES[section], GOALS[section],
                           f"the bench failed: {type(exc).__name__}: {str(exc)[:160]}")]
    print(f"[speed] {section}: {time.monotonic() - t0:.0f} s", flush=True)
    return rows


def commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, check=True).stdout.strip()
        return head.stdout.strip() + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m resilience.bench.speed", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer, smaller runs per row (indicative verdicts)")
    ap.add_argument("--only", nargs="+", choices=list(SECTIONS), help="measure these rows only")
    ap.add_argument("--out", type=Path, default=None, help="where the runs go (default results/speed/<time>)")
    ap.add_argument("--results", type=Path, default=Path("results/default"), help="the pipeline's results, for the matrix row")
    args = ap.parse_args(argv)
    out = args.out or Path("results/speed") / time.strftime("%Y-%m-%d_%H-%M-%S")
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    host = HostLoadSampler(1.0).start()
    rows: list[Row] = []
    head = f"speed benchmark{' (--quick: indicative only)' if args.quick else ''}, commit {commit()}, " \
           f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}"
    for section in args.only or list(SECTIONS):
        rows += measure(section, out, args.quick)
        if section == "cell" and not args.only:
            rows += matrix_row(args.results)
        # the table so far, after every section: a run cut off still leaves what it measured
        (out / "table.md").write_text(render(rows, f"{head} (partial: up to {section})", [f"runs in {out}"]) + "\n")
    load = host.stop()
    text = render(rows, f"{head}, {(time.time() - started) / 60:.1f} min", [describe_load(load), f"runs in {out}"])
    (out / "table.md").write_text(text + "\n")
    print("\n" + text, flush=True)


if __name__ == "__main__":
    main()
