"""The async snapshot's state dict, built once and reused (resilience/ckpt/reused.py), is at every checkpoint what
``TrainState.state_dict()`` returns: the same names, the same tensors (their storage), the same settings, through
optimizer steps, an LR schedule, a load that replaces the optimizer's state and a parameter given new storage."""

from __future__ import annotations

import copy

import torch

from resilience.state.parts import JobParts
from resilience.ckpt.reused import ReusedStateDict
from resilience.state.train import TrainState


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, sd: dict) -> None:
        self.n = sd["n"]


def flat(obj, prefix=""):
    if isinstance(obj, dict):
        return {k: v for key, value in obj.items() for k, v in flat(value, f"{prefix}/{key}").items()}
    if isinstance(obj, (list, tuple)) and any(isinstance(v, (dict, torch.Tensor)) for v in obj):
        return {k: v for i, value in enumerate(obj) for k, v in flat(value, f"{prefix}/{i}").items()}
    return {prefix: obj}


def same(a: dict, b: dict) -> bool:
    fa, fb = flat(a), flat(b)
    assert list(fa) == list(fb)
    for key, x in fa.items():
        y = fb[key]
        if isinstance(x, torch.Tensor):
            assert x.data_ptr() == y.data_ptr() and torch.equal(x, y), key
        else:
            assert x == y, key
    return True


def test_the_reused_state_dict_is_the_state_dict_at_every_checkpoint():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    counter = Counter()
    state = TrainState(model, optimizer, JobParts(0, job={"counter": counter}))
    reused = ReusedStateDict()

    def step() -> None:
        model(torch.randn(4, 6)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        counter.n += 1

    step()
    first = reused.of(state)
    kept = first["model"]
    for _ in range(3):
        step()
        assert same(reused.of(state), state.state_dict())
    assert reused.of(state)["model"] is kept  # built once
    assert reused.of(state)["optim"]["param_groups"][0]["lr"] == 0.1 * 0.5 ** 4  # the schedule's, read afresh

    # a load gives the optimizer other state tensors: built again
    optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    assert same(reused.of(state), state.state_dict()) and reused.of(state)["model"] is not kept
    kept = reused.of(state)["model"]
    with torch.no_grad():  # a parameter given new storage: built again
        model[0].weight.data = model[0].weight.data.clone()
    assert same(reused.of(state), state.state_dict()) and reused.of(state)["model"] is not kept
