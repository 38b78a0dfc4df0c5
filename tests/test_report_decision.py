"""The report's decision section (issue 31, item 1): the technique that leads each question, called only where the
95% intervals of the medians separate, with a rank test's p beside; "no difference shown at n=..." with the n that
would show one otherwise; trade-off sentences made from the data (changing the data changes them); a technique
with fewer than 6 timed runs is named, never compared."""

from __future__ import annotations

import pandas as pd
import pytest

from reports import decision, stats


def runs(strategy: str, n: int = 6, fault: str = "none", **metrics: float) -> list[dict]:
    """n ok runs of ``strategy``, each metric spread by +-2% around the value given."""
    return [{"cell.workload": "gpt_tiny", "cell.strategy": strategy, "cell.fault_label": fault, "cell.fault": fault,
             "state": "ok",
             "validity.verdict": "valid", "steps": 20, **{k: v * (0.98 + 0.008 * i) for k, v in metrics.items()}}
            for i in range(n)]


def frame(*groups: list[dict]) -> pd.DataFrame:
    return pd.DataFrame([r for g in groups for r in g])


def answers(summary: pd.DataFrame) -> dict[str, decision.Answer]:
    (part,) = decision.section_data(summary).values()
    return {a.question.key: a for a in part.answers}


def test_a_leader_is_called_only_where_the_intervals_separate():
    apart = answers(frame(runs("async", ckpt_stall_s=0.005), runs("sync", ckpt_stall_s=0.08)))["stall"]
    said = apart.sentence()
    assert said.startswith("async leads: 0.005") and "against sync's 0.08" in said
    assert "rank test p=0.0022" in said  # 6 against 6, every run apart: 2 of the 924 groupings
    close = answers(frame(runs("async", ckpt_stall_s=0.080), runs("sync", ckpt_stall_s=0.0801)))["stall"]
    said = close.sentence()
    assert said.startswith("No difference shown between") and "at n=6/6" in said
    assert stats.NO_95 not in said and "n too small" not in said


def test_the_trade_off_sentences_follow_the_data():
    one_way = frame(runs("async", ckpt_stall_s=0.005, ckpt_durable_s=0.12),
                    runs("sync", ckpt_stall_s=0.08, ckpt_durable_s=0.08))
    (part,) = decision.section_data(one_way).values()
    assert part.trade_offs == ["async stalls training less per checkpoint than sync (x0.06), but sync has its "
                               "checkpoints durable sooner (x0.67)."]
    other_way = frame(runs("async", ckpt_stall_s=0.005, ckpt_durable_s=0.05),
                      runs("sync", ckpt_stall_s=0.08, ckpt_durable_s=0.08))
    (part,) = decision.section_data(other_way).values()
    assert part.trade_offs[0].startswith("No trade-off shown")


def test_fewer_than_six_timed_runs_are_named_not_compared_and_noisy_runs_do_not_count():
    noisy = runs("sync", ckpt_stall_s=0.08)
    noisy[0]["validity.verdict"] = "noisy"
    summary = frame(runs("async", ckpt_stall_s=0.005), noisy, runs("dcp_async", n=3, ckpt_stall_s=0.01),
                    runs("inmemory", ckpt_stall_s=0.006))
    stall = answers(summary)["stall"]
    assert list(stall.medians) == ["async", "inmemory"] and stall.fewer == {"sync": 5, "dcp_async": 3}
    assert "not compared here: sync (n=5), dcp_async (n=3)" in stall.sentence()


def test_step_time_is_answered_against_no_checkpointing_and_faults_get_their_own_questions():
    kill = "kill.phase=before_forward.at_step=13.rank=1"
    summary = frame(runs("none", step_time_s=0.06), runs("sync", step_time_s=0.09),
                    runs("sync", fault=kill, recovery_time_s=3.0, lost_steps=3, ettr=0.3),
                    runs("replica", fault=kill, recovery_time_s=2.0, lost_steps=0, ettr=0.4))
    got = answers(summary)
    assert "Against none (no checkpointing): sync x1.50: slower" in got["step_time"].sentence()
    assert got[f"recovery[{kill}]"].sentence().startswith("replica leads: 2")
    assert got[f"ettr[{kill}]"].names[0] == "replica"  # higher is better
    assert "one fault in a 20-step run" in got[f"ettr[{kill}]"].question.asks


def test_the_rank_test_and_the_runs_needed():
    assert stats.rank_test([1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]) == pytest.approx(2 / 924)
    assert stats.rank_test([1.0] * 6, [1.0] * 6) == 1.0
    assert stats.rank_test([], [1.0]) is None
    a, b = stats.median_interval([1.0, 1.1, 1.2, 1.3, 1.4, 1.5]), stats.median_interval([1.6, 1.7, 1.8, 1.9, 2.0, 2.1])
    assert stats.runs_needed(a, b) == 6  # already apart
    assert stats.runs_needed(a, a) is None  # the same median: no n separates them


def test_the_section_comes_first_in_the_report(tmp_path):
    from reports.render import render

    summary = frame(runs("async", ckpt_stall_s=0.005), runs("sync", ckpt_stall_s=0.08))
    page = render(summary, tmp_path / "index.html", {"name": "t", "source": "-", "description": ""}, {}, {},
                  None).read_text()
    assert page.index('id="decision"') < page.index('id="headline"')
    assert "async leads" in page and (tmp_path / "decision.csv").exists()


def test_a_librarys_row_names_the_workarounds_it_ran_with_and_in_memory_stalls_are_shown():
    from reports import tables

    nvrx = runs("nvrx_async", ckpt_stall_s=0.02, ckpt_count=4, ckpt_bytes=1e7, ckpt_durable_s=0.9)
    for r in nvrx:
        r["peer_patches"] = '["cuda_synchronize", "cpu_staging_copy"]'
    memory = runs("inmemory", ckpt_stall_s=0.005, ckpt_count=0)  # snapshots: a stall, never a durable checkpoint
    head = tables.headline_strategies(frame(nvrx, memory), {}).set_index("strategy")
    assert head.at["nvrx_async", "workarounds"] == "cuda_synchronize, cpu_staging_copy"
    assert head.at["inmemory", "workarounds"] == "" and head.at["inmemory", "ckpt_stall_s_n"] == 6
