"""``python -m resilience.bench.cell [--repeats N] [OVERRIDES...]``: where a matrix cell's wall time goes.

A cell is one ``python -m resilience`` command (as ``reports.cell`` starts it). Its phases come from the run's
own record, the moments this command saw (process started, process ended) and two file times:

================= ==========================================================================================
phase             from .. to
================= ==========================================================================================
supervisor start  process start .. ``launch`` event (interpreter, imports, Hydra compose, validation, config)
rank start        ``launch`` .. first ``run_start`` (rendezvous, rank interpreters, imports, group, model)
training          first ``run_start`` .. last ``run_end`` (steps; checkpoint stalls shown apart)
teardown          last ``run_end`` .. ``supervisor_end`` (ranks exit, the agent's exit barrier, samplers)
result            ``supervisor_end`` .. ``result.json`` written (metrics from the event log, fsync)
exit              ``result.json`` .. the process has ended (what the interpreter does after the work)
================= ==========================================================================================

The import cost inside the two start phases is measured apart, in the same run: a fresh interpreter importing
what the supervisor imports, and what a rank imports (its strategy's module included). The figure of issue 16
is the cell's wall time over its training time (goal <= 2x for gpt_tiny, 30 steps). ``breakdown`` returns the
figures (``resilience.bench.speed`` uses it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from resilience.proc import child
from resilience.record.events import read_events
from resilience.record.host_load import HostLoadSampler
from resilience.record.query import stalls, step_times

PHASES = ("supervisor start", "rank start", "training", "teardown", "result", "exit")
# What the supervisor has imported by ``launch``: the command, the roles and its strategy's module (config.resolve,
# build_roles), the supervisors (torch's elastic agent). The command imports the last three only once the
# configuration is valid, so they are named here, not left to ``resilience.__main__``'s own imports.
SUPERVISOR_IMPORTS = ("import resilience.__main__, resilience.roles, resilience.supervise.elastic, "
                      "resilience.supervise.replacing, resilience.strategies.{strategy}")
# What a rank imports before it trains: its modules, its strategy's, and what DDP's constructor and
# torch.use_deterministic_algorithms import on first use (torch._dynamo, torch._inductor.config).
HEAVY = ("torch", "torch.distributed.checkpoint", "torch._dynamo", "hydra")
RANK_IMPORTS = "import resilience.rank.main, resilience.strategies.{strategy}, torch._dynamo, torch._inductor.config"


def import_profile(statement: str, code: Path | None = None) -> dict[str, Any]:
    """A fresh interpreter runs ``statement`` under ``-X importtime``: the imports' total (s), and where the heavy
    packages were first imported, the cumulative time of each (name, s; a package's own imports included)."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", f"{statement}\nimport os; os._exit(0)"],
                          check=True, cwd=code, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    total, heavy = 0.0, {}
    for line in done.stderr.splitlines():  # "import time: self [us] | cumulative | name", nesting as indentation
        parts = line.split("|")
        if len(parts) != 3 or not parts[1].strip().isdigit():
            continue
        name, cumulative = parts[2].strip(), int(parts[1]) / 1e6
        if not parts[2][1:].startswith(" "):  # top level
            total += cumulative
        if name in HEAVY:
            heavy[name] = cumulative
    return {"total_s": total, "top": [(n, heavy[n]) for n in HEAVY if n in heavy]}


def phases(events: list[dict], started: float, ended: float, result_written: float) -> dict[str, float]:
    """The phases' durations (s) of one fault-free run, from its events and the three moments outside them."""
    def at(kind: str, pick=min) -> float:
        return pick(e["t_wall"] for e in events if e["kind"] == kind)
    launch, begin, finish, sup_end = at("launch"), at("run_start"), at("run_end", max), at("supervisor_end")
    return dict(zip(PHASES, (launch - started, begin - launch, finish - begin, sup_end - finish,
                             result_written - sup_end, ended - result_written)))


def inside_training(events: list[dict]) -> dict[str, float]:
    """Rank 0's step times and checkpoint stalls, each summed over the run (not ``result.json``'s medians)."""
    rank0 = [e for e in events if e["rank"] == 0]
    return {"steps_s": sum(step_times(rank0)), "ckpt_stall_total_s": sum(s.seconds for s in stalls(rank0))}


def pipeline_env(folder: Path) -> dict[str, str]:
    """The environment a pipeline cell runs in: the software environment captured once per pipeline run
    (``RB_ENVIRONMENT``, as the Snakefile sets it), not by every cell."""
    try:
        from resilience.record import environment
    except ImportError:  # a checkout from before the capture existed
        return dict(os.environ)
    path = folder / environment.ENVIRONMENT_FILE
    environment.write(path)
    return {**os.environ, environment.ENV_VAR: str(path.resolve())}


def run_cell(overrides: list[str], run_dir: Path, timeout_s: float = 600, code: Path | None = None,
             env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one cell as the pipeline does and return its phases, the figures inside training, and the ratio."""
    cmd = child.experiment_command(overrides, run_dir)
    started = time.time()
    done = child.run(cmd, timeout_s=timeout_s, cwd=code, env=env)
    ended = time.time()
    if done.returncode != 0:
        raise RuntimeError(f"cell failed (exit {done.returncode}): {done.stderr.strip()[-500:]}")
    result = json.loads((run_dir / "result.json").read_text())
    if result["status"] != "ok":
        raise RuntimeError(f"cell status {result['status']}: a fault-free cell is what this bench times")
    events = read_events(run_dir)
    out = {"phases": phases(events, started, ended, (run_dir / "result.json").stat().st_mtime),
           **inside_training(events), "wall_s": ended - started, "sha256": result["final_state_sha256"]}
    out["ratio"] = out["wall_s"] / out["phases"]["training"]
    return out


def breakdown(overrides: list[str], repeats: int = 3, root: Path | None = None,
              code: Path | None = None) -> dict[str, Any]:
    """The median of each figure over ``repeats`` cells, and the imports' profile (the quickest of ``repeats``);
    ``code``: the checkout whose ``resilience`` runs (another commit's worktree, for a before/after)."""
    return breakdowns(overrides, {"this": code}, repeats, root)["this"]


def breakdowns(overrides: list[str], codes: dict[str, Path | None], repeats: int = 3,
               root: Path | None = None) -> dict[str, dict[str, Any]]:
    """``breakdown`` of each checkout in ``codes`` (name: folder, None for this one), their cells interleaved
    (each repeat runs one cell of every checkout, in an order that rotates) so that they share the host's load:
    a before/after whose ratios mean something on a busy machine. The load is the whole run's, for all."""
    strategy = next((o.split("=", 1)[1] for o in overrides if o.startswith("strategy=")), "sync")
    host = HostLoadSampler(0.5).start()
    got = {name: {"runs": [], "supervisor": [], "rank": []} for name in codes}
    with tempfile.TemporaryDirectory(prefix="rb-cell-", dir=root) as tmp:
        env = pipeline_env(Path(tmp))
        names = list(codes)
        for i in range(repeats):
            for name in names[i % len(names):] + names[:i % len(names)]:
                code, mine = codes[name], got[name]  # each cell beside its import profiles: the same moment's load
                mine["supervisor"].append(import_profile(SUPERVISOR_IMPORTS.format(strategy=strategy), code))
                mine["rank"].append(import_profile(RANK_IMPORTS.format(strategy=strategy), code))
                mine["runs"].append(run_cell(overrides, Path(tmp) / f"{name}-cell{i}", code=code, env=env))
    load = host.stop()
    return {name: _summary(overrides, repeats, mine, load) for name, mine in got.items()}


def _summary(overrides: list[str], repeats: int, got: dict[str, list], load: dict[str, Any]) -> dict[str, Any]:
    runs = got["runs"]
    med = lambda get: statistics.median(get(r) for r in runs)  # noqa: E731
    return {
        "overrides": overrides, "repeats": repeats, "runs": runs,
        "phases": {p: med(lambda r, p=p: r["phases"][p]) for p in PHASES},
        "steps_s": med(lambda r: r["steps_s"]), "ckpt_stall_total_s": med(lambda r: r["ckpt_stall_total_s"]),
        "wall_s": med(lambda r: r["wall_s"]), "ratio": med(lambda r: r["ratio"]),
        "imports": {who: min(got[who], key=lambda g: g["total_s"]) for who in ("supervisor", "rank")}, "load": load,
    }


def describe_imports(profile: dict[str, Any]) -> str:
    return (f"{profile['total_s']:.2f} s (" + ", ".join(f"{name} {s:.2f}" for name, s in profile["top"])
            + "; -X importtime, a fresh interpreter beside the cell)")


def describe_load(load: dict[str, Any]) -> str:
    """One line: the host's load while the figures were taken (``HostLoadSampler.stop``'s figures)."""
    other = load.get("other_cpu_frac")
    return (f"host load during the run: load1 max {load.get('load_max')}, other processes' CPU "
            f"{'n/a' if other is None else f'{other:.0%}'} of {load.get('cpus')} cores, "
            f"CPU pressure max {load.get('cpu_pressure_max')}%")


def table(b: dict[str, Any]) -> str:
    """The breakdown as aligned text: each phase in seconds and as a share of the cell."""
    wall = b["wall_s"]
    lines = [f"cell: python -m resilience {' '.join(b['overrides'])}  (median of {b['repeats']})",
             f"{'phase':<18}{'s':>8}{'share':>8}"]
    notes = {"supervisor start": f"imports {describe_imports(b['imports']['supervisor'])}",
             "rank start": f"a rank's imports {describe_imports(b['imports']['rank'])}",
             "training": f"steps {b['steps_s']:.2f} s, checkpoint stalls {b['ckpt_stall_total_s']:.2f} s (rank 0)"}
    for p in PHASES:
        s = b["phases"][p]
        lines.append(f"{p:<18}{s:>8.2f}{s / wall:>8.0%}   {notes.get(p, '')}".rstrip())
    lines.append(f"{'cell wall':<18}{wall:>8.2f}")
    lines.append(f"cell wall / training: {b['ratio']:.2f}x (goal <= 2x); per run: "
                 + ", ".join(f"{r['ratio']:.2f}x" for r in b["runs"]))
    lines.append(describe_load(b["load"]))
    return "\n".join(lines)


def side_by_side(before: dict[str, Any], after: dict[str, Any]) -> str:
    """Each phase's median before and after, and after / before: the ratios of one run, under one load."""
    lines = [f"{'phase':<18}{'before s':>10}{'after s':>10}{'after/before':>14}"]
    rows = [(p, before["phases"][p], after["phases"][p]) for p in PHASES]
    rows += [("cell wall", before["wall_s"], after["wall_s"]),
             ("supervisor imports", before["imports"]["supervisor"]["total_s"],
              after["imports"]["supervisor"]["total_s"]),
             ("rank imports", before["imports"]["rank"]["total_s"], after["imports"]["rank"]["total_s"])]
    for name, b, a in rows:
        lines.append(f"{name:<18}{b:>10.2f}{a:>10.2f}{a / b if b else float('nan'):>13.2f}x")
    lines.append(f"cell wall / training: before {before['ratio']:.2f}x, after {after['ratio']:.2f}x (goal <= 2x)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m resilience.bench.cell", description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="cells run; each figure is the median (default 3)")
    ap.add_argument("--code", type=Path, help="run the cells with the checkout in CODE (e.g. a git worktree of an "
                    "earlier commit: the figures before a change, beside this run's)")
    ap.add_argument("--baseline", type=Path, help="also run the checkout in BASELINE (a git worktree of the commit "
                    "before a change), its cells interleaved with this checkout's: before and after in one run")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of the cell (default: the default experiment)")
    args = ap.parse_args(argv)
    if args.baseline is None:
        print(table(breakdown(args.overrides, args.repeats, code=args.code)))
        return
    both = breakdowns(args.overrides, {"before": args.baseline, "after": args.code}, args.repeats)
    for name, folder in (("before", args.baseline), ("after", args.code or Path.cwd())):
        print(f"--- {name}: {folder}\n{table(both[name])}\n")
    print(side_by_side(both["before"], both["after"]))


if __name__ == "__main__":
    main()
