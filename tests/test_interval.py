"""checkpoint.every=auto (resilience.strategies.interval): the rules' arithmetic, the calibration and the choices
a rank makes from its timings, and a real run that recovers bit-exact at the steps it chose."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import run_experiment
from resilience.projection.intervals import optimal_interval
from resilience.record.events import EventLog, read_events
from resilience.strategies import interval as iv
from resilience.strategies.interval import AutoInterval, Costs, Interval, interval_of


def auto(**kw) -> AutoInterval:
    a = AutoInterval(**({} if "mtbf_steps" in kw or "mtbf_s" in kw else {"mtbf_s": 100.0}), **kw)
    a.check()
    return a


def test_the_rules_arithmetic():
    c = Costs(stall_s=0.5, step_s=0.1, mtbf_s=100.0)
    assert auto(rule="young").choose(c)[0] == round(math.sqrt(2 * 0.5 * 100) / 0.1)  # 100 steps
    assert auto(rule="optimal").choose(c)[0] == round(optimal_interval(0.5, 100.0) / 0.1)
    assert auto(rule="daly").choose(c)[0] != auto(rule="young").choose(c)[0]  # the higher-order terms
    # checkfreq: the most frequent within the budget: 0.5 s per checkpoint at <= 5% of 0.1 s steps: 100 steps
    every, why = auto(rule="checkfreq", budget=0.05).choose(c)
    assert every == 100 and "checkfreq" in why and "= 100 steps" in why
    # a budget caps the others: young's 100 steps cost 5%; at 1% it must be 500
    every, why = auto(rule="young", budget=0.01).choose(c)
    assert every == 500 and "lengthened to budget 0.01" in why
    assert auto(rule="young", max_every=7).choose(c) == (7, pytest.approx(auto(rule="young", max_every=7).choose(c)[1]))
    assert "capped at max_every" in auto(rule="young", max_every=7).choose(c)[1]


@pytest.mark.parametrize("every,auto_settings,message", [
    ("abc", None, "checkpoint.every=abc: must be an integer >= 1, or auto"),
    (0, None, "checkpoint.every=0: must be an integer >= 1, or auto"),
    ("auto", {"rule": "fast", "mtbf_s": 1.0}, "checkpoint.auto.rule=fast: must be one of"),
    ("auto", {"rule": "checkfreq", "mtbf_s": 1.0}, "checkpoint.auto.rule=checkfreq: give checkpoint.auto.budget"),
])
def test_bad_settings_name_the_setting(every, auto_settings, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        interval_of(every, auto_settings)


def test_the_failure_rate_is_required_only_where_checkpoints_are_taken():
    a = interval_of("auto", {})  # a run that never saves (the reference) builds it
    with pytest.raises(ValueError, match="exactly one of checkpoint.auto.mtbf_s or checkpoint.auto.mtbf_steps"):
        a.check()
    with pytest.raises(ValueError, match="exactly one"):
        interval_of("auto", {"mtbf_s": 5.0, "mtbf_steps": 50}).check()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def rank(tmp_path: Path, rank: int = 0) -> SimpleNamespace:
    return SimpleNamespace(rank=rank, run_dir=tmp_path, device=torch.device("cpu"), events=EventLog(tmp_path, rank, 0))


def train(a: AutoInterval, clock: Clock, first: int, last: int, step_s: float, stall_s: float) -> list[int]:
    """Drive ``a`` as the trainer and a strategy do: due() at every step's end, saved() after a due one's stall."""
    saved = []
    for step in range(first, last + 1):
        clock.now += step_s
        if a.due(step, 10_000) and a.due(step, 10_000):  # save() asks again: the second call times nothing
            clock.now += stall_s
            a.saved(step, stall_s)
            saved.append(step)
    return saved


def test_calibrates_then_chooses_from_the_timed_costs_and_a_restart_goes_on_from_the_choice(tmp_path, monkeypatch):
    clock = Clock()
    monkeypatch.setattr(iv.time, "monotonic", clock)
    a = auto(rule="young", mtbf_steps=1000, first=5, calibration=2)
    a.attach(rank(tmp_path))
    saved = train(a, clock, 1, 80, step_s=0.1, stall_s=0.2)
    # steps 5 and 10 timed at the first interval; then young: sqrt(2 x 0.2 x (1000 x 0.1)) = 6.32 s = 63 steps
    assert saved[:3] == [5, 10, 73]
    [chosen] = [e for e in read_events(tmp_path) if e["kind"] == "ckpt_interval"]
    assert chosen["step"] == 10 and chosen["interval"] == 63
    assert chosen["step_s"] == pytest.approx(0.1) and chosen["stall_s"] == pytest.approx(0.2)  # stall taken off
    # a new attempt (restarted from step 73) starts at the choice: no calibration, the first save 63 steps on
    b = auto(rule="young", mtbf_steps=1000, first=5, calibration=2)
    b.attach(rank(tmp_path))
    assert b.every == 63 and train(b, clock, 74, 140, step_s=0.1, stall_s=0.2) == [136]


def test_a_slower_save_is_followed(tmp_path, monkeypatch):
    clock = Clock()
    monkeypatch.setattr(iv.time, "monotonic", clock)
    a = auto(rule="checkfreq", budget=0.1, mtbf_s=1e6, first=2, calibration=1)
    a.attach(rank(tmp_path))
    train(a, clock, 1, 30, step_s=0.1, stall_s=0.2)  # 0.2 s at <= 10% of 0.1 s steps: 20 steps
    assert a.every == 20
    train(a, clock, 31, 400, step_s=0.1, stall_s=1.0)  # the saves grew 5x: the median of the recent ones follows
    assert a.every == 100
    assert [e["interval"] for e in read_events(tmp_path) if e["kind"] == "ckpt_interval"][-1] == 100


def test_a_fixed_interval_is_unchanged():
    i = Interval(5)
    assert [s for s in range(1, 30) if i.due(s, 20)] == [5, 10, 15]


@pytest.mark.timeout(300)
def test_auto_recovers_bit_exact_at_the_steps_it_chose(tmp_path, reference):
    run_dir = tmp_path / "run"
    # The session reference's training (tests/conftest.py: 30 steps on 2 ranks, seed 0), checked against it: the
    # interval does not change the training. Killed at step 20, after the choice at step 6 (below).
    r = run_experiment(run_dir, "strategy=sync", "checkpoint.every=auto", "checkpoint.auto.mtbf_steps=40",
                       "checkpoint.auto.first=3", "steps=30", "world_size=2", "seed=0", "fault=kill",
                       "fault.rank=1", "fault.at_step=20", "reference.check=none", timeout=240)
    assert r["status"] == "ok" and r["recovered"]
    assert r["final_state_sha256"] == reference["final_state_sha256"]
    assert r["checkpoint_every"] == "auto" and r["checkpoint_intervals"]
    events = read_events(run_dir)
    for attempt in {e["attempt"] for e in events if e["kind"] == "ckpt_begin"}:
        steps = {rk: [e["step"] for e in events if e["kind"] == "ckpt_begin" and e["rank"] == rk
                      and e["attempt"] == attempt] for rk in (0, 1)}
        assert steps[0] == steps[1]  # every rank saved at the same steps (a save is collective)
    first = [e["step"] for e in events if e["kind"] == "ckpt_begin" and e["rank"] == 0 and e["attempt"] == 0]
    choice = r["checkpoint_intervals"][0]
    assert first[:2] == [3, 6] and choice["step"] == 6  # timed at `first`, chosen after `calibration` saves
    if len(first) > 2:
        assert first[2] == 6 + choice["interval"]


def test_a_matrix_runs_auto_as_its_own_technique():
    import pandas as pd

    from reports.matrix import load_matrix
    from reports.tables import way

    cells = load_matrix("techniques").cells  # (every cell composed as the command would: tests/test_pipeline.py)
    auto = [c for c in cells if c.values["checkpoint.every"] == "auto"]
    assert auto and all("checkpoint.every=auto" in c.overrides for c in auto)
    frame = pd.DataFrame({"cell.strategy": ["sync", "sync"], "cell.checkpoint.every": [4, "auto"]})
    assert list(way(frame)) == ["sync", "sync (every=auto)"]  # not pooled with the fixed interval's runs


def test_a_summary_with_auto_beside_fixed_intervals_is_written(tmp_path):
    import pandas as pd

    from reports.aggregate import write

    frame = pd.DataFrame({"cell": ["a", "b"], "cell.checkpoint.every": [4, "auto"], "checkpoint_every": [4, "auto"]})
    csv, parquet = write(frame, tmp_path / "summary.csv")  # Parquet holds one type per column
    back = pd.read_parquet(parquet)
    assert list(back["cell.checkpoint.every"]) == ["4", "auto"] and csv.exists()


def test_a_stopped_bench_goes_on_from_its_finished_runs_and_runs_the_others_again(tmp_path, monkeypatch):
    """``--reuse`` (bench.auto_interval, bench.trace): a run that finished ok is measured from its result; one that
    failed or wrote none (cut by a full disk, 2026-11-28) runs again from nothing."""
    from resilience.bench import experiment

    ran = []

    def run_afresh(run_dir, overrides, timeout_s):
        ran.append(run_dir.name)
        return {"status": "ok"}, 0

    monkeypatch.setattr(experiment, "run_afresh", run_afresh)
    for name, status in (("finished", "ok"), ("failed", "failed")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "result.json").write_text(f'{{"status": "{status}", "steps": 7}}')
    (tmp_path / "cut").mkdir()
    assert experiment.run_or_reuse(tmp_path / "finished", [], reuse=True) == ({"status": "ok", "steps": 7}, 0)
    assert ran == []
    for name in ("failed", "cut"):
        assert experiment.run_or_reuse(tmp_path / name, [], reuse=True) == ({"status": "ok"}, 0)
    experiment.run_or_reuse(tmp_path / "finished", [], reuse=False)
    assert ran == ["failed", "cut", "finished"]
