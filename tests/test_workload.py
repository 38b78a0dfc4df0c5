"""The workload: batches are a pure function of (seed, step, rank), and sizes match their description."""

from __future__ import annotations

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from conftest import ROOT


def workload(name: str, seed: int = 0):
    return instantiate(OmegaConf.load(ROOT / "conf" / "workload" / f"{name}.yaml"), seed=seed)


def test_batch_is_a_pure_function_of_seed_step_rank():
    a, b = workload("gpt_tiny"), workload("gpt_tiny")
    cpu = torch.device("cpu")
    torch.manual_seed(1)
    x1 = a.batch(7, 1, cpu)
    torch.manual_seed(2)  # the global generator must not matter
    x2 = b.batch(7, 1, cpu)
    assert all(torch.equal(p, q) for p, q in zip(x1, x2))
    assert not torch.equal(a.batch(7, 0, cpu)[0], x1[0])
    assert not torch.equal(a.batch(8, 1, cpu)[0], x1[0])
    assert not torch.equal(workload("gpt_tiny", seed=1).batch(7, 1, cpu)[0], x1[0])


def test_model_sizes():
    tiny = sum(p.numel() for p in workload("gpt_tiny").build_model().parameters())
    small = sum(p.numel() for p in workload("gpt_small").build_model().parameters())
    assert 0.8e6 <= tiny <= 1.3e6
    assert 10e6 <= small <= 20e6


def test_initialisation_is_seeded_and_leaves_global_rng_alone():
    state = torch.get_rng_state().clone()
    m1, m2 = workload("gpt_tiny").build_model(), workload("gpt_tiny").build_model()
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(p, q) for p, q in zip(m1.parameters(), m2.parameters()))
