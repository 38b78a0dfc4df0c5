"""``python -m resilience.bench.verify_cost``: what the always-on checkpoint check costs a load, side by side.

Every load first checks the checkpoint it picked (``CheckpointDir.check``: the commit record, each file's size, and
a CRC32 pass over every file). This saves one checkpoint of a workload's state the way ``sync`` does (DCP, the CRC32
computed while writing, the atomic commit), then times, ``--repeats`` times in alternating order, the check and the
DCP load into the live state, and prints both and their ratio. One process, no group: the same bytes a restarted
job reads (page cache warm, as on the host that wrote them).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch.distributed.checkpoint as dcp
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch.distributed.checkpoint import FileSystemReader

from resilience.ckpt.commit import CheckpointDir
from resilience.state import TrainState
from resilience.strategies.sync import HookedWriter

CONF = Path(__file__).resolve().parents[2] / "conf"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m resilience.bench.verify_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="dlrm_emb", help="a conf/workload option (default dlrm_emb, 1.1 GB)")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--dir", type=Path, default=Path("results"))
    args = ap.parse_args(argv)
    if args.repeats < 1 or not (CONF / "workload" / f"{args.workload}.yaml").exists():
        ap.error(f"--workload={args.workload} / --repeats={args.repeats}: an option of conf/workload, repeats >= 1")
    wl = instantiate(OmegaConf.load(CONF / "workload" / f"{args.workload}.yaml"), seed=0)
    model = wl.build_model()
    state = TrainState(model, wl.build_optimizer(model))
    args.dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="verify_cost-") as out:
        dirs = CheckpointDir(out)
        path = dirs.prepare(1)
        dcp.save(state.state_dict(), storage_writer=HookedWriter(path, lambda *a: None, 1))
        nbytes = dirs.commit(1)
        entry = dirs.newest_committed()
        rows = []
        for i in range(args.repeats):
            timings = {}
            for what in (("check", "load") if i % 2 == 0 else ("load", "check")):
                t0 = time.perf_counter()
                if what == "check":
                    assert dirs.check(entry) is None
                else:
                    sd = state.state_dict()
                    dcp.load(sd, storage_reader=FileSystemReader(entry.path))
                    state.load_state_dict(sd)
                timings[what] = time.perf_counter() - t0
            rows.append(timings)
    print(f"{args.workload}: checkpoint {nbytes / 1e9:.2f} GB")
    print("| repeat | check s | check GB/s | load s | check / load |\n|---|---|---|---|---|")
    for i, t in enumerate(rows):
        print(f"| {i} | {t['check']:.3f} | {nbytes / 1e9 / t['check']:.2f} | {t['load']:.3f} | "
              f"{t['check'] / t['load']:.2f} |")


if __name__ == "__main__":
    main()
