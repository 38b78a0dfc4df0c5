"""Checkpoint strategies: when and how training state is saved, and where a recovery loads it from."""
