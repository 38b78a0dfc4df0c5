"""Failure detectors: each emits ``fault_detected`` events naming the rank it blames."""
