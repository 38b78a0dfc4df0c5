"""How a failure trace's arrivals are drawn (``fault.arrivals``; docs/projection.md, "The failure trace"): poisson,
independent exponential gaps (the values a seed always gave), or stratified, a declared variance reduction: blocks
of gaps at stratified quantiles of the exponential, each gap still exponential of the mean, each block close to
its expected span, so the count of failures in a window scatters far less than a Poisson count's sqrt(K)."""

from __future__ import annotations

import math
import random
import statistics
from itertools import islice

import pandas as pd
import pytest

from conftest import refusal
from injectors import wall_striker
from injectors.trace import BLOCK, Trace, arrivals, draw, draw_wall, stratified_block, stratified_times
from injectors.wall_striker import WallStriker
from resilience.bench import trace as bench
from resilience.bench.trace_wall import ARRIVALS, Cycle, predict_wall
from resilience.projection.run_model import RunCosts
from resilience.record.board import create_board
from resilience.record.events import EventLog

M = 4.0


def blocks(count: int, seed: int = 5) -> list[list[float]]:
    rng = random.Random(seed)
    return [stratified_block(rng, M) for _ in range(count)]


def test_a_stratified_block_spans_close_to_its_expected_time():
    sums = [sum(b) for b in blocks(2000)]
    # no block is shorter than every stratum at its lower edge: n M - M (n ln n - ln n!), 2.3 M short at n = 16
    floor = M * sum(-math.log(1 - i / BLOCK) for i in range(BLOCK))
    assert min(sums) >= floor > BLOCK * M - 2.4 * M
    # the scatter is the last stratum's tail, about one mean, where BLOCK independent gaps scatter by sqrt(BLOCK)
    assert statistics.pstdev(sums) < 1.2 * M  # a Poisson block's: 4 M
    assert statistics.mean(sums) == pytest.approx(BLOCK * M, rel=0.01)
    assert sum(abs(s - BLOCK * M) <= 0.25 * BLOCK * M for s in sums) / len(sums) > 0.98  # Poisson blocks: ~68%


def test_a_stratified_gap_is_still_exponential_of_the_mean():
    gaps = [g for b in blocks(4000, seed=6) for g in b]
    assert statistics.mean(gaps) == pytest.approx(M, rel=0.01)
    for x in (0.5, 1.0, 3.0):  # the exponential's tail, P(gap > x M) = exp(-x)
        assert sum(g > x * M for g in gaps) / len(gaps) == pytest.approx(math.exp(-x), rel=0.03)
    # one gap per stratum in each block, in a shuffled order: no position in a block is long or short on average
    first = [b[0] for b in blocks(4000, seed=7)]
    assert statistics.mean(first) == pytest.approx(M, rel=0.05)


def test_the_count_in_a_window_scatters_far_less_than_a_poisson_count():
    window, expected = 280.0, 280.0 / M  # K = 70, as a technique of make trace meets
    counts = {how: [len(draw_wall("llama3", M, seed, window, how)) for seed in range(400)]
              for how in ("poisson", "stratified")}
    assert statistics.pstdev(counts["poisson"]) > 7  # sqrt(70) = 8.4
    assert statistics.pstdev(counts["stratified"]) < 4.5  # ~3.2: whole blocks +-1 gap, the partial ones at the ends
    # begun at a seeded phase of a block: the mean is W / M (begun at a block's start it would be ~0.4 short)
    assert statistics.mean(counts["stratified"]) == pytest.approx(expected, abs=0.5)


def test_stratified_times_begin_at_a_seeded_phase_and_are_ordered_after_the_start():
    got = list(islice(stratified_times(random.Random(3), M, start=10.0), 100))
    assert got == sorted(got) and got[0] > 10.0
    assert got != list(islice(stratified_times(random.Random(4), M, start=10.0), 100))


def test_stratified_arrivals_are_a_pure_function_of_the_seed():
    plan = draw_wall("llama3", M, 11, 2000.0, "stratified")
    assert plan == draw_wall("llama3", M, 11, 2000.0, "stratified")
    assert plan != draw_wall("llama3", M, 12, 2000.0, "stratified")
    assert plan != draw_wall("llama3", M, 11, 2000.0, "poisson")
    assert {kind for _, kind in plan} == {"kill", "node_loss"} and 450 <= len(plan) <= 550
    steps = draw("llama3", 40.0, 11, 1, 4000, "stratified")
    assert steps == draw("llama3", 40.0, 11, 1, 4000, "stratified") != draw("llama3", 40.0, 12, 1, 4000, "stratified")
    assert min(steps) >= 1 and max(steps) < 4000


def test_poisson_arrivals_give_the_values_a_seed_always_gave():
    # computed before fault.arrivals existed (commit dd972f1): the default draws what it drew
    assert list(islice(arrivals("llama3", 4.0, 11), 3)) == [
        (0.9950519314411733, "node_loss"), (4.779167471242997, "node_loss"), (7.1704433766717, "node_loss")]
    assert list(islice(arrivals("llama3", 4.0, 11, "poisson"), 3)) == list(islice(arrivals("llama3", 4.0, 11), 3))
    assert len(draw_wall("llama3", 4.0, 11, 300.0)) == 67
    assert list(draw("llama3", 40.0, 11, 1, 300).items()) == [
        (64, "node_loss"), (65, "kill"), (96, "kill"), (104, "kill"), (174, "kill"), (216, "node_loss"),
        (248, "node_loss"), (257, "node_loss"), (287, "node_loss")]


def test_the_injector_plans_and_strikes_the_arrivals_as_drawn(tmp_path, monkeypatch):
    fault = Trace(mtbf_steps=20.0, rank=1, at_step=1, seed=11, arrivals="stratified")
    fault.validate(world_size=2, steps=200, ckpt_every=5)
    assert fault.plan == sorted(draw("llama3", 20.0, 11, 1, 200, "stratified"))
    asked = []
    monkeypatch.setattr(wall_striker, "arrivals", lambda *args: asked.append(args) or iter([]))
    create_board(tmp_path, 2)
    wall = Trace(clock="wall", mtbf_s=1.0, rank=1, seed=11, arrivals="stratified")
    striker = WallStriker(wall, tmp_path, EventLog(tmp_path, rank=None, attempt=0), 2, None, None)
    striker.start()
    striker.stop()
    assert asked == [("llama3", 1.0, 11, "stratified")]


def test_a_bad_arrivals_value_is_refused_in_one_line(tmp_path):
    assert "fault.arrivals=uniform: must be one of poisson, stratified" in refusal(
        tmp_path, ("fault=trace", "steps=40", "fault.arrivals=uniform"))


def test_the_bench_takes_the_arrivals_as_its_own_option_and_names_them_in_the_table(tmp_path, capsys):
    assert bench.main(["--out", str(tmp_path), "fault.arrivals=poisson"]) == 2
    assert "fault.arrivals: set it with --arrivals" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:
        bench.main(["--out", str(tmp_path), "--arrivals", "uniform"])
    assert refused.value.code == 2
    rows = [{"strategy": "sync", "clock": "wall", "arrivals": "stratified", "prediction": how, "measure": m,
             "measured": 1.0, "predicted": 1.05, "error": 0.05, "faults": 60, "in_recoveries": 20}
            for how in ("closed form, failures in wall time", ARRIVALS) for m in ("wall_s", "ettr", "lost_steps")]
    frame = pd.DataFrame(rows)
    table = bench.table(frame).splitlines()
    assert table[0].startswith("| technique | arrivals |") and len(table) == 4
    assert all(line.startswith("| sync | stratified | 60 (20 in recoveries) |") for line in table[2:])
    assert ARRIVALS in table[3]  # the trace's arrivals row is kept
    assert bench.caption(frame).startswith(f"Failure arrivals: stratified: exponential gaps at stratified "
                                           f"quantiles, blocks of {BLOCK}")


def test_a_reused_run_says_how_its_arrivals_were_drawn(tmp_path):
    (tmp_path / "config.yaml").write_text("fault:\n  clock: wall\n")  # a run from before the setting
    assert bench.drawn_arrivals(tmp_path) == "poisson"
    (tmp_path / "config.yaml").write_text("fault:\n  arrivals: stratified\n")
    assert bench.drawn_arrivals(tmp_path) == "stratified"


def test_the_prediction_counts_the_arrivals_as_drawn():
    costs = RunCosts(steps=1000, every=5, step_s=0.07, step_wall_s=0.075, stall_s=0.1, startup_s=5.0,
                     teardown_s=1.0, recovery_s=3.0)
    arrived = predict_wall(Cycle(costs, {"kill": [0.0], "node_loss": [0.0]}), M, 11, how="stratified")[ARRIVALS]
    assert arrived["failures"] == len(draw_wall("llama3", M, 11, arrived["wall_s"] * 1.0001, "stratified"))
