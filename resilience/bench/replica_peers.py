"""``python -m resilience.bench.replica_peers``: recovery from a live replica, ours against torchft's, against a floor.

For each workload (``gpt_small``: 10.9M parameters, ~131 MB of model and AdamW state; ``dlrm_emb``: ~1.1 GB) and each
way (our ``replica``, whose survivors wait for the replacement; the same with a warm spare, ``supervisor.spares=1``;
``replica_torchft``, whose survivor trains on at reduced width), rank 1 of 2 is SIGKILLed after step 13 of 30 and
``--repeats`` runs are made. Every run uses only the ``process_exit`` detector, so the runs differ in the recovery
alone. Printed per row: the recovery time (fault -> the replacement past the fault's step, i.e. healed), the
replacement's start (the supervisor's restart -> its ``run_start``), the heal and its bytes, and the ratio of the
recovery to a floor; each as median [min, max].

The floor is what no replica recovery on this machine can beat without a process ready in advance: starting a rank
process (the probe's ``rank_start_s``: interpreter, torch, a gloo group) plus moving the state once at the probe's
rank-to-rank bandwidth (``p2p_GBps``: gloo send/recv). A warm spare has paid the start before the fault, so its ratio
may fall below 1. The probe's figures come from its cache when this host was probed (``python -m
resilience.bench.probe``), else only its rank measurement runs (a few seconds; the disk is not probed).

``--transfer`` measures the heal's transfer alone, in two processes on this host: a rank that has trained one
step sends its state to a fresh one (``reconcile``, as a replacement heals), once with the plain transfer
(``resilience.ckpt.transfer``: tensor after tensor) and once with the pipelined one that ``replica`` uses
(``resilience.ckpt.replica_transfer``), and, in the same processes just before, the same number of bytes as
one flat, already-mapped buffer (the probe's way: the bandwidth floor); printed side by side with their ratios. It says whether a heal is limited by the transfer or by what surrounds it.

Duration on the project's 2-core VM under another engineer's load (load average ~5), measured: ~70 s per gpt_small
run, 15 s (ours) to 52 s (torchft's slow 1.1 GB heal) per dlrm_emb run; the default 18 runs: ~15-20 min.
``--workloads gpt_small --repeats 1`` took 3.5 min.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hydra.utils import instantiate
from omegaconf import OmegaConf

from resilience.bench import probe
from resilience.bench.experiment import run_experiment
from resilience.bench.hang_peers import table
from resilience.ckpt import transfer as plain
from resilience.ckpt import replica_transfer as pipelined
from resilience.state.train import TrainState

CONF = Path(__file__).resolve().parents[2] / "conf"

WORKLOADS = ("gpt_small", "dlrm_emb")
WAYS = {"replica": ["strategy=replica"],
        "replica + spare": ["strategy=replica", "supervisor.spares=1"],
        "replica_torchft": ["strategy=replica_torchft"]}
BASE = ["world_size=2", "steps=30", "seed=0", "fault=kill", "fault.rank=1", "fault.at_step=13",
        "detector=[process_exit]"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="default results/replica_peers/<timestamp>")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument("--ways", nargs="+", default=list(WAYS), choices=list(WAYS))
    ap.add_argument("--transfer", action="store_true", help="measure the heal's transfer alone (see above)")
    args = ap.parse_args(argv)
    if args.transfer:
        return transfer_rows(args.workloads)
    root = args.out or Path("results/replica_peers") / time.strftime("%Y-%m-%d_%H-%M-%S")
    limits = floor_limits(root)
    rows = []
    for workload in args.workloads:
        for way in args.ways:
            runs = [run_experiment(root / f"{workload}-{way.replace(' + ', '_')}-r{i}",
                                   [f"workload={workload}", *BASE, *WAYS[way]], echo=True, timeout_s=900)
                    for i in range(args.repeats)]
            rows.append(row(workload, way, runs, limits))
    print(f"\nkill of rank 1 of 2 at step 13 of 30, detector process_exit, {args.repeats} run(s) each, median "
          f"[min, max]; runs in {root}")
    print(f"floor = rank start {limits['rank_start_s']:.2f} s + state bytes / {limits['p2p_GBps']:.2f} GB/s "
          f"(probe, {limits['source']})\n")
    print(table(rows))


def floor_limits(root: Path) -> dict:
    """The probe's rank start and rank-to-rank bandwidth: cached for this host, else measured now (ranks only)."""
    cached = probe.cached_limits(root)
    if cached and {"rank_start_s", "p2p_GBps"} <= set(cached):
        return {"rank_start_s": cached["rank_start_s"], "p2p_GBps": cached["p2p_GBps"], "source": "cached"}
    return {**probe.measure_ranks(), "source": "measured now"}


def floor_s(nbytes: int | None, limits: dict) -> float | None:
    """Start a rank process, then move ``nbytes`` once at the probed gloo bandwidth."""
    return None if nbytes is None else limits["rank_start_s"] + nbytes / (limits["p2p_GBps"] * 1e9)


def spread(values: list[float], fmt: str = "{:.2f}") -> str:
    if not values:
        return "-"
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}, {fmt.format(max(values))}]"


def row(workload: str, way: str, runs: list[dict], limits: dict) -> dict:
    def got(key: str) -> list[float]:
        return [r[key] for r in runs if r.get(key) is not None]

    ratios = [r["recovery_time_s"] / f for r in runs
              if r.get("recovery_time_s") is not None and (f := floor_s(r.get("heal_bytes"), limits))]
    floors = [f for r in runs if (f := floor_s(r.get("heal_bytes"), limits)) is not None]
    consistent = sum(r.get("replicas_consistent") is True for r in runs)
    by_design = sum(r.get("bit_exact") == "not by design" for r in runs)
    return {"workload": workload, "strategy": way, "ok": f"{sum(r['status'] == 'ok' for r in runs)}/{len(runs)}",
            "recovery s": spread(got("recovery_time_s")), "replacement start s": spread(got("replacement_start_s")),
            "heal s": spread(got("heal_s")), "heal transfer s": spread(got("heal_transfer_s")),
            "heal MB": spread([b / 1e6 for b in got("heal_bytes")], "{:.0f}"),
            "survivors' stall s": spread(got("survivors_stall_s")), "reduced-width steps":
            spread(got("reduced_width_steps"), "{:.0f}"), "floor s": spread(floors),
            "recovery / floor": spread(ratios), "consistent": f"{consistent}/{len(runs)}",
            "not bit-exact by design": f"{by_design}/{len(runs)}"}


def _transfer_rank(rank: int, store: str, workload: str, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    wl = instantiate(OmegaConf.load(CONF / "workload" / f"{workload}.yaml"), seed=0)
    model = wl.build_model()
    state = TrainState(model, wl.build_optimizer(model))
    if rank == 0:  # the survivor: one step, so that the optimizer holds its state
        wl.loss(model, wl.batch(0, 0, torch.device("cpu"))).backward()
        state.optimizer.step()
        state.optimizer.zero_grad(set_to_none=True)
    size = torch.tensor([sum(t.numel() * t.element_size() for t in [*model.parameters(),
                         *(v for s in state.optimizer.state.values() for v in s.values() if torch.is_tensor(v))])])
    dist.broadcast(size, 0)
    buf = torch.ones(int(size.item()), dtype=torch.uint8)  # mapped on both sides: the floor
    dist.barrier()
    t0 = time.perf_counter()
    dist.send(buf, 1) if rank == 0 else dist.recv(buf, 0)
    raw_s = time.perf_counter() - t0
    del buf
    row = {"raw_s": raw_s}
    for way, module in (("plain", plain), ("pipelined", pipelined)):
        if rank == 1:  # a fresh replacement each time: nothing received in place that a real one would allocate
            model = wl.build_model()
            state = TrainState(model, wl.build_optimizer(model))
        dist.barrier()
        done = module.reconcile(state, 1 if rank == 0 else None, torch.device("cpu"))
        row.update({"bytes": done.nbytes, way: done.transfer_s})
    out.put((rank, row))
    dist.destroy_process_group()


def transfer_rows(workloads: list[str]) -> None:
    """The heal's transfer against one flat send of as many bytes, per workload, in the same two processes."""
    print(f"heal transfer (reconcile, rank 0 -> a fresh rank 1) against one flat send of the same bytes; load "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    ctx = mp.get_context("spawn")
    for workload in workloads:
        out = ctx.Queue()
        with tempfile.TemporaryDirectory() as tmp:
            procs = [ctx.Process(target=_transfer_rank, args=(r, os.path.join(tmp, "store"), workload, out))
                     for r in range(2)]
            for p in procs:
                p.start()
            try:
                got = dict(out.get(timeout=600) for _ in procs)
            finally:
                for p in procs:
                    p.join(timeout=60)
                    if p.is_alive():
                        p.kill()
        r = got[1]  # the receiver's view
        print(f"{workload}: {r['bytes'] / 1e6:.0f} MB; flat send {r['raw_s']:.3f} s "
              f"({r['bytes'] / r['raw_s'] / 1e9:.2f} GB/s); " + "; ".join(
                  f"{way} heal {r[way]:.3f} s ({r['bytes'] / r[way] / 1e9:.2f} GB/s, {r[way] / r['raw_s']:.2f}x flat)"
                  for way in ("plain", "pipelined")), flush=True)


if __name__ == "__main__":
    main()
