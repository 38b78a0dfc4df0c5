"""The state dict of a training state, built by DCP once and reused while it is still the state's own.

``TrainState.state_dict()`` (DCP's ``get_state_dict``) rebuilds every fully qualified name and the optimizer's
mapping at every call: 3.5-4.2 ms of an async snapshot's ~11 ms stall on gpt_small (docs/performance.md). Between
checkpoints nothing of that changes but the values, and the values are the live tensors themselves: the model's
parameters and buffers (views of their storage) and the optimizer's state tensors, which a step updates in place.
So the dict is kept and handed out again, with the optimizer's param-group settings (a scheduler changes the LR)
and the job's other parts read afresh every time. It is rebuilt whenever any of those tensors is another object or
holds other storage (a load replaced the optimizer's state, a parameter's ``.data`` was reassigned), and never
kept where the state is sharded (DTensor parameters) or the optimizer keeps a value that is not a tensor.
"""

from __future__ import annotations

from typing import Any

import torch

from resilience.ckpt.snapshot import is_sharded
from resilience.state.train import TrainState


class ReusedStateDict:
    """``of(state)``: what ``state.state_dict()`` returns, from a dict built once while it stays valid."""

    def __init__(self) -> None:
        self._identity: tuple | None = None
        self._sd: dict[str, Any] | None = None
        self._names: list[list[str]] = []
        self.rebuilt = True  # whether the last ``of`` built the dict (its tensors' layout may then differ)

    def of(self, state: TrainState) -> dict[str, Any]:
        identity = _identity(state)
        self.rebuilt = identity is None or identity != self._identity
        if identity is None:
            return state.state_dict()
        if self.rebuilt:
            self._sd = state.state_dict(parts=())
            self._names = [list(g["params"]) for g in self._sd["optim"]["param_groups"]]
            self._identity = identity
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": names}
                  for g, names in zip(state.optimizer.param_groups, self._names)]
        return {"model": self._sd["model"], "optim": {"state": self._sd["optim"]["state"], "param_groups": groups},
                **state.parts.state_dict()}


def _identity(state: TrainState) -> tuple | None:
    """Every tensor the dict refers to, as (object, storage); None where the dict must be built every time."""
    params, buffers = list(state.model.parameters()), list(state.model.buffers())
    if not state.optimizer.state or any(is_sharded(p) for p in params):
        return None
    held = []
    for s in state.optimizer.state.values():
        for v in s.values():
            if not isinstance(v, torch.Tensor):
                return None  # a plain value would be stale in the kept dict
            held.append((id(v), v.data_ptr()))
    return (tuple((id(t), t.data_ptr()) for t in params + buffers), tuple(held),
            tuple(len(g["params"]) for g in state.optimizer.param_groups))
