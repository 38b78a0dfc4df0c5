"""Who applies an optimizer step: the training loop (the plain step), or a strategy that owns it.

A fault-tolerance library such as torchft decides per step who takes part (a quorum before the forward pass) and
whether the step counts (a commit vote after the backward pass); a failed peer makes it drop the step, not raise.
Such a strategy implements :class:`OwnsStep`: the rank then gives it a process group of its own (each rank is
its own replica group) and the bare model to wrap, and the loop asks its :class:`StepControl` at both points.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from resilience.state.train import TrainState


class StepControl:
    """The plain step: every step trains from where the loop is, and is applied."""

    def __init__(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None = None) -> None:
        self.optimizer, self.scaler = optimizer, scaler  # fp16: the scaler steps (or skips) and updates its scale

    def begin(self, position: int) -> int:
        """Before the forward pass: return the position (optimizer steps applied) this step trains from."""
        return position

    def commit(self) -> bool:
        """After the backward pass: apply the step and clear the gradients; False: the step was dropped (the state
        is unchanged and the loop trains from ``begin`` again)."""
        if self.scaler is None:
            self.optimizer.step()
        else:  # a step whose gradients overflowed is skipped, and still counts: the scale shrinks instead
            self.scaler.step(self.optimizer)
            self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return True


@runtime_checkable
class OwnsStep(Protocol):
    """A strategy that owns the step (torchft's Manager): it wraps the bare model and decides each step."""

    def step_control(self, state: TrainState) -> StepControl:
        """Wrap ``state.model`` (the bare module) for this strategy's replica group; return its step control."""
