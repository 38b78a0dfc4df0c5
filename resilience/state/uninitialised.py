"""A replacement's model and optimizer given storage but no values: for a rank whose whole state a replica's heal
overwrites before anything reads it (``StrategyCaps.overwrites_replacement_state``).

On a replacement's critical path, building dlrm_emb's state initialised costs more than receiving it: drawing 563 MB
of embedding rows, filling 563 MB of Adagrad sums, and, since ``torch.use_deterministic_algorithms`` fills even
``torch.empty`` (``fill_uninitialized_memory``), writing NaN over every byte that the heal then overwrites. Here the
model and its optimizer are built on the meta device and given storage on the rank's device without a fill: the
pages are first touched by the heal's receive.

A heal carries what ``state_dict`` holds. What it does not (a non-persistent buffer, a tensor kept as a plain
attribute) must still be built as before; a model with any is built initialised, with a warning naming them.
The global RNG is not touched either way (``Workload.build_model`` initialises under a private seed).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import nn

from resilience.caps import StrategyCaps
from resilience.workloads.base import Workload


def wanted(attempt: int, caps: StrategyCaps) -> bool:
    """Whether a rank of ``attempt`` builds its state uninitialised: a replacement (attempt > 0) whose strategy
    overwrites all of it; never the first generation, which trains from the initial state."""
    return attempt > 0 and caps.overwrites_replacement_state


def untransferred(model: nn.Module) -> list[str]:
    """What a heal would leave unset in ``model`` (built on meta): its non-persistent buffers and the tensors its
    modules keep as plain attributes that the meta device caught."""
    held = set(model.state_dict(keep_vars=True))
    names = [f"buffer {n}" for n, _ in model.named_buffers() if n not in held]
    for prefix, module in model.named_modules():
        names += [f"attribute {prefix + '.' if prefix else ''}{k}" for k, v in vars(module).items()
                  if isinstance(v, torch.Tensor) and v.is_meta]
    return names


def build(workload: Workload, device: torch.device,
          wrap: Callable[[nn.Module], nn.Module]) -> tuple[nn.Module, torch.optim.Optimizer] | None:
    """The wrapped model and its optimizer, with storage on ``device`` and no values; None where the model holds
    state a heal does not carry (``untransferred``): then build it initialised."""
    with torch.device("meta"):
        bare = workload.build_model()
    missing = untransferred(bare)
    if missing:
        warnings.warn(f"{type(workload).__name__}: the replacement's state is built initialised: a heal does not "
                      f"carry {', '.join(missing)}")
        return None
    optimizer = workload.build_optimizer(bare)  # eager state (Adagrad's sums) on meta too
    with _unfilled():
        with _params_kept():
            bare.to_empty(device=device)  # the same Parameter objects: the optimizer's references hold
        _to_empty(optimizer, device)
        model = wrap(bare)
    if {id(p) for g in optimizer.param_groups for p in g["params"]} != {id(p) for p in model.parameters()}:
        with _unfilled():  # the wrapper made parameters of its own (HSDP's DTensors, a pipeline's stage)
            optimizer = workload.build_optimizer(model)
    return model, optimizer


def _to_empty(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.is_meta:
                state[key] = torch.empty_like(value, device=device)


@contextmanager
def _unfilled() -> Iterator[None]:
    """``torch.empty`` without the NaN fill that deterministic mode adds: every byte is received before use."""
    import torch.utils.deterministic as det

    fill, det.fill_uninitialized_memory = det.fill_uninitialized_memory, False
    try:
        yield
    finally:
        det.fill_uninitialized_memory = fill


@contextmanager
def _params_kept() -> Iterator[None]:
    """``Module.to_empty`` swaps each parameter's storage in place (``swap_tensors``) instead of making new
    ``Parameter`` objects: an optimizer built over the meta parameters stays bound to the model."""
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
