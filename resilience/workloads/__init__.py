"""Workloads: a model, its optimizer and a deterministic data stream, behind ``Workload``."""
