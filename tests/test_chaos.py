"""ckpt-chaos (the outside crash-consistency tester, an optional extra) over our sync strategy: a crash at sampled
file boundaries of the ranks' saves, the resume, and its verdicts (python -m resilience.bench.chaos)."""

from __future__ import annotations

import importlib.util

import pytest

from resilience.bench import chaos


@pytest.mark.timeout(600)
@pytest.mark.skipif(importlib.util.find_spec("ckpt_chaos") is None,
                    reason="ckpt-chaos is not installed: pip install -c workflow/envs/constraints.txt -e '.[chaos]'")
def test_ckpt_chaos_passes_every_crash_point_of_syncs_saves(tmp_path):
    found = chaos.chaos("sync", tmp_path / "sync", "before,torn", 4, [])
    assert found["points"] == 4 and found["counts"]["PASS"] == 4, found["failed"]
    assert found["exit"] == 0
