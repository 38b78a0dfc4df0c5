"""``python -m resilience.bench.compare``: the checkpoint-strategy comparison, measured end to end.

For each workload (default: ``gpt_tiny`` and ``dlrm_emb``; ``gpt_small`` on request; 2 ranks) and each strategy (default: sync, async,
dcp_async, inmemory, replica, and replica_spare: replica with one warm spare rank; any ``conf/strategy/<name>.yaml``
can be named), it runs a fault-free experiment and one in which rank 1 is SIGKILLed *during* a checkpoint
(``fault.phase=during_checkpoint``; before the forward pass of the same step for a strategy that never
checkpoints), then prints one table row per (workload, strategy):

stall (training-visible, median), durable (checkpoint begin -> committed), size, write bandwidth
(bytes / durable time) and its share of the probed disk write limit (``resilience.bench.probe``), step time, where the
recovery loaded from (disk, own or peer memory, a live replica), the bytes it moved and the time the strategy took
to load them, the total recovery time (fault to training again), lost steps, whether the survivors were restarted,
and whether both runs ended bit-identical to the workload's fault-free reference (the first strategy's fault-free
run). Below the table, the targets of the strategy issue, each with its figures and MET or MISSED. Every run uses
the same detector set (``--detectors``, default ``process_exit``), so that only the strategy differs.

Outputs go to ``--out`` (default ``results/compare/<timestamp>``): the run directories, ``table.md`` and
``runs.csv`` (one row per run, columns as ``resilience.projection`` reads them). ~10 minutes on 2 idle CPU cores.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resilience import compat
from resilience.bench import lineup
from resilience.proc import child
from resilience.bench.probe import load_limits

ROOT = Path(__file__).resolve().parents[2]  # the repository: resilience/bench/compare.py


@dataclass(frozen=True)
class Plan:
    """How one workload is run: long enough between checkpoints for a background persist to finish."""

    steps: int
    every: int
    fault_step: int  # a checkpoint step: the kill fires while that checkpoint is being written
    timeout_s: float


PLANS = {
    "gpt_tiny": Plan(steps=30, every=5, fault_step=15, timeout_s=240),
    "gpt_small": Plan(steps=30, every=5, fault_step=15, timeout_s=480),
    "dlrm_emb": Plan(steps=350, every=150, fault_step=300, timeout_s=480),
}


def run_one(run_dir: Path, workload: str, strategy: str, plan: Plan, kill: bool,
            detectors: str = "process_exit", keep_checkpoints: bool = False, resume: bool = False) -> dict[str, Any]:
    """One experiment as a subprocess (own process group, killed on timeout); its result."""
    strategy, extra = lineup.with_a_spare().get(strategy, (strategy, []))  # a row with extra settings
    phase = "during_checkpoint" if compat.options("strategy")[strategy].caps.saves else "before_forward"
    fault = (["fault=kill", "fault.rank=1", f"fault.at_step={plan.fault_step}", f"fault.phase={phase}"]
             if kill else ["fault=none"])
    overrides = [f"workload={workload}", f"strategy={strategy}", *extra, *fault, f"steps={plan.steps}",
                 f"checkpoint.every={plan.every}", "world_size=2", "seed=0", f"detector=[{detectors}]"]
    if resume and (run_dir / "result.json").exists():  # measured before: re-score its events, do not rerun
        from resilience.record.result import write_result

        print(f"(kept) {run_dir.name}", flush=True)
        return {**write_result(run_dir), "run_dir": str(run_dir)}
    print(f"$ python -m resilience {' '.join(overrides)}", flush=True)
    shutil.rmtree(run_dir, ignore_errors=True)  # a run cut short: start it again
    done = child.run(child.experiment_command(overrides, run_dir), timeout_s=plan.timeout_s, cwd=ROOT,
                     merge_stderr=True)
    if done.timed_out:
        return {"status": "timeout", "run_dir": str(run_dir)}
    result_file = run_dir / "result.json"
    if done.returncode != 0 or not result_file.exists():
        print(done.stdout[-2000:], flush=True)
        return {"status": "error", "run_dir": str(run_dir)}
    result = json.loads(result_file.read_text())
    if not keep_checkpoints:  # 6 dlrm_emb runs would otherwise leave ~13 GB of checkpoints behind
        shutil.rmtree(run_dir / "ckpt", ignore_errors=True)
    result["run_dir"] = str(run_dir)
    print(f"  -> {result['status']}, stall {_f(result.get('ckpt_stall_s'))} s, durable "
          f"{_f(result.get('ckpt_durable_s'))} s, recovery {_f(result.get('recovery_time_s'))} s", flush=True)
    return result


def row(workload: str, strategy: str, free: dict, killed: dict, ref_hash: str | None, limits: dict) -> dict:
    """The table row of one (workload, strategy) from its fault-free and its killed run."""
    nbytes, durable = free.get("ckpt_bytes"), free.get("ckpt_durable_s")
    bw = nbytes / durable / 1e9 if nbytes and durable else None
    same = lambda r: None if r.get("status") != "ok" else r.get("final_state_sha256") == ref_hash  # noqa: E731
    breakdown = killed.get("recovery_breakdown_s") or {}
    return {"workload": workload, "strategy": strategy, "stall_s": free.get("ckpt_stall_s"), "durable_s": durable,
            "ckpt_MB": nbytes / 1e6 if nbytes else None, "write_GBps": bw,
            "write_pct_of_disk": 100 * bw / limits["write_GBps"] if bw else None,
            "step_s": free.get("step_time_s"),
            "host_MB": free["host_memory_peak_bytes"] / 1e6 if free.get("host_memory_peak_bytes") else None,
            "recovery_source": killed.get("recovery_source"),
            "moved_MB": (killed.get("recovery_bytes") or 0) / 1e6 if killed.get("recovered") else None,
            "load_s": killed.get("recovery_load_s"), "restart_s": breakdown.get("restart"),
            "recovery_s": killed.get("recovery_time_s"), "lost_steps": killed.get("lost_steps"),
            "survivors_restarted": killed.get("survivors_restarted"),
            "bit_exact_free": same(free), "bit_exact_killed": same(killed)}


def median_result(results: list[dict]) -> dict:
    """One result standing for repeats of a run: the median of every number, the first run's other fields, and
    ``final_state_sha256`` only where every repeat ended in the same state (else None: not bit-exact)."""
    import statistics

    ok = [r for r in results if r.get("status") == "ok"] or results[:1]
    merged = dict(ok[0])
    for key, value in ok[0].items():
        values = [r.get(key) for r in ok]
        if isinstance(value, (int, float)) and not isinstance(value, bool) and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            merged[key] = statistics.median(values)
    hashes = {r.get("final_state_sha256") for r in results}
    merged["final_state_sha256"] = hashes.pop() if len(hashes) == 1 else None
    if len(ok) < len(results):
        merged["status"] = "error"
    return merged


def _f(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


COLUMNS = [("workload", "workload"), ("strategy", "strategy"), ("stall_s", "stall s"), ("durable_s", "durable s"),
           ("ckpt_MB", "ckpt MB"), ("write_GBps", "write GB/s"), ("write_pct_of_disk", "% disk"),
           ("step_s", "step s"), ("host_MB", "host MB"), ("recovery_source", "recovered from"), ("moved_MB", "moved MB"),
           ("load_s", "load s"),
           ("restart_s", "restart s"), ("recovery_s", "recovery s"), ("lost_steps", "lost steps"),
           ("survivors_restarted", "survivors restarted"), ("bit_exact", "bit-exact free/killed")]


def table(rows: list[dict]) -> str:
    """A Markdown table of ``rows``."""
    lines = ["| " + " | ".join(h for _, h in COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    for r in rows:
        cells = []
        for key, _ in COLUMNS:
            if key == "bit_exact":
                cells.append(f"{_f(r['bit_exact_free'])}/{_f(r['bit_exact_killed'])}")
            elif key == "survivors_restarted":  # neither answer is a failure: say it plainly
                cells.append({True: "yes", False: "no", None: "-"}[r[key]])
            else:
                cells.append(_f(r[key], 1 if key in ("ckpt_MB", "moved_MB", "write_pct_of_disk", "host_MB") else 3))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def targets(rows: list[dict], limits: dict) -> list[str]:
    """The benchmark's targets on dlrm_emb (else the first workload), each with its measured figures and MET/MISSED
    (not test assertions)."""
    workload = "dlrm_emb" if any(r["workload"] == "dlrm_emb" for r in rows) else rows[0]["workload"] if rows else ""
    by = {r["strategy"]: r for r in rows if r["workload"] == workload}
    out: list[str] = []

    def check(name: str, ok: bool | None, detail: str) -> None:
        out.append(f"[{'MET' if ok else 'MISSED' if ok is not None else 'n/a'}] {name}: {detail}")

    sync, asy, dcpa = by.get("sync", {}), by.get("async", {}), by.get("dcp_async", {})
    if sync.get("stall_s") and asy.get("stall_s") is not None:
        pct = 100 * asy["stall_s"] / sync["stall_s"]
        check("async stall <= 5% of sync save time", pct <= 5,
              f"{asy['stall_s']:.3f} s vs {sync['stall_s']:.3f} s = {pct:.1f}%")
    if asy.get("stall_s") is not None and dcpa.get("stall_s") is not None:
        check("async stall <= dcp_async stall", asy["stall_s"] <= dcpa["stall_s"],
              f"{asy['stall_s']:.3f} s vs {dcpa['stall_s']:.3f} s")
    if sync.get("write_pct_of_disk") is not None:
        check("sync durable write bandwidth >= 70% of probed disk write", sync["write_pct_of_disk"] >= 70,
              f"{sync['write_GBps']:.2f} GB/s vs {limits['write_GBps']:.2f} GB/s = {sync['write_pct_of_disk']:.0f}%")
    family = compat.options("strategy")["async"].caps.family  # the libraries async is compared with: its family's
    libs = {n: by[n] for n in lineup.libraries() if compat.options("strategy")[n].caps.family == family
            and by.get(n, {}).get("stall_s") is not None}
    if asy.get("stall_s") is not None and libs:
        best = min(libs, key=lambda n: libs[n]["stall_s"])
        check("async stall <= the best library's async stall", asy["stall_s"] <= libs[best]["stall_s"],
              f"{asy['stall_s']:.3f} s vs {best} {libs[best]['stall_s']:.3f} s = "
              f"{asy['stall_s'] / libs[best]['stall_s']:.2f}x")
    mem, dlrover = by.get("inmemory", {}), by.get("dlrover_flash", {})
    if mem.get("recovery_s") is not None and dlrover.get("recovery_s") is not None:
        check("inmemory recovery <= DLRover's", mem["recovery_s"] <= dlrover["recovery_s"],
              f"{mem['recovery_s']:.3f} s ({mem['recovery_source']}, {mem['lost_steps']} lost steps) vs "
              f"{dlrover['recovery_s']:.3f} s ({dlrover['recovery_source']}, {dlrover['lost_steps']} lost steps)")
    if sync.get("load_s") and mem.get("load_s"):
        check("inmemory recovery load >= 5x faster than sync disk load", sync["load_s"] / mem["load_s"] >= 5,
              f"{mem['load_s']:.3f} s ({mem['recovery_source']}) vs {sync['load_s']:.3f} s = "
              f"{sync['load_s'] / mem['load_s']:.1f}x")
    for name in ("replica", "replica_spare"):
        rep = by.get(name, {})
        if rep.get("recovery_s") is None or not rep.get("moved_MB"):
            continue
        check(f"{name} survivors not restarted", rep["survivors_restarted"] is False,
              f"survivors restarted: {'no' if rep['survivors_restarted'] is False else 'yes'}")
        transfer = rep["moved_MB"] / 1e3 / limits["p2p_GBps"]
        bound = 1.5 * (limits["rank_start_s"] + transfer)
        check(f"{name} recovery <= 1.5 x (rank start + state transfer)", rep["recovery_s"] <= bound,
              f"{rep['recovery_s']:.2f} s vs 1.5 x ({limits['rank_start_s']:.2f} s + {rep['moved_MB']:.0f} MB at "
              f"{limits['p2p_GBps']:.2f} GB/s = {transfer:.2f} s) = {bound:.2f} s; of it restart "
              f"{_f(rep['restart_s'], 2)} s, load {_f(rep['load_s'], 2)} s")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m resilience.bench.compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", nargs="+", default=["gpt_tiny", "dlrm_emb"], choices=sorted(PLANS))
    # the rows, from conf/strategy and what each declares (resilience.bench.lineup): ours and torch's DCP, the
    # default strategy (the reference) first; --peers: the libraries beside them (docs/peers.md)
    own, spares = lineup.own(), lineup.with_a_spare()
    peers = [s for s in lineup.libraries() if s not in own]
    ap.add_argument("--strategies", nargs="+", default=list(own),
                    help="names of conf/strategy/*.yaml; the first one's fault-free run is the reference")
    ap.add_argument("--peers", action="store_true", help=f"add the libraries: {', '.join(peers)}")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each (strategy, fault-free/killed); the table "
                    "shows medians (default 1)")
    ap.add_argument("--out", type=Path, default=None, help="output directory (default results/compare/<timestamp>)")
    ap.add_argument("--detectors", default="process_exit",
                    help="comma-separated detector set of every run (default process_exit: a kill is detected by "
                         "the exit, and no detector adds per-step work that would blur the strategies' costs)")
    ap.add_argument("--keep-checkpoints", action="store_true", help="keep each run's ckpt/ (deleted by default)")
    ap.add_argument("--resume", action="store_true", help="with --out of an earlier comparison: keep its finished "
                    "runs (re-scored from their events) and run only the missing ones")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats}: must be at least 1")
    if args.peers:
        args.strategies += [p for p in peers if p not in args.strategies]
    for s in args.strategies:
        if s not in spares and not (ROOT / "conf" / "strategy" / f"{s}.yaml").is_file():
            ap.error(f"--strategies {s}: no conf/strategy/{s}.yaml (or one of {', '.join(spares)})")
    out = (args.out or ROOT / "results" / "compare" / time.strftime("%Y-%m-%d_%H-%M-%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    limits = load_limits(out)
    t0 = time.monotonic()
    rows, runs = [], []
    for workload in args.workloads:
        plan, ref_hash = PLANS[workload], None
        for strategy in args.strategies:
            measured: dict[bool, list[dict]] = {False: [], True: []}
            for rep in range(args.repeats):
                for kill in (False, True):
                    name = f"{workload}-{strategy}-{'kill' if kill else 'none'}" + (f"-r{rep}" if rep else "")
                    measured[kill].append(run_one(out / name, workload, strategy, plan, kill, args.detectors,
                                                  args.keep_checkpoints, args.resume))
            free, killed = median_result(measured[False]), median_result(measured[True])
            ref_hash = ref_hash or free.get("final_state_sha256")
            runs += measured[False] + measured[True]
            rows.append(row(workload, strategy, free, killed, ref_hash, limits))
    report = "\n".join([table(rows), "", f"targets (medians of {args.repeats} run(s) each):",
                        *targets(rows, limits), "",
                        f"disk write limit {limits['write_GBps']:.2f} GB/s, cold read {limits['read_GBps']:.2f} GB/s, "
                        f"memcpy {limits['memcpy_GBps']:.1f} GB/s, rank start {limits['rank_start_s']:.2f} s, "
                        f"rank-to-rank {limits['p2p_GBps']:.2f} GB/s "
                        f"(python -m resilience.bench.probe); {len(runs)} runs in {time.monotonic() - t0:.0f} s"])
    (out / "table.md").write_text(report + "\n")
    _write_csv(out / "runs.csv", runs)
    print("\n" + report + f"\n\nwritten to {out}/table.md and runs.csv", flush=True)


def _write_csv(path: Path, runs: list[dict]) -> None:
    import pandas as pd  # only here: the experiment path does not need pandas

    pd.json_normalize(runs).to_csv(path, index=False)


if __name__ == "__main__":
    main()
