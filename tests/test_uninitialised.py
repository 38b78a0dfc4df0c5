"""A replacement healed from a replica builds its model and optimizer without values (resilience.state.uninitialised):
only such a replacement does, whatever the heal does not carry is built as before, and the healed state trains on
bit for bit as the state it received. The real-process heal through this build: tests/test_replica.py."""

from __future__ import annotations

import warnings

import pytest
import torch
from hydra.utils import get_class, instantiate
from omegaconf import OmegaConf
from torch import nn

from conftest import ROOT
from resilience.ckpt.transfer import replica_state
from resilience.state import uninitialised
from resilience.state.train import RestorePoint, TrainState, map_tensors, state_sha256
from resilience.workloads.gpt import GPTWorkload

CPU = torch.device("cpu")
SMALL = {"gpt_tiny": {}, "dlrm_emb": {"rows": 3000, "tables": 3}}


def workload(name: str):
    return instantiate(OmegaConf.load(ROOT / "conf" / "workload" / f"{name}.yaml"), seed=0, **SMALL[name])


def caps(strategy: str):
    return get_class(OmegaConf.load(ROOT / "conf" / "strategy" / f"{strategy}.yaml")._target_).caps


@pytest.mark.parametrize("strategy", ["replica", "replica_torchft", "sync", "inmemory", "jit", "shadow"])
def test_only_a_replacement_healed_from_a_replica_is_built_uninitialised(strategy):
    assert not uninitialised.wanted(0, caps(strategy))  # the first generation trains from the initial state
    assert uninitialised.wanted(1, caps(strategy)) == (strategy == "replica")


def _step(wl, state: TrainState, step: int) -> None:
    torch.manual_seed(step)
    wl.loss(state.model, wl.batch(step, 0, CPU)).backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("name", list(SMALL))
def test_the_healed_uninitialised_state_trains_on_bit_exact(name):
    wl = workload(name)
    model = wl.build_model()
    source = TrainState(model, wl.build_optimizer(model))
    _step(wl, source, 0)  # the replica's state after a step: AdamW's moments exist, Adagrad's sums moved
    rng = torch.get_rng_state()
    model, optimizer = uninitialised.build(wl, CPU, lambda m: m)
    assert torch.equal(torch.get_rng_state(), rng)  # nothing drawn from the global generator
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == {id(p) for p in model.parameters()}
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()]
                   + [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)])
    healed = TrainState(model, optimizer, uninitialised=True)
    assert RestorePoint(healed).state is None  # nothing copied: there is nothing to put back
    sent = map_tensors(torch.clone, replica_state(source))  # what the heal carries, loaded as recv_state loads it
    model.load_state_dict(sent["model"])
    optimizer.load_state_dict(sent["optim"])
    assert state_sha256(replica_state(healed)) == state_sha256(sent)
    for state in (source, healed):
        _step(wl, state, 1)
    assert state_sha256(replica_state(healed)) == state_sha256(replica_state(source))


class WithMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("mask", torch.tril(torch.ones(4, 4)), persistent=False)
        self.scale = torch.tensor(2.0)


class MaskedWorkload(GPTWorkload):
    def build_model(self) -> nn.Module:
        return WithMask()


def test_a_model_with_state_no_heal_carries_is_built_initialised():
    with torch.device("meta"):
        model = WithMask()
    assert uninitialised.untransferred(model) == ["buffer mask", "attribute scale"]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert uninitialised.build(MaskedWorkload(seed=0), CPU, lambda m: m) is None
    assert "buffer mask, attribute scale" in str(said[0].message)
