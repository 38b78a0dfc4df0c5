"""HSDP replica recovery (issue 18 item 4, docs/sharded.md): a killed rank's replacement receives its shard from the
rank holding the same shard in the other replica group, the survivors are not restarted, the bytes moved are one
shard's parameters and AdamW state, and the run ends on the fault-free run's hash. ``parallel=fsdp`` (no replica)
and our reduced-width mode are refused in one line (torchft's HSDP healing: tests/test_torchft_hsdp.py).

The end-to-end pair (4 gloo ranks each) is slow on a small machine and marked so."""

from __future__ import annotations

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from conftest import ROOT, run_experiment
from resilience.__main__ import precheck
from resilience.config import ConfigError, check_group_choices
from resilience.record.events import read_events

HSDP = ("parallel=hsdp", "world_size=4", "strategy=replica")
COMMON = (*HSDP, "workload=gpt_tiny", "steps=8", "seed=0", "detector=[process_exit]")
REFUSED = [
    (("parallel=fsdp", "world_size=4", "strategy=replica"), "parallel=fsdp", "parallel=hsdp"),
    ((*HSDP, "strategy.while_replacing=continue"), "strategy=replica", "while_replacing=wait"),
]


def _check(argv: list[str]) -> None:
    check_group_choices(argv)
    precheck(argv)


@pytest.mark.parametrize("overrides,setting,allowed", REFUSED, ids=[r[0][-1] for r in REFUSED])
def test_replica_without_a_replica_of_each_shard_is_one_clear_line(tmp_path, overrides, setting, allowed):
    with pytest.raises(ConfigError) as info:
        _check([*overrides, f"hydra.run.dir={tmp_path / 'run'}"])
    line = str(info.value)
    assert "\n" not in line and setting in line and allowed in line, line


def test_hsdp_replica_passes(tmp_path):
    _check([*HSDP, f"hydra.run.dir={tmp_path / 'run'}"])


def one_shard_bytes(shard: int, shards: int) -> int:
    """gpt_tiny's shard ``shard`` as FSDP2 cuts it (dim 0, ``torch.chunk``): each parameter's rows and its two
    AdamW moments, fp32, plus AdamW's 0-d fp32 step per parameter."""
    wl = instantiate(OmegaConf.load(ROOT / "conf" / "workload" / "gpt_tiny.yaml"), seed=0)
    with torch.device("meta"):
        params = list(wl.build_model().parameters())
    rows = [p.chunk(shards, dim=0) for p in params]
    return sum(3 * 4 * (r[shard].numel() if shard < len(r) else 0) + 4 for r in rows)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_hsdp_replica_moves_one_shard_and_ends_bit_exact(tmp_path):
    ref = run_experiment(tmp_path / "ref", *COMMON, "fault=none", timeout=400)
    hit = run_experiment(tmp_path / "hit", *COMMON, "fault=kill", "fault.rank=1", "fault.at_step=5", timeout=400)
    assert ref["status"] == hit["status"] == "ok"
    assert hit["recovered"] is True
    assert hit["final_state_sha256"] == ref["final_state_sha256"]
    events = read_events(tmp_path / "hit")
    starts = [(e["rank"], e["attempt"]) for e in events if e["kind"] == "run_start"]
    assert sorted(starts) == [(0, 0), (1, 0), (1, 1), (2, 0), (3, 0)]  # only the killed rank started again
    heal = [e for e in events if e["kind"] == "replica_heal"]
    assert len(heal) == 1 and heal[0]["rank"] == 1
    # rank 1 is shard 1 of replica 0 (2x2 mesh): its twin is rank 3, shard 1 of replica 1
    assert heal[0]["source"] == "replica:3"
    assert heal[0]["bytes"] == hit["heal_bytes"] == one_shard_bytes(1, 2)
    sent = [e for e in events if e["kind"] == "rejoined" and e["bytes"]]
    assert [(e["rank"], e["bytes"]) for e in sent] == [(3, one_shard_bytes(1, 2))]  # no other rank moved state
