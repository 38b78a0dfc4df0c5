"""make gpu-check can only run where a GPU is (docs/gpu.md); here its plan is composed and its script parsed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from resilience.bench import gpu_check

ROOT = Path(__file__).resolve().parents[1]


def test_the_dry_run_composes_every_run(capsys):
    assert gpu_check.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("ok  ") == len(gpu_check.RUNS) + len(gpu_check.DIRECT)
    assert all(f"ok  {c.name}: python -m resilience " in out for c in gpu_check.RUNS)


def test_an_unknown_check_is_refused_in_one_line():
    done = subprocess.run([sys.executable, "-m", "resilience.bench.gpu_check", "--only", "nope", "--dry-run"],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2 and "--only: unknown check(s) nope" in done.stderr


def test_without_a_gpu_it_says_so(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--only", "nvml_health"]) == 2


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(ROOT / "workflow/gpu/check.sh")]).returncode == 0

