"""resilience-bench: measure fault-tolerance techniques for distributed training under real injected faults."""

__version__ = "0.1.0"
