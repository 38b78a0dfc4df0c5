"""Rank processes of tests/test_boundary_log.py, spawned as gloo ranks (``sharded_ranks.spawn``): a small GPT cut
into one stage per rank, trained with and without the boundary log, then each stage in turn restored to its state at
step ``C`` (kept in memory) and replayed alone to step ``K`` from the other stage's log."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from sharded_ranks import _join

CPU = torch.device("cpu")
C, K, MICRO = 2, 6, 4  # the checkpoint's position, the last step's, micro-batches per step
SMALL = {"d_model": 32, "n_layer": 3, "n_head": 2, "seq_len": 16, "dropout": 0.1}  # dropout: the RNG replays too


def _reseed(wl, step: int, rank: int) -> None:
    from resilience.workloads.base import stream_seed

    torch.manual_seed(stream_seed(wl.seed, step, rank, "rng"))  # as the replayable loop does before each step


def _train(wl, layout, schedule: str, log, steps: int):
    """``steps`` steps from the seed, the state at ``C`` kept; (state, kept, losses, seconds per step)."""
    from resilience.parallel.pp_runner import PipelineRunner
    from resilience.state.train import TrainState

    stage = wl.pipeline_stage(wl.build_model(), layout.stage, layout.stages)
    state = TrainState(stage, wl.build_optimizer(stage), flat_optim=True)
    runner = PipelineRunner(stage, layout, wl, CPU, MICRO, schedule, log=log)
    kept, losses, seconds = None, [], []
    for step in range(steps):
        start = time.perf_counter()
        _reseed(wl, step, layout.stage)
        losses.append(float(runner.forward_backward(wl.batch(step, 0, CPU), step)))
        state.optimizer.step()
        state.optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - start)
        if step + 1 == C:  # position C: what a checkpoint of step C holds
            kept = copy.deepcopy((stage.state_dict(), state.optimizer.state_dict()))
    return state, kept, losses, seconds


def _sha(state) -> str:
    from resilience.state.train import state_sha256

    return state_sha256(state.state_dict(parts=()))


def _replay(wl, layout, schedule: str, kept, received):
    """A fresh stage restored to ``kept`` and replayed over steps ``C..K-1`` from ``received``."""
    from resilience.parallel.boundary_log import BoundaryLog, sends_logged
    from resilience.parallel.stage_replay import StageReplay
    from resilience.state.train import TrainState

    stage = wl.pipeline_stage(wl.build_model(), layout.stage, layout.stages)
    state = TrainState(stage, wl.build_optimizer(stage), flat_optim=True)
    stage.load_state_dict(kept[0])
    state.optimizer.load_state_dict(kept[1])
    own = BoundaryLog(sends_logged(layout.stage, layout.stages))
    replay = StageReplay(stage, layout, wl, CPU, MICRO, schedule, received, own)

    def batch(step: int):
        _reseed(wl, step, layout.stage)
        return wl.batch(step, 0, CPU)

    def commit(step: int) -> None:
        state.optimizer.step()
        state.optimizer.zero_grad(set_to_none=True)

    return state, own, replay.run(range(C, K), batch, commit)


def replay_rank(rank: int, world: int, store: str, tmp: str, train_schedule: str, replay_schedule: str,
                budget: int | None, sizes: dict | None = None) -> None:
    """Logging leaves the training's bits alone; each stage replayed alone ends on its fault-free state at ``K``,
    bit for bit, and sends (logs again) what it sent in the fault-free run."""
    from resilience.parallel.boundary_log import BACKWARD, FORWARD, BoundaryLog, sends_logged
    from resilience.parallel.stage_replay import receive_entries, send_entries
    from resilience.runtime.pipeline import make_layout
    from resilience.workloads.gpt import GPTWorkload

    _join(rank, world, store)
    wl = GPTWorkload(0, **(sizes or SMALL))
    layout = make_layout(rank, world, world)
    plain, _, _, plain_seconds = _train(wl, layout, train_schedule, None, K)
    log = BoundaryLog(sends_logged(rank, world), budget, Path(tmp) / f"spill{rank}")
    state, kept, losses, seconds = _train(wl, layout, train_schedule, log, K)
    ends: list = [None] * world
    dist.all_gather_object(ends, (_sha(plain), _sha(state)))
    assert all(a == b for a, b in ends), f"logging changed the training's bits: {ends}"
    figures = {"bytes_by_step": log.bytes_by_step, "stats": log.stats(), "step_s": seconds,
               "plain_step_s": plain_seconds}
    for replayed in (1, 0):  # the last stage needs the first's activations; the first needs the last's gradients
        kind, other = (FORWARD, 0) if replayed == 1 else (BACKWARD, 1)
        if rank == replayed:
            received = BoundaryLog()
            figures[f"received_{rank}"] = receive_entries(received, src=other, group=None)
            again, own, done = _replay(wl, layout, replay_schedule, kept, received)
            assert _sha(again) == _sha(state), f"stage {rank} replayed {C}..{K - 1} off the fault-free state"
            for key in log.keys():  # what it would have sent: the fault-free run's sends, bit for bit
                if key.step >= C:
                    assert all(torch.equal(a, b) for a, b in zip(own.get(*key), log.get(*key))), key
            assert len(own.keys()) == len([k for k in log.keys() if k.step >= C])
            if layout.last:
                assert done.losses == losses[C:K], (done.losses, losses[C:K])
            figures[f"replay_s_{rank}"] = done.duration_s
            if layout.last:  # the negative control: one activation one ulp off, and the replay ends elsewhere
                key = received.keys()[0]
                (bent,) = (t.clone() for t in received.get(*key))
                bent.view(-1)[0] = torch.nextafter(bent.view(-1)[0], torch.tensor(float("inf")))
                received.put(key, (bent,))
                assert _sha(_replay(wl, layout, replay_schedule, kept, received)[0]) != _sha(state)
        else:
            figures[f"sent_bytes_{rank}"] = send_entries(log, kind, range(C, K), dst=replayed, group=None)
        dist.barrier()
    (Path(tmp) / f"figures{rank}.json").write_text(json.dumps(figures, default=str))
    dist.destroy_process_group()
