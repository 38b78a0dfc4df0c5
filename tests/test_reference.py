"""Every run says whether it ended on the fault-free run's state (``result.json``'s ``reference``)."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from conftest import ROOT
from resilience.config import resolve
from resilience.record.reference import judge, reference_overrides, said, training_key
from resilience.settings.schema import SCHEMA_NAME  # noqa: F401 - registers the settings' schema that config.yaml names


def config(tmp_path: Path, *overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
    cfg = resolve(cfg, tmp_path / "run", {"strategy": "sync"})
    with open_dict(cfg):
        cfg.reference.index = str(tmp_path / "index")
    return cfg


def result(strategy: str, fault: str, sha: str | None, **extra) -> dict:
    return {"strategy": strategy, "fault": fault, "status": "ok", "final_state_sha256": sha,
            "provenance": {"torch": "2.13.0"}, **extra}


def test_a_fault_free_run_of_no_strategy_is_the_reference_and_later_runs_are_judged_against_it(tmp_path):
    cfg = config(tmp_path)
    first = judge(cfg, tmp_path / "ref", result("none", "none", "a" * 64), [])
    assert first["matches"] is None and "is the reference" in first["why"]
    same = judge(cfg, tmp_path / "k1", result("sync", "kill", "a" * 64), [])
    assert same["matches"] is True and same["run_dir"] == str(tmp_path / "ref")
    diverged = judge(cfg, tmp_path / "k2", result("sync", "ckpt_damage", "b" * 64), [])
    assert diverged["matches"] is False and "DIFFERS" in said(diverged)


def test_two_fault_free_runs_that_differ_are_reported_as_such_never_as_a_strategys_fault(tmp_path):
    cfg = config(tmp_path)
    judge(cfg, tmp_path / "ref", result("none", "none", "a" * 64), [])
    again = judge(cfg, tmp_path / "ref2", result("none", "none", "c" * 64), [])
    assert again["matches"] is False and "not deterministic" in again["why"]


def test_without_a_recorded_reference_a_run_says_not_checked_and_how_to_get_one(tmp_path):
    cfg = config(tmp_path)
    v = judge(cfg, tmp_path / "k", result("sync", "kill", "a" * 64), [])
    assert v["matches"] is None and "strategy=none fault=none" in v["why"] and "not checked" in said(v)
    off = judge(config(tmp_path, "reference.check=none"), tmp_path / "k", result("sync", "kill", "a" * 64), [])
    assert off == {"matches": None, "why": "reference.check=none"}


def test_a_run_that_cannot_match_by_design_or_has_no_final_state_is_not_compared(tmp_path):
    cfg = config(tmp_path)
    judge(cfg, tmp_path / "ref", result("none", "none", "a" * 64), [])
    shrunk = judge(cfg, tmp_path / "s", result("sync", "kill", "b" * 64, world_resizes=[[2, 1]]), [])
    assert shrunk["matches"] is None and "world size changed" in shrunk["why"]
    lost = judge(cfg, tmp_path / "u", result("sync", "kill", None), [])
    assert lost["matches"] is None and "no final state" in lost["why"]


def test_the_key_is_the_training_not_the_technique(tmp_path):
    base = training_key(config(tmp_path), "2.13.0")
    assert training_key(config(tmp_path, "strategy=async", "fault=kill", "checkpoint.every=3"), "2.13.0") == base
    for other in ("seed=1", "steps=31", "world_size=3", "workload=gpt_small", "parallel=fsdp"):
        assert training_key(config(tmp_path, other), "2.13.0") != base, other
    assert training_key(config(tmp_path), "2.14.0") != base


def test_the_reference_command_keeps_the_training_and_drops_the_technique():
    kept = reference_overrides(["strategy=async", "fault=kill", "fault.at_step=3", "workload=gpt_small",
                                "workload.lr=0.1", "steps=20", "+parallel.reduce=ordered", "checkpoint.every=2",
                                "detector=[heartbeat]", "world_size=3"], Path("/idx"))
    # checkpoint.every is kept: where the real loop hashes its parts (train=real), the reference hashes too
    assert kept == ["workload=gpt_small", "workload.lr=0.1", "steps=20", "+parallel.reduce=ordered",
                    "checkpoint.every=2", "world_size=3", "strategy=none", "fault=none", "detector=[process_exit]",
                    "reference.index='/idx'"]
