"""``python -m resilience.bench.reduction [--worlds 2 4 8] [--mb 4]``: bytes and time per rank of the gradient reduction.

For each world size ``W`` it starts ``W`` gloo ranks on this host, gives each a random bucket of ``--mb`` MB (float32)
and reduces it three ways: DDP's own all-reduce (what ``W = 2`` uses), the former ordered reduction (all-gather whole
buckets, sum in rank order) and the current one (reduce-scatter in rank order, all-gather of the reduced shards;
``resilience/runtime/reduce.py``). Per way it prints the bytes each rank *sent*, measured as the growth of the process's
``wchar`` (``/proc/self/io``: gloo's TCP transport writes with ``write``/``writev``, which ``wchar`` counts; every way
here sends as many bytes as it receives), as a multiple of the bucket, beside the textbook figure, and the median
time of ``--repeats``. It also checks that both ordered reductions give the same bits, and that the current one
gives them for another bucket layout too. On a 2-core host ``W = 8``
shares the cores eight ways: the times say little there, the bytes are exact.
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
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from resilience.runtime.reduce import gathered_sum_hook, ordered_sum_hook

WAYS = {"allreduce (DDP's own, used at W=2)": default_hooks.allreduce_hook, "all-gather, ordered (before)": gathered_sum_hook,
        "reduce-scatter + all-gather, ordered (now)": ordered_sum_hook}


class Bucket:
    """The one method of DDP's ``GradBucket`` a comm hook uses."""

    def __init__(self, buf: torch.Tensor) -> None:
        self._buf = buf

    def buffer(self) -> torch.Tensor:
        return self._buf


def _wchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no wchar")


def reduce_once(hook, grad: torch.Tensor) -> tuple[torch.Tensor, int, float]:
    """The reduced ``grad`` (a copy), the bytes this rank sent for it, and the seconds it took (between barriers)."""
    dist.barrier()
    sent, t0 = _wchar(), time.perf_counter()
    out = hook(None, Bucket(grad.clone())).wait().clone()
    seconds, nbytes = time.perf_counter() - t0, _wchar() - sent
    dist.barrier()
    return out, nbytes, seconds


def _rank(rank: int, world: int, store: str, numel: int, repeats: int, out) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    grad = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    row, results = {}, {}
    for name, hook in WAYS.items():
        runs = [reduce_once(hook, grad) for _ in range(repeats)]
        results[name] = runs[0][0]
        row[name] = (min(r[1] for r in runs), statistics.median(r[2] for r in runs))
    a, b = (results[n] for n in list(WAYS)[1:])
    row["same bits"] = _same(a, b)
    # another bucket layout (three uneven buckets, as DDP's rebuilt buckets differ from its first ones): same bits
    cuts = [0, numel // 7, numel // 2 + 1, numel]
    pieces = [reduce_once(ordered_sum_hook, grad[lo:hi])[0] for lo, hi in zip(cuts, cuts[1:])]
    row["layout-free"] = _same(torch.cat(pieces), b)
    out.put((rank, row))
    dist.destroy_process_group()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.view(torch.int32), b.view(torch.int32)))


def measure(world: int, numel: int, repeats: int = 3, timeout_s: float = 120) -> dict[int, dict]:
    """Run the ``world`` ranks; return each rank's row: way -> (bytes sent, median seconds), and ``same bits``."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, world, os.path.join(tmp, "store"), numel, repeats, out))
                 for r in range(world)]
        for p in procs:
            p.start()
        try:
            rows = dict(out.get(timeout=timeout_s) for _ in procs)
            for p in procs:
                p.join(timeout=30)
            return rows
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()


def textbook(way: str, world: int) -> float:
    """Bytes a rank sends per bucket byte: ring all-reduce and reduce-scatter + all-gather 2(W-1)/W, all-gather W-1."""
    return float(world - 1) if way.startswith("all-gather") else 2 * (world - 1) / world


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--mb", type=float, default=4.0, help="bucket size in MB (gpt_tiny's gradients: ~4 MB)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    numel = int(args.mb * 1e6) // 4
    print(f"bucket {numel * 4 / 1e6:.1f} MB float32; bytes sent per rank (max over ranks) / bucket bytes "
          f"[textbook], median time of {args.repeats}; load {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    for world in args.worlds:
        rows = measure(world, numel, args.repeats)
        cells = []
        for way in WAYS:
            sent = max(r[way][0] for r in rows.values()) / (numel * 4)
            secs = statistics.median(r[way][1] for r in rows.values())
            cells.append(f"{way}: {sent:.2f}x [{textbook(way, world):.2f}x] {secs * 1e3:.0f} ms")
        same = all(r["same bits"] for r in rows.values())
        free = all(r["layout-free"] for r in rows.values())
        print(f"W={world}: " + "; ".join(cells) + f"; ordered ways bit-identical: {same}, "
              f"for another bucket layout too: {free}", flush=True)


if __name__ == "__main__":
    main()
