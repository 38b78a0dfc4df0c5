"""Recovery policies: what happens after a failure is detected."""
