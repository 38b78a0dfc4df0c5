"""``python -m resilience.projection.bench``: time the Monte Carlo simulator on the reference workload.

Reference: the ``llama3_405b`` scenario -- a 54-day job on 16,384 GPUs at the Llama 3 405B failure rate (job MTBF
~3.09 h, ~419 failures per trial) -- 1,000 trials per strategy, exponential failures. Target: under 10 s on 2 cores.
"""

from __future__ import annotations

import argparse
import os

from omegaconf import OmegaConf

from resilience.projection.scenario import build_scenario
from resilience.projection.settings import CONF_DIR
from resilience.projection.simulator import simulate
from resilience.projection.sweeps import evaluate


def main(argv: list[str] | None = None) -> float:
    """Time ``--repeat`` simulations of one strategy; prints and returns the best wall-clock seconds."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default="llama3_405b", help="a name in conf/scenario/")
    parser.add_argument("--strategy", default="sync")
    parser.add_argument("--trials", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=3, help="runs to time; the best is reported")
    args = parser.parse_args(argv)
    node = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "scenario" / f"{args.scenario}.yaml"), resolve=True)
    scn = build_scenario(node, [CONF_DIR])
    point = evaluate(scn, args.strategy)
    times, result = [], None
    for seed in range(args.repeat):
        result = simulate(point.costs, scn.failure, scn.kinds, gpus=scn.gpus, interval_s=point.interval_s,
                          horizon_s=scn.horizon_s, trials=args.trials, seed=seed)
        times.append(result.seconds)
    best = min(times)
    print(f"Monte Carlo ({scn.name}, {args.strategy}): {args.trials:,} trials x {scn.duration_days:g} days x "
          f"{scn.gpus:,} GPUs, {result.failures.mean():.0f} failures per trial on average, {os.cpu_count()} CPUs: "
          f"{best:.3f} s (best of {args.repeat}: {', '.join(f'{t:.3f}' for t in times)})")
    return best


if __name__ == "__main__":
    main()
