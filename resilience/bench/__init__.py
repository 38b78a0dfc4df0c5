"""Commands that run whole experiments or time one mechanism: probe, compare, coverage, demo, benchmarks."""
