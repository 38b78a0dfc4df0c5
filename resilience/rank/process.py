"""What a rank process sets up for itself before it trains, a warm spare's too: kernels that give the same bits on
every run, and its own log for what it writes to stderr."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch


def configure_determinism(device: torch.device, threads: int) -> None:
    """Settings that make a step bit-reproducible on one machine (documented in the README)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS reductions
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(threads)  # CPU kernels split work by thread count: keep it fixed per rank
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = False
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def redirect_output(run_dir: Path, name: str, header: str) -> None:
    """Send this process's stderr (tracebacks, library warnings) to ``logs/<name>.log``; stdout stays on the
    console."""
    log_dir = run_dir / "logs"
    log_dir.mkdir(exist_ok=True)
    fd = os.open(log_dir / f"{name}.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    print(f"=== {header} pid {os.getpid()} ===", file=sys.stderr, flush=True)
