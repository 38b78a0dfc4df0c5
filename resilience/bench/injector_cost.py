"""``python -m resilience.bench.injector_cost``: what an armed injector that does not fire costs, against a real step.

Target: <= 1% of the step time of gpt_tiny. Both are measured here, side by side, in one process.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from injectors.bitflip import BitFlip
from injectors.hang import Hang
from injectors.kill import Kill
from injectors.slow_disk import SlowDisk
from resilience.record.events import EventLog
from resilience.runtime.rank import RankRuntime

CONF = Path(__file__).resolve().parents[2] / "conf"  # the repository's conf/


def step_time(steps: int = 20) -> float:
    torch.set_num_threads(1)
    w = instantiate(OmegaConf.load(CONF / "workload" / "gpt_tiny.yaml"), seed=0)
    model = w.build_model()
    opt = w.build_optimizer(model)
    t0 = time.perf_counter()
    for s in range(steps):
        w.loss(model, w.batch(s, 0, torch.device("cpu"))).backward()
        opt.step()
        opt.zero_grad()
    return (time.perf_counter() - t0) / steps


def hook_cost(injector, run_dir: Path, calls: int = 100_000) -> float:
    """Seconds per training step spent in the hook: three phase calls per step, none of them firing."""
    injector.validate(2, 10**9, 5)
    injector.attach(RankRuntime(rank=1, world_size=2, device=torch.device("cpu"), run_dir=run_dir,
                                ckpt_dir=run_dir / "ckpt", events=EventLog(run_dir, 1, 0)))
    t0 = time.perf_counter()
    for step in range(calls):
        injector("before_forward", step)
        injector("before_optimizer_step", step)
        injector("during_checkpoint", step)
    return (time.perf_counter() - t0) / calls


def main() -> None:
    step = step_time()
    print(f"gpt_tiny step (1 thread): {step * 1e3:.1f} ms")
    with tempfile.TemporaryDirectory() as tmp:
        for inj in (Kill(rank=1, at_step=10**8), Hang(rank=1, at_step=10**8), SlowDisk(rank=1, at_step=10**8),
                    BitFlip(rank=1, at_step=10**8, target="weights")):
            cost = hook_cost(inj, Path(tmp))
            print(f"  {inj.name:10s} armed, not firing: {cost * 1e6:6.2f} us/step = {100 * cost / step:.4f}% "
                  f"of a step (target <= 1%)")


if __name__ == "__main__":
    main()
