"""``python -m resilience.bench.torture``: kill and corruption trials at random points; every recovery checked.

For each checkpointing strategy, ``--trials`` kill trials at a seeded random (rank, step, phase), alternating world
sizes 2 and 3; for the strategies that load from disk, also one corruption trial per kind of damage
(``fault=ckpt_damage``: a flipped byte, a truncated or deleted data file, deleted metadata, a garbled commit record)
of the newest checkpoint before a crash. Each trial is a real ``python -m resilience`` run. Printed per strategy:
trials, bit-exact recoveries (the final state equals the fault-free run's of the same world size), damaged
checkpoints loaded (must be 0), and what the trials left behind: processes, ``/dev/shm`` entries of the run,
temporary files (all must be 0).
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from injectors.base import PHASES
from injectors.ckpt_damage import HOW
from resilience import compat
from resilience.bench import lineup
from resilience.bench.experiment import run_afresh
from resilience.proc.child import processes_mentioning
from resilience.ckpt.shm_store import SHM_DIR, run_id
from resilience.record.events import read_events

WITHOUT_METADATA = ("nvrx_async", "dlrover_flash")  # (and their variants) one torch.save file per rank: no index
FROM_MEMORY = ("inmemory",)  # loads its own snapshots from memory, each with its own checks: no disk damage trial

STEPS, EVERY = 16, 4
TIMEOUT_S = 300


@dataclass
class Tally:
    trials: int = 0
    bit_exact: int = 0
    corrupt_loaded: int = 0
    leaked_processes: int = 0
    leaked_shm: int = 0
    leaked_tmp: int = 0
    failures: list[str] = field(default_factory=list)


def common(world: int) -> list[str]:
    return ["workload=gpt_tiny", f"steps={STEPS}", f"checkpoint.every={EVERY}", f"world_size={world}", "seed=0",
            "detector=[process_exit]", "timeouts.collective_s=10"]


def kill_point(rng: random.Random, world: int) -> list[str]:
    phase = rng.choice(PHASES)
    if phase == "during_checkpoint":
        step = EVERY * rng.randrange(1, STEPS // EVERY)
    else:
        step = rng.randrange(1, STEPS)
    return ["fault=kill", f"fault.rank={rng.randrange(world)}", f"fault.at_step={step}", f"fault.phase={phase}"]


def damage_point(rng: random.Random, world: int, how: str) -> list[str]:
    step = rng.randrange(EVERY + 1, STEPS)
    return ["fault=ckpt_damage", f"fault.how={how}", f"fault.rank={rng.randrange(world)}", f"fault.at_step={step}"]


def run(run_dir: Path, overrides: list[str]) -> dict | None:
    result, code = run_afresh(run_dir, overrides, timeout_s=TIMEOUT_S)
    return result if code == 0 else None


def leftovers(run_dir: Path) -> tuple[int, int, int]:
    """Processes, /dev/shm entries and temporary files the run left behind (after a short grace period)."""
    deadline = time.monotonic() + 5
    while processes_mentioning(str(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    shm = list(SHM_DIR.glob(f"*{run_id(run_dir)}*"))
    tmp = [p for p in run_dir.rglob("*") if ".tmp." in p.name]
    return len(processes_mentioning(str(run_dir))), len(shm), len(tmp)


def damaged_step_loaded(run_dir: Path) -> bool:
    """Whether any rank loaded the checkpoint a ``ckpt_damage`` fault had damaged."""
    events = read_events(run_dir)
    damaged = {e.get("damaged_step") for e in events if e["kind"] == "fault_injected"} - {None}
    return any(e["kind"] == "ckpt_loaded" and e.get("source") == "disk" and e["step"] in damaged for e in events)


def trial(tally: Tally, run_dir: Path, overrides: list[str], reference: str) -> None:
    result = run(run_dir, overrides)
    tally.trials += 1
    ok = result is not None and result["status"] == "ok" and result["final_state_sha256"] == reference
    tally.bit_exact += ok
    if not ok:
        tally.failures.append(f"{run_dir.name}: {' '.join(overrides)} -> "
                              f"{result['status'] if result else 'harness error'}")
    tally.corrupt_loaded += damaged_step_loaded(run_dir)
    procs, shm, tmp = leftovers(run_dir)
    tally.leaked_processes += procs
    tally.leaked_shm += shm
    tally.leaked_tmp += tmp
    shutil.rmtree(run_dir / "ckpt", ignore_errors=True)  # many trials: keep the events, not the checkpoints


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m resilience.bench.torture", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=20, help="kill trials per strategy (default 20)")
    ap.add_argument("--strategies", default=",".join(lineup.checkpointing()),
                    help="comma-separated strategy options (default: every option that writes checkpoints)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("results/torture"))
    args = ap.parse_args(argv)
    chosen = args.strategies.split(",")
    if (error := lineup.unknown_strategies(args.strategies)) or args.trials < 1:
        print(error or f"error: --trials={args.trials}: must be >= 1", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    references = {}
    for world in (2, 3):
        ref = run(args.out / f"reference_w{world}", ["strategy=sync", "fault=none", *common(world)])
        if ref is None or ref["status"] != "ok":
            print(f"error: the fault-free reference run (world size {world}) failed", file=sys.stderr)
            return 1
        references[world] = ref["final_state_sha256"]
    tallies = {}
    t0 = time.monotonic()
    for strategy in chosen:
        tally = tallies[strategy] = Tally()
        for i in range(args.trials):
            world = 2 + i % 2
            point = kill_point(rng, world)
            print(f"[{time.monotonic() - t0:6.0f} s] {strategy} kill {i + 1}/{args.trials} w{world}: "
                  f"{' '.join(point)}", flush=True)
            trial(tally, args.out / f"{strategy}_kill{i}", [f"strategy={strategy}", *point, *common(world)],
                  references[world])
        for how in HOW if strategy not in FROM_MEMORY else ():
            if how == "delete_metadata" and compat.options("strategy")[strategy].name in WITHOUT_METADATA:
                continue
            world = rng.choice((2, 3))
            point = damage_point(rng, world, how)
            print(f"[{time.monotonic() - t0:6.0f} s] {strategy} damage {how} w{world}: {' '.join(point)}", flush=True)
            trial(tally, args.out / f"{strategy}_{how}", [f"strategy={strategy}", *point, *common(world)],
                  references[world])
    print_table(tallies, time.monotonic() - t0)
    bad = any(t.bit_exact < t.trials or t.corrupt_loaded or t.leaked_processes or t.leaked_shm or t.leaked_tmp
              for t in tallies.values())
    return 1 if bad else 0


def print_table(tallies: dict[str, Tally], elapsed: float) -> None:
    print(f"\n{elapsed:.0f} s; steps={STEPS}, checkpoint.every={EVERY}, gpt_tiny, world sizes 2 and 3, "
          f"detector=[process_exit]")
    print("| strategy | trials | bit-exact | damaged checkpoint loaded | leaked processes | leaked shm | leaked tmp |")
    print("|---|---|---|---|---|---|---|")
    for name, t in tallies.items():
        print(f"| {name} | {t.trials} | {t.bit_exact} | {t.corrupt_loaded} | {t.leaked_processes} | "
              f"{t.leaked_shm} | {t.leaked_tmp} |")
    for name, t in tallies.items():
        for failure in t.failures:
            print(f"FAILED {name}: {failure}")


if __name__ == "__main__":
    sys.exit(main())
