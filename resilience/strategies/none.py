"""No checkpoints: a recovery restarts training from step 0. The baseline that every strategy must beat."""

from __future__ import annotations

from resilience.caps import StrategyCaps
from resilience.state.train import TrainState
from resilience.strategies.base import CheckpointStrategy


class NoCheckpoint(CheckpointStrategy):
    caps = StrategyCaps(saves=False)

    def _save(self, step: int, state: TrainState) -> None:
        raise AssertionError("NoCheckpoint never saves")

    def _load(self, state: TrainState) -> tuple[int, str, int] | None:
        return None
