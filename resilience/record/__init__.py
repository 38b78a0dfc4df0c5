"""The run's record: the event log (ground truth), the heartbeat board, and the metrics computed from them."""
