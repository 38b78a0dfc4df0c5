"""``python -m resilience.bench.sync_write``: sync's durable write bandwidth against the probed disk, in one run.

Two gloo ranks hold a workload's state (``dlrm_emb``: 1.13 GB per replica; each rank writes its half) and save it
the way ``sync`` does (``SyncCheckpoint._save``: DCP with the checksum in the write path, every file fsynced, rank 0's
atomic commit), timed from the start of the save until the commit is durable on every rank. Each round interleaves,
on the same disk: a probe sample as ``resilience.bench.probe`` takes it (1 GiB, one stream, fsync), a probe sample
split over as many streams as the save writes files at once, the writer as it was before (one file per rank, the
checksum serial with each write), two files per rank with the checksum in line, and the writer as it is. A shared virtual disk's speed moves by 2-4x within minutes,
so each ratio is taken between neighbours in one round and the median over rounds is reported.

``measure(...)`` returns the figures (for ``resilience.bench.speed``); ``main`` prints them as a table.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CONF = Path(__file__).resolve().parents[2] / "conf"
# one file per rank and the checksum in line (before issue 16); two files per rank, checksum in line; the writer now
WRITERS = ("before", "2files", "now")


def _writer_factory(name: str):
    """A ``HookedWriter`` factory for ``SyncCheckpoint._save``: the harness's, or the one before issue 16's."""
    from resilience.ckpt import dcp_files
    from resilience.ckpt.dcp_files import ChecksumFileSystem

    real = dcp_files.HookedWriter
    if name == "now":
        return real

    def inline(path, hook, step, fs=None):
        writer = real(path, hook, step, fs, threads=1 if name == "before" else dcp_files.WRITE_THREADS)
        writer.fs = ChecksumFileSystem(fs, parallel=False)
        return writer
    return inline


def _rank(rank: int, port: int, out: str, workload: str, rounds: int, size_mb: int, results) -> None:
    from hydra.utils import instantiate
    from omegaconf import OmegaConf
    from torch.nn.parallel import DistributedDataParallel as DDP

    from resilience.bench.probe import write_sample
    from resilience.record.events import EventLog
    from resilience.runtime.rank import RankRuntime
    from resilience.state.train import TrainState
    from resilience.ckpt import dcp_files
    from resilience.strategies import sync

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    wl = instantiate(OmegaConf.load(CONF / "workload" / f"{workload}.yaml"), seed=0)
    model = DDP(wl.build_model())
    state = TrainState(model, wl.build_optimizer(model))
    state.state_dict()  # materialise the optimizer's state before anything is timed
    rt = RankRuntime(rank=rank, world_size=2, device=torch.device("cpu"), run_dir=Path(out),
                     ckpt_dir=Path(out) / "ckpt", events=EventLog(Path(out), rank, 0))
    strategy = sync.SyncCheckpoint(every=1, keep=1)
    strategy.attach(rt)
    streams = 2 * dcp_files.WRITE_THREADS
    step = 0
    for i in range(rounds):
        for what in ("probe_1", f"probe_{streams}", *WRITERS):
            dist.barrier()
            if what.startswith("probe"):
                if rank == 0:
                    results.put((i, what, write_sample(Path(out), size_mb, int(what.split("_")[1])), 0))
                continue
            step += 1
            dcp_files.HookedWriter, real = _writer_factory(what), dcp_files.HookedWriter
            try:
                t0 = time.perf_counter()
                strategy._save(step, state)
                dist.barrier()  # durable on every rank, committed by rank 0
                seconds = time.perf_counter() - t0
            finally:
                dcp_files.HookedWriter = real
            if rank == 0:
                nbytes = strategy.dirs.size(strategy.dirs.newest_committed())
                results.put((i, what, nbytes / 1e9 / seconds, nbytes))
    rt.events.close()
    dist.destroy_process_group()


def measure(workload: str = "dlrm_emb", rounds: int = 3, out_dir: Path = Path("results"),
            size_mb: int = 1024) -> dict[str, Any]:
    """Run the interleaved rounds; return every sample and the medians of the per-round ratios.

    Keys: ``rounds`` (list of {what: GB/s}), ``ckpt_bytes``, ``GBps`` (median per what), ``ratio_now_probe1``,
    ``ratio_before_probe1``, ``ratio_2files_probe1``, ``ratio_now_probeN`` (medians of the per-round ratios), ``streams``, ``loadavg``."""
    from resilience.ckpt.dcp_files import WRITE_THREADS

    out_dir.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    streams = 2 * WRITE_THREADS
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(dir=out_dir, prefix="sync_bench-") as out:
        mp.start_processes(_rank, args=(port, out, workload, rounds, size_mb, results), nprocs=2,
                           start_method="spawn")
        samples = [results.get(timeout=10) for _ in range(rounds * (2 + len(WRITERS)))]
    per_round: list[dict[str, float]] = [{} for _ in range(rounds)]
    nbytes = 0
    for i, what, gbps, n in samples:
        per_round[i][what] = gbps
        nbytes = n or nbytes
    probe_n = f"probe_{streams}"

    def ratio(a: str, b: str) -> float:
        return statistics.median(r[a] / r[b] for r in per_round)

    return {"workload": workload, "ckpt_bytes": nbytes, "streams": streams, "rounds": per_round,
            "GBps": {k: statistics.median(r[k] for r in per_round) for k in per_round[0]},
            "ratio_now_probe1": ratio("now", "probe_1"), "ratio_before_probe1": ratio("before", "probe_1"),
            "ratio_2files_probe1": ratio("2files", "probe_1"),
            "ratio_now_probeN": ratio("now", probe_n), "loadavg": [load0, os.getloadavg()]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m resilience.bench.sync_write", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path("results"), help="where to write (default: results)")
    ap.add_argument("--workload", default="dlrm_emb", help="a conf/workload option (default dlrm_emb)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    args = ap.parse_args(argv)
    if args.rounds < 1 or not (CONF / "workload" / f"{args.workload}.yaml").exists():
        ap.error(f"--workload={args.workload} / --rounds={args.rounds}: an option of conf/workload, rounds >= 1")
    r = measure(args.workload, args.rounds, args.dir)
    cols = list(r["GBps"])
    print(f"{r['workload']}: checkpoint {r['ckpt_bytes'] / 1e9:.2f} GB; GB/s per round (probe_N: N streams at once)")
    print("| round | " + " | ".join(cols) + " | now / probe_1 | before / probe_1 | 2files / probe_1 | now / probe_"
          f"{r['streams']} |\n|" + "---|" * (len(cols) + 5))
    probe_n = f"probe_{r['streams']}"
    for i, row in enumerate(r["rounds"]):
        print(f"| {i} | " + " | ".join(f"{row[c]:.2f}" for c in cols) + f" | {row['now'] / row['probe_1']:.0%} | "
              f"{row['before'] / row['probe_1']:.0%} | {row['2files'] / row['probe_1']:.0%} | "
              f"{row['now'] / row[probe_n]:.0%} |")
    print("| median | " + " | ".join(f"{r['GBps'][c]:.2f}" for c in cols) + f" | {r['ratio_now_probe1']:.0%} | "
          f"{r['ratio_before_probe1']:.0%} | {r['ratio_2files_probe1']:.0%} | {r['ratio_now_probeN']:.0%} |")
    print("load average (1, 5, 15 min) before / after: "
          + " / ".join(", ".join(f"{x:.2f}" for x in la) for la in r["loadavg"]))


if __name__ == "__main__":
    main()
