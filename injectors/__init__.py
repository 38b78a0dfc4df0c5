"""Fault injectors: each changes what a rank process really experiences, at a planned (rank, step, phase)."""
