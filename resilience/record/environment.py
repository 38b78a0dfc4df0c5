"""Where a run was measured: ``environment.json`` and the provenance fields of ``result.json``.

``capture()`` is what PyTorch's bug reports carry (``torch.utils.collect_env``: OS, compilers, CUDA, GPUs, pip and
conda packages, lscpu), under ``collect_env``, plus what the benchmark needs beside it (host, CPU model, cores
this process may use, memory, GPU count, the versions of the libraries that shape the numbers, the git commit).
It starts a few programs (pip, lscpu, nvidia-smi): 0.4-0.6 s here after torch is imported. The pipeline therefore
captures it once per pipeline run, in its probe snapshot, and each cell's ``result.json`` names that file
(``RB_ENVIRONMENT``); a run outside the pipeline writes its own ``environment.json``.

``python -m resilience.record.environment OUT_JSON`` writes one.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from resilience.record.fsio import atomic_write_json

ENVIRONMENT_FILE = "environment.json"
ENV_VAR = "RB_ENVIRONMENT"  # the pipeline's environment.json, which its cells name instead of capturing their own
NOT_GIT = "not a git checkout"
CHECKOUT = Path(__file__).resolve().parents[2]  # the code that ran, wherever the run directory is
VERSIONS = ("torch", "hydra-core", "snakemake", "pandas", "seaborn")
# The collect_env fields a report shows beside the benchmark's own (its package lists and lscpu stay in the file).
COLLECT_ENV_SHOWN = ("os", "libc_version", "gcc_version", "python_platform", "is_cuda_available",
                     "cuda_runtime_version", "nvidia_driver_version", "nvidia_gpu_models", "cudnn_version")


def git_commit(checkout: Path = CHECKOUT) -> dict[str, Any]:
    """The commit of the code that ran and whether files differed from it, or ``not a git checkout``."""
    try:
        head = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return {"git_commit": NOT_GIT, "git_dirty": None}
        dirty = subprocess.run(["git", "-C", str(checkout), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30)
        return {"git_commit": head.stdout.strip(), "git_dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.TimeoutExpired):  # no git program, or a hung file system
        return {"git_commit": NOT_GIT, "git_dirty": None}


def versions() -> dict[str, Any]:
    """Python's and the benchmark libraries' versions (None where one is not installed)."""
    out: dict[str, Any] = {"python": platform.python_version()}
    for package in VERSIONS:
        try:
            out[f"{package}_version"] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            out[f"{package}_version"] = None
    return out


def benchmark_needs() -> dict[str, Any]:
    """Host, CPU, memory, GPU and versions: what a reader of the numbers asks first."""
    env: dict[str, Any] = {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpu_model": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_GiB": _memory_gib(),
        **versions(),
        **git_commit(),
    }
    try:
        import torch

        env["gpu_count"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
        env["gpu_model"] = torch.cuda.get_device_name(0) if env["gpu_count"] else None
        env["cuda_version"] = torch.version.cuda
        env["torch_threads"] = torch.get_num_threads()
    except Exception as exc:  # the environment is informative; it must not fail a run
        env["gpu_error"] = f"{type(exc).__name__}: {exc}"
    return env


def collect_env() -> dict[str, Any]:
    """``torch.utils.collect_env.get_env_info()`` as a mapping (its fields, as PyTorch names them)."""
    try:
        from torch.utils import collect_env as ce

        return dict(ce.get_env_info()._asdict())
    except Exception as exc:  # collect_env runs programs that may be missing or hang; say so, go on
        return {"error": f"{type(exc).__name__}: {exc}"}


def capture() -> dict[str, Any]:
    return {**benchmark_needs(), "collect_env": collect_env()}


def write(path: Path) -> dict[str, Any]:
    env = capture()
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, env)
    return env


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m resilience.record.environment OUT_JSON")
    write(Path(sys.argv[1]))
