"""Rank processes of tests/test_pipeline_parallel.py and test_pipeline_dp.py, spawned as gloo ranks
(``sharded_ranks.spawn``): a small GPT cut into one stage per rank, trained a few steps under each schedule, saved with
DCP and loaded into fresh stages; pp_dp's reduction over a stage's replicas."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from sharded_ranks import _join

CPU = torch.device("cpu")


def _trained(schedule: str, flat: bool, steps: int = 3):
    """This rank's stage of a 3-block GPT, trained ``steps`` steps of 4 micro-batches under ``schedule``."""
    from resilience.parallel.pp_runner import PipelineRunner
    from resilience.runtime.pipeline import make_layout
    from resilience.state.train import TrainState
    from resilience.workloads.gpt import GPTWorkload

    wl = GPTWorkload(0, d_model=32, n_layer=3, n_head=2, seq_len=16)
    layout = make_layout(dist.get_rank(), dist.get_world_size(), dist.get_world_size())
    stage = wl.pipeline_stage(wl.build_model(), layout.stage, layout.stages)
    state = TrainState(stage, wl.build_optimizer(stage), flat_optim=flat)
    runner = PipelineRunner(stage, layout, wl, CPU, 4, schedule)
    for step in range(steps):
        runner.forward_backward(wl.batch(step, 0, CPU))
        state.optimizer.step()
        state.optimizer.zero_grad(set_to_none=True)
    return wl, state


def schedules_rank(rank: int, world: int, store: str, tmp: str) -> None:
    """1F1B and GPipe end on the same bits; a repeat too; and every parameter of every stage trained (a stage that
    received no gradient would keep its initial values)."""
    from resilience.state.train import state_sha256

    _join(rank, world, store)
    trained = [_trained(s, flat=True) for s in ("1f1b", "gpipe", "1f1b")]
    ends = [state_sha256(state.state_dict(parts=())) for _, state in trained]
    assert len(set(ends)) == 1, ends
    wl, state = trained[0]
    initial = wl.pipeline_stage(wl.build_model(), rank, world)
    assert all(not torch.equal(p, q) for p, q in zip(state.model.parameters(), initial.parameters()))
    dist.destroy_process_group()


def round_trip_rank(rank: int, world: int, store: str, tmp: str) -> None:
    """Each stage's state saved together with DCP loads back into fresh stages bit for bit with the flat optimizer
    state; with the nested one DCP keeps one stage's ``param_groups`` for both, and a stage loads the wrong one."""
    import torch.distributed.checkpoint as dcp

    from resilience.state.train import TrainState, state_sha256

    _join(rank, world, store)
    outcome = {}
    for flat in (True, False):
        wl, state = _trained("1f1b", flat)
        saved = state.state_dict(parts=())
        path = Path(tmp) / f"flat{flat}"
        dcp.save(saved, checkpoint_id=path)
        fresh = wl.pipeline_stage(wl.build_model(), rank, world)
        into = TrainState(fresh, wl.build_optimizer(fresh), flat_optim=flat)
        sd = into.state_dict(parts=())
        try:
            dcp.load(sd, checkpoint_id=path)
            into.load_state_dict(sd)
            outcome[flat] = state_sha256(into.state_dict(parts=())) == state_sha256(state.state_dict(parts=()))
        except Exception:  # the nested form may fail loudly instead (a name the stage does not hold)
            outcome[flat] = False
    verdicts: list = [None] * world
    dist.all_gather_object(verdicts, outcome)
    assert all(v[True] for v in verdicts), verdicts
    assert not all(v[False] for v in verdicts), f"the nested optimizer state round-tripped too: {verdicts}"
    dist.destroy_process_group()


def ordered_mean_rank(rank: int, world: int, store: str, tmp: str) -> None:
    """``reduce.ordered_mean`` (pp_dp's reduction of a stage's gradients over its replicas): every rank ends on
    ``(x0 + x1 + ... + x(W-1)) / W`` summed in rank order, bit for bit, over a subgroup as over the world."""
    from resilience.runtime.reduce import ordered_mean

    _join(rank, world, store)
    inputs = [torch.randn(1003, generator=torch.Generator().manual_seed(2000 + r)) for r in range(world)]
    expected = inputs[0].clone()
    for part in inputs[1:]:
        expected += part
    expected /= world
    assert torch.equal(ordered_mean(inputs[rank].clone(), dist.group.WORLD), expected)
    odd = dist.new_group([0, 2], timeout=timedelta(seconds=60))  # every rank forms it; ranks 0 and 2 use it
    if rank in (0, 2):
        pair = (inputs[0] + inputs[2]) / 2
        assert torch.equal(ordered_mean(inputs[rank].clone(), odd), pair)
    dist.destroy_process_group()
