"""Report rendering for the benchmark matrix (the pipeline's report stage)."""
