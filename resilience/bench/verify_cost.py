"""``python -m resilience.bench.verify_cost``: what a verified load costs, read by read, side by side.

It saves one checkpoint of a workload's state the way ``sync`` does (DCP, the checksum computed while writing, the
atomic commit), then times, ``--repeats`` times in alternating order, on the same bytes (page cache warm, as on the
host that wrote them; one process, no group):

* ``before``: the load as it was: ``CheckpointDir.check`` (a checksum pass over every file) and then DCP's load from
  the files, a second full read;
* ``now``: the load as ``sync`` does it: each file mapped and its checksum summed over the mapping, the one pass over
  the bytes (``ckpt.verified.read_verified``), then DCP decodes from the mappings (``read`` and ``decode`` below);
* ``raw read``: the same files read into memory with no checksum: the floor of any load;
* ``decode``: DCP's part, from memory: the ``weights_only`` unpickling of each item and the copies into the live
  tensors. A cProfile of one decode says where its time goes.

``measure(...)`` returns the figures (for ``resilience.bench.speed``); ``main`` prints them.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch.distributed.checkpoint import FileSystemReader

from resilience.ckpt.commit import CheckpointDir
from resilience.ckpt.digest import for_record
from resilience.ckpt.dcp_files import HookedWriter, MemoryFiles
from resilience.ckpt.verified import read_verified
from resilience.state.train import TrainState

CONF = Path(__file__).resolve().parents[2] / "conf"


def _raw_read(path: Path, size: int) -> memoryview:
    buf = memoryview(bytearray(size))
    with open(path, "rb") as f:
        done = 0
        while done < size:
            done += f.readinto(buf[done:done + (8 << 20)])
    return buf


def measure(workload: str = "dlrm_emb", repeats: int = 4, out_dir: Path = Path("results")) -> dict[str, Any]:
    """Per repeat: before_s, now_s (= read_s + decode_s), raw_read_s; medians of each; ``decode_over_raw_read``;
    ``now_over_before``; ``decode_profile``: the decode's top functions by own time (name, s); ``ckpt_bytes``."""
    torch.set_num_threads(1)  # as a rank runs
    wl = instantiate(OmegaConf.load(CONF / "workload" / f"{workload}.yaml"), seed=0)
    model = wl.build_model()
    state = TrainState(model, wl.build_optimizer(model))
    out_dir.mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(dir=out_dir, prefix="verify_cost-") as out:
        dirs = CheckpointDir(out)
        path = dirs.prepare(1)
        dcp.save(state.state_dict(), storage_writer=HookedWriter(path, lambda *a: None, 1), no_dist=True)
        nbytes = dirs.commit(1)
        entry = dirs.newest_committed()
        record = dirs.manifest(entry)
        digest, sums = for_record(record)

        def decode(buffers: dict[str, memoryview]) -> None:
            sd = state.state_dict()
            reader = FileSystemReader(entry.path)
            reader.fs = MemoryFiles(entry.path, buffers)
            dcp.load(sd, storage_reader=reader, no_dist=True)
            state.load_state_dict(sd)

        def before() -> dict[str, float]:
            t0 = time.perf_counter()
            assert dirs.check(entry) is None
            sd = state.state_dict()
            dcp.load(sd, storage_reader=FileSystemReader(entry.path), no_dist=True)
            state.load_state_dict(sd)
            return {"before_s": time.perf_counter() - t0}

        def now() -> dict[str, float]:
            t0 = time.perf_counter()
            buffers = {n: read_verified(None, entry.path / n, size, sums[n], digest)
                       for n, size in record["files"].items()}
            t1 = time.perf_counter()
            decode(buffers)
            return {"read_s": t1 - t0, "decode_s": time.perf_counter() - t1, "now_s": time.perf_counter() - t0}

        def raw() -> dict[str, float]:
            t0 = time.perf_counter()
            bufs = [_raw_read(entry.path / n, size) for n, size in record["files"].items()]
            del bufs
            return {"raw_read_s": time.perf_counter() - t0}

        rows = []
        for i in range(repeats):
            row: dict[str, float] = {}
            for fn in ((before, now, raw) if i % 2 == 0 else (raw, now, before)):
                row.update(fn())
            rows.append(row)
        buffers = {n: _raw_read(entry.path / n, size) for n, size in record["files"].items()}
        prof = cProfile.Profile()
        prof.enable()
        decode(buffers)
        prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, callers)
    top = sorted(((f"{k[2]} ({Path(k[0]).name}:{k[1]})", v[2]) for k, v in stats.items()), key=lambda x: -x[1])[:6]
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    return {"workload": workload, "ckpt_bytes": nbytes, "rows": rows, "median": med,
            "now_over_before": med["now_s"] / med["before_s"], "decode_over_raw_read": med["decode_s"] / med["raw_read_s"],
            "decode_profile": top, "decode_profile_total_s": sum(v[2] for v in stats.values()),
            "loadavg": [load0, os.getloadavg()]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m resilience.bench.verify_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="dlrm_emb", help="a conf/workload option (default dlrm_emb, 1.1 GB)")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--dir", type=Path, default=Path("results"))
    args = ap.parse_args(argv)
    if args.repeats < 1 or not (CONF / "workload" / f"{args.workload}.yaml").exists():
        ap.error(f"--workload={args.workload} / --repeats={args.repeats}: an option of conf/workload, repeats >= 1")
    r = measure(args.workload, args.repeats, args.dir)
    gb = r["ckpt_bytes"] / 1e9
    print(f"{r['workload']}: checkpoint {gb:.2f} GB; seconds (GB/s)")
    print("| repeat | before: check + DCP load | now: verified read + decode | read (checksum beside) | decode | "
          "raw read |\n|---|---|---|---|---|---|")
    for i, t in enumerate([*r["rows"], r["median"]]):
        print(f"| {'median' if i == len(r['rows']) else i} | " + " | ".join(
            f"{t[k]:.3f} ({gb / t[k]:.2f})" for k in ("before_s", "now_s", "read_s", "decode_s", "raw_read_s")) + " |")
    print(f"now / before {r['now_over_before']:.2f}; decode / raw read {r['decode_over_raw_read']:.2f}")
    print(f"decode profile ({r['decode_profile_total_s']:.3f} s under cProfile), top own times: "
          + "; ".join(f"{name} {s:.3f} s" for name, s in r["decode_profile"]))
    print("load average (1, 5, 15 min) before / after: "
          + " / ".join(", ".join(f"{x:.2f}" for x in la) for la in r["loadavg"]))


if __name__ == "__main__":
    main()
