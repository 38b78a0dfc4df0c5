"""Inside one rank process: the group, the training loop and the roles it calls (``python -m resilience.rank``)."""
