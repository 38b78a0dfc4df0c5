"""``python -m resilience.bench.probe [--dir DIR] [--out FILE] [--max-age-h H] [--refresh]``: this machine's limits.

A checkpoint cannot be written faster than the disk takes data, snapshotted faster than memory copies, or a
recovery finish before processes restart. The probe measures those ceilings, so that results can say how close
a strategy gets (e.g. "sync writes at 80% of the disk's bandwidth"):

* ``write_GBps``: sequential write of ``size_mb`` (1 GiB: a checkpoint's size) of random bytes in 8 MiB chunks,
  then ``fsync``, to a new file; the median of 3 (a shared virtual disk's speed varies by 2-4x from run to run);
* ``read_GBps``: sequential read of that file after dropping it from the page cache with
  ``posix_fadvise(DONTNEED)`` (``read_cold`` says whether the drop was possible);
* ``memcpy_GBps``: ``Tensor.copy_`` between preallocated host buffers on one thread (as a rank snapshots);
* ``rank_start_s``: spawning two processes that import torch and initialise a gloo process group;
* ``p2p_GBps``: gloo send/recv of 256 MiB between those two (best of 3): how fast a replica's state travels.

The figures are a snapshot in one file beside the results they describe (``--out``, default
``CKPT_DIR/limits.json``), with where (``host``, ``dir``) and when (``measured_at``) they were measured. There is no
cache shared between checkouts or results directories: ``load_limits`` reuses a snapshot only if it is younger than
``max_age_s``, and probes otherwise. The pipeline takes its own snapshot per run (``reports.limits``, the Snakefile's
probe rule). The probe takes ~10 s on an idle machine (3 x 1 GiB written, 1 GiB read, two ranks started).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from resilience.record.fsio import atomic_write_json

SNAPSHOT = "limits.json"
MAX_AGE_S = 3600.0  # a machine's load, and so its limits, changes within hours: an older snapshot is probed again
CHUNK = 8 << 20
FIGURES = ("write_GBps", "read_GBps", "memcpy_GBps", "rank_start_s", "p2p_GBps")
_RANK_CHILD = """
import os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
print(time.time(), flush=True)
# Point-to-point bandwidth from rank 1 to rank 0, between buffers whose pages are mapped: the transport a
# replica's state travels over. Best of 3.
rank, n = dist.get_rank(), int(os.environ["P2P_MB"]) << 20
buf = torch.ones(n, dtype=torch.uint8)
best = 0.0
for _ in range(3):
    dist.barrier()
    t0 = time.perf_counter()
    dist.send(buf, 1 - rank) if rank == 1 else dist.recv(buf, 1)
    best = max(best, n / (time.perf_counter() - t0))
print(best / 1e9, flush=True)
dist.destroy_process_group()
"""


def _key(ckpt_dir: Path) -> str:
    return f"{socket.gethostname()}:dev{os.stat(ckpt_dir).st_dev}"


def _existing_dir(path: str | Path) -> Path:
    """``path`` itself if it exists, else its nearest existing ancestor (the file system it will be created on)."""
    p = Path(path).resolve()
    while not p.exists():
        p = p.parent
    return p


def measure_disk(ckpt_dir: Path, size_mb: int, samples: int = 3) -> dict[str, Any]:
    """Write (fsync) and cold-read bandwidth of scratch files in ``ckpt_dir``, which are removed afterwards.

    Each write sample creates a new file, as a checkpoint does (overwriting allocated blocks is faster and
    would flatter the disk). The limit is the median sample: the best one is often a burst that a cache in
    front of the disk absorbed, which a checkpoint of the same size does not see again.
    """
    chunk = os.urandom(CHUNK)  # incompressible: a file system or disk cannot shortcut it
    n = max(1, (size_mb << 20) // CHUNK)
    writes, read, cold = [], 0.0, False
    for sample in range(samples):
        fd, name = tempfile.mkstemp(prefix=".probe-", dir=ckpt_dir)
        try:
            writes.append(_write_fsync(fd, chunk, n))
            if sample == samples - 1:
                read, cold = _read_cold(fd, n * CHUNK)
        finally:
            os.close(fd)
            os.unlink(name)
    return {"write_GBps": statistics.median(writes) / 1e9, "write_samples_GBps": [w / 1e9 for w in writes],
            "read_GBps": read / 1e9, "read_cold": cold, "probe_bytes": n * CHUNK}


def _write_fsync(fd: int, chunk: bytes, n: int) -> float:
    """B/s of writing ``chunk`` ``n`` times to ``fd`` and fsyncing it."""
    t0 = time.perf_counter()
    for _ in range(n):
        os.write(fd, chunk)
    os.fsync(fd)
    return n * len(chunk) / (time.perf_counter() - t0)


def write_sample(ckpt_dir: Path, size_mb: int, streams: int = 1) -> float:
    """One fsync'd write sample in GB/s: ``size_mb`` MiB in all, split over ``streams`` new files written at
    once by as many threads (a disk behind a queue may take more from several streams than from one), timed
    until every file is durable. For a benchmark that interleaves probe samples with what it measures."""
    import threading

    chunk = os.urandom(CHUNK)
    n = max(1, (size_mb << 20) // CHUNK // streams)
    names = [tempfile.mkstemp(prefix=".probe-", dir=ckpt_dir) for _ in range(streams)]
    threads = [threading.Thread(target=_write_fsync, args=(fd, chunk, n)) for fd, _ in names]
    try:
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return streams * n * CHUNK / (time.perf_counter() - t0) / 1e9
    finally:
        for fd, name in names:
            os.close(fd)
            os.unlink(name)


def _read_cold(fd: int, nbytes: int) -> tuple[float, bool]:
    """Read bandwidth (B/s) of the open file after dropping its pages from the cache; whether the drop was possible."""
    cold = hasattr(os, "posix_fadvise")
    if cold:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean after fsync, so the pages are really dropped
    os.lseek(fd, 0, os.SEEK_SET)
    buf = bytearray(CHUNK)
    t0 = time.perf_counter()
    while os.readv(fd, [buf]) > 0:
        pass
    return nbytes / (time.perf_counter() - t0), cold


def measure_memcpy(size_mb: int = 256) -> float:
    """Host copy bandwidth in GB/s on one thread, between buffers whose pages are already mapped (best of 5)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(size_mb << 18)  # float32: size_mb MiB
        dst = torch.zeros_like(src)
        best = 0.0
        for _ in range(5):
            t0 = time.perf_counter()
            dst.copy_(src)
            best = max(best, src.numel() * 4 / (time.perf_counter() - t0))
        return best / 1e9
    finally:
        torch.set_num_threads(threads)


def measure_ranks(p2p_mb: int = 256, timeout_s: float = 60) -> dict[str, float]:
    """``rank_start_s``: seconds from spawning two interpreters to all of them having torch imported and a gloo
    group up; ``p2p_GBps``: gloo send/recv bandwidth between two of them (rank 0 receiving)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
            "OMP_NUM_THREADS": "1", "P2P_MB": str(p2p_mb)}
    t0 = time.time()
    procs = [subprocess.Popen([sys.executable, "-c", _RANK_CHILD], env={**base, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=timeout_s)[0].split() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return {"rank_start_s": max(float(o[0]) for o in outs) - t0, "p2p_GBps": float(outs[0][1]),
            "p2p_bytes": p2p_mb << 20}


def probe(ckpt_dir: str | Path, size_mb: int = 1024) -> dict[str, Any]:
    """Measure every limit for ``ckpt_dir``'s file system (created if missing)."""
    path = Path(ckpt_dir)
    path.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    limits = {"host": socket.gethostname(), "key": _key(path), "dir": str(path.resolve()),
              **measure_disk(path, size_mb), "memcpy_GBps": measure_memcpy(), **measure_ranks(),
              "rank_start_ranks": 2, "torch": torch.__version__, "measured_at": time.time()}
    limits["probe_s"] = time.perf_counter() - t0
    return limits


def read_snapshot(path: str | Path, max_age_s: float = MAX_AGE_S) -> dict[str, Any] | None:
    """The limits in snapshot file ``path`` if it holds every figure and is younger than ``max_age_s``; else None."""
    try:
        limits = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    fresh = time.time() - float(limits.get("measured_at", 0)) <= max_age_s
    return limits if fresh and set(FIGURES) <= set(limits) else None  # figures missing: an older probe wrote it


def cached_limits(ckpt_dir: str | Path, max_age_s: float = MAX_AGE_S) -> dict[str, Any] | None:
    """The snapshot ``ckpt_dir/limits.json`` if it is fresh (see :func:`read_snapshot`), else None; never probes."""
    return read_snapshot(Path(ckpt_dir) / SNAPSHOT, max_age_s)


def load_limits(ckpt_dir: str | Path, refresh: bool = False, size_mb: int = 1024, snapshot: str | Path | None = None,
                max_age_s: float = MAX_AGE_S) -> dict[str, Any]:
    """The limits of ``ckpt_dir``'s file system from ``snapshot`` (default ``ckpt_dir/limits.json``) when it is
    fresh; probed (and written there) when it is absent, stale, from an older probe, or ``refresh``."""
    path = Path(snapshot) if snapshot else Path(ckpt_dir) / SNAPSHOT
    limits = None if refresh else read_snapshot(path, max_age_s)
    if limits is None:
        limits = probe(_existing_dir(ckpt_dir), size_mb)  # the nearest existing directory: same file system
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, limits)
    return limits


def describe(limits: dict[str, Any]) -> str:
    """The figures, one per line."""
    samples = ", ".join(f"{w:.2f}" for w in limits["write_samples_GBps"])
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(limits["measured_at"]))
    return (f"limits of {limits['key']} ({limits['dir']}), measured {when}:\n"
            f"  disk write (fsync, median)  {limits['write_GBps']:.2f} GB/s  "
            f"(samples {samples}; {limits['probe_bytes'] >> 20} MiB each)\n"
            f"  disk read ({'cold' if limits['read_cold'] else 'possibly cached'})  {limits['read_GBps']:.2f} GB/s\n"
            f"  host memcpy (1 thread)  {limits['memcpy_GBps']:.2f} GB/s\n"
            f"  rank start ({limits['rank_start_ranks']} ranks: python + torch + gloo init)  "
            f"{limits['rank_start_s']:.2f} s\n"
            f"  rank-to-rank transfer (gloo send/recv)  {limits['p2p_GBps']:.2f} GB/s")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m resilience.bench.probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="results", help="a directory on the checkpoint file system (default: results)")
    ap.add_argument("--out", help="the snapshot file to reuse or write (default: DIR/limits.json)")
    ap.add_argument("--max-age-h", type=float, default=MAX_AGE_S / 3600,
                    help=f"reuse a snapshot younger than this (hours; default {MAX_AGE_S / 3600:g})")
    ap.add_argument("--refresh", action="store_true", help="probe again even if the snapshot is fresh")
    ap.add_argument("--size-mb", type=int, default=1024, help="bytes per disk sample, in MiB (default 1024)")
    args = ap.parse_args(argv)
    if args.size_mb < 1:
        ap.error(f"--size-mb={args.size_mb}: must be an integer >= 1")
    if not args.max_age_h >= 0:
        ap.error(f"--max-age-h={args.max_age_h}: must be a number >= 0")
    snapshot = Path(args.out) if args.out else Path(args.dir) / SNAPSHOT
    limits = load_limits(args.dir, refresh=args.refresh, size_mb=args.size_mb, snapshot=snapshot,
                         max_age_s=args.max_age_h * 3600)
    print(describe(limits))
    print(f"  snapshot {snapshot}")


if __name__ == "__main__":
    main()
