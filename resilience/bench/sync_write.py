"""``python -m resilience.bench.sync_write``: sync's write path alone, against the probed disk limit.

Two gloo ranks hold the ``dlrm_emb`` state (1.13 GB per replica, each rank writes its half) and save it ``--saves``
times through DCP, alternating the plain ``FileSystemWriter`` and the harness's writer (``HookedWriter``: the same
plus a CRC32 per file computed in the write path, as every sync checkpoint does), each followed by a barrier: the
time all data is fsynced. It prints GB/s per save and its share of the probed write limit. Side by side with the
training runs of ``resilience.bench.compare`` it separates the cost of DCP and checksums from what a checkpoint inside a
training run meets besides (page-cache memory that is new to the machine, the other rank still computing).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, port: int, out: str, saves: int, results) -> None:
    import torch.distributed.checkpoint as dcp
    from hydra.utils import instantiate
    from omegaconf import OmegaConf
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.nn.parallel import DistributedDataParallel as DDP

    from resilience.state import TrainState
    from resilience.strategies.sync import HookedWriter

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    wl = instantiate(OmegaConf.load(Path(__file__).parents[2] / "conf" / "workload" / "dlrm_emb.yaml"), seed=0)
    model = DDP(wl.build_model())
    state = TrainState(model, wl.build_optimizer(model))
    writers = {"dcp": lambda p: FileSystemWriter(p, sync_files=True),
               "dcp+crc": lambda p: HookedWriter(p, lambda *a: None, 0)}
    for i in range(saves):
        name = list(writers)[i % 2]
        path = Path(out) / f"save{i}"
        if rank == 0:
            path.mkdir()
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(state.state_dict(), storage_writer=writers[name](path))
        dist.barrier()
        seconds = time.perf_counter() - t0
        if rank == 0:
            nbytes = sum(f.stat().st_size for f in path.iterdir())
            results.put((i, name, nbytes, seconds))
            shutil.rmtree(path)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    from resilience.bench.probe import load_limits

    ap = argparse.ArgumentParser(prog="python -m resilience.bench.sync_write", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path("results"), help="where to write (default: results)")
    ap.add_argument("--saves", type=int, default=6, help="saves, alternating the two writers (default 6)")
    args = ap.parse_args(argv)
    if args.saves < 2:
        ap.error(f"--saves={args.saves}: must be an integer >= 2")
    args.dir.mkdir(parents=True, exist_ok=True)
    limit = load_limits(args.dir)["write_GBps"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="sync_bench-") as out:
        mp.start_processes(_rank, args=(port, out, args.saves, results), nprocs=2, start_method="spawn")
        rows = sorted(results.get(timeout=10) for _ in range(args.saves))
    print(f"probed disk write limit {limit:.2f} GB/s (python -m resilience.bench.probe)")
    print("| save | writer | GB | s | GB/s | % of limit |\n|---|---|---|---|---|---|")
    for i, name, nbytes, seconds in rows:
        print(f"| {i} | {name} | {nbytes / 1e9:.2f} | {seconds:.3f} | {nbytes / 1e9 / seconds:.2f} | "
              f"{100 * nbytes / 1e9 / seconds / limit:.0f} |")


if __name__ == "__main__":
    main()
