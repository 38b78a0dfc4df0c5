"""The pipeline matrix's report section (reports/stage_recovery.py), the boundary log's costs in result.json
(record/metrics.py ``stage_log``) and the log's own peak counters (parallel/boundary_log.py)."""

from __future__ import annotations

import matplotlib
import pandas as pd
import pytest
import torch

from reports.matrix import load_matrix
from reports.registry import MEASURED
from reports.stage_recovery import has_stage_cells, stage_recovery, stage_recovery_note, stage_table
from resilience.parallel.boundary_log import FORWARD, BoundaryLog, sends_logged
from resilience.record.metrics import _stage_log

matplotlib.use("Agg")
pytestmark = pytest.mark.timeout(60)


def runs(parallel: str, technique: str, fault: str, n: int = 3, world: int = 2, **fields) -> list[dict]:
    """``n`` ok runs of one cell; each field a value for all or a list of one per run."""
    rows = []
    for i in range(n):
        row = {"state": "ok", "cell": f"{parallel}-{technique}-{fault}-{i}", "cell.parallel": parallel,
               "parallel": f"{parallel} 2" if parallel == "pp" else f"{parallel} 2x2", "cell.strategy": technique,
               "cell.fault_label": fault, "cell.world_size": world, "matches_reference": True}
        row.update({k: v[i] if isinstance(v, list) else v for k, v in fields.items()})
        rows.append(row)
    return rows


def summary(**changes) -> pd.DataFrame:
    """A small pipeline matrix's summary: pp with none, sync and swift_log, pp_dp with none."""
    killed = {"recovery_time_s": [8.0, 9.0, 10.0], "recovery_breakdown_s.detect": 0.05,
              "recovery_breakdown_s.restart": [6.0, 7.0, 8.0], "recovery_breakdown_s.load": 0.7,
              "recovery_breakdown_s.replay": 0.4, "lost_work_s": 0.4, "lost_steps": 3}
    swift = {**killed, "recovery_time_s": [5.0, 5.5, 6.0], "recovery_breakdown_s.replay": 0.0, "lost_steps": 0,
             "lost_work_s": 0.0, "stage_log.replayed_stage_steps": 3, "stage_log.replay_s": [0.2, 0.25, 0.3]}
    frame = pd.DataFrame(
        runs("pp", "none", "none", step_time_s=[0.050, 0.052, 0.054], host_memory_peak_bytes=1e9)
        + runs("pp", "sync", "none", step_time_s=[0.060, 0.061, 0.062], host_memory_peak_bytes=1e9)
        + runs("pp", "sync", "kill", **killed)
        + runs("pp", "swift_log", "none", step_time_s=[0.055, 0.056, 0.057], host_memory_peak_bytes=1.1e9,
               **{"stage_log.bytes_per_step": 524288, "stage_log.held_peak_bytes": 2097152})
        + runs("pp", "swift_log", "kill", **{**swift, "stage_log.bytes_per_step": 524288})
        + runs("pp_dp", "none", "none", world=4, step_time_s=[0.14, 0.15, 0.16]))
    for key, value in changes.items():
        frame[key] = value
    return frame


def test_one_row_per_setting_and_technique_set_against_none_with_what_the_log_and_the_recovery_cost():
    rows = stage_table(summary()).set_index(["parallel", "technique"])
    assert list(rows.index) == [("pp 2", "none"), ("pp 2", "sync"), ("pp 2", "swift_log"), ("pp_dp 2x2", "none")]
    swift, sync = rows.loc[("pp 2", "swift_log")], rows.loc[("pp 2", "sync")]
    assert swift["step_ms"] == pytest.approx(56.0) and swift["vs_none"].startswith("x1.077")
    assert swift["log_B_step"] == 524288 and swift["log_held_MB"] == pytest.approx(2.097152)
    assert pd.isna(sync["log_B_step"])  # sync keeps no log: "-", not 0 bytes measured
    assert sync["recovery_s"] == 9.0 and sync["restart_s"] == 7.0 and sync["recovery_s_n"] == 3
    assert sync["lost_steps"] == 3 and sync["recomputed"] == 6  # both stages train steps 4-6 again
    assert swift["lost_steps"] == 0 and swift["recomputed"] == 3  # the lost stage replays them alone
    assert swift["stage_replay_s"] == 0.25 and pd.isna(sync["stage_replay_s"])
    assert swift["bit_exact"] == "yes" and swift["noisy"] == "0 of 6"
    assert rows.loc[("pp_dp 2x2", "none"), "vs_none"] == "-"  # none of each setting is its own baseline


def test_noisy_runs_leave_the_timings_but_keep_their_counts_and_the_table_says_how_many():
    frame = summary()
    busy = (frame["cell.strategy"] == "sync") & (frame["cell.fault_label"] == "kill")
    frame.loc[busy, "validity.verdict"] = "noisy"
    sync = stage_table(frame).set_index(["parallel", "technique"]).loc[("pp 2", "sync")]
    assert pd.isna(sync["recovery_s"]) and sync["lost_steps"] == 3 and sync["noisy"] == "3 of 6"


def test_the_section_renders_and_changes_with_the_data():
    before = stage_recovery_note(summary())
    after = stage_recovery_note(summary(**{"stage_log.held_peak_bytes": 4194304}))
    assert "swift_log" in before and "log held" in before and before != after
    fig, data = stage_recovery(summary())
    assert len(fig.axes) >= 2 and len(data) == 4
    assert not has_stage_cells(summary(**{"cell.parallel": "ddp"}))
    assert MEASURED["stage_recovery"].applies(summary())


def test_the_pipeline_matrix_sets_every_technique_beside_none_under_both_settings_three_times():
    cells = load_matrix("pipeline").cells
    seen = {(c.values["parallel"], c.values["strategy"], c.values["fault"].name) for c in cells}
    assert seen == {(p, s, f) for p, ss in (("pp", ("none", "sync", "swift_log", "swift_log_selective")),
                                            ("pp_dp", ("none", "sync", "replica")))
                    for s in ss for f in ("none", "kill") if not (s == "none" and f == "kill")}
    assert all(sum(1 for c in cells if (c.values["parallel"], c.values["strategy"], c.values["fault"].name) == k)
               == 3 for k in seen)


def test_the_log_keeps_its_peak_and_its_largest_step_past_a_discard():
    log = BoundaryLog(frozenset({FORWARD}))
    for step in range(4):
        log.begin(step)
        log.record(FORWARD, 0, [torch.zeros(256)])  # 1 KiB a step
    log.discard_before(4)
    stats = log.stats()
    assert stats["held_bytes"] == 0 and stats["held_peak"] == 4096 and stats["step_bytes_max"] == 1024
    assert sends_logged(0, 2, every=2) == frozenset()  # selective on 2 stages: nothing logged


def test_result_json_sums_the_stages_log_and_counts_the_replayed_steps():
    discarded = lambda rank, peak, per_step: {"kind": "log_discarded", "rank": rank, "held_peak": peak,  # noqa: E731
                                              "step_bytes_max": per_step}
    got = _stage_log([discarded(0, 1000, 250), discarded(1, 800, 200), discarded(0, 1200, 300),
                      {"kind": "stage_replayed", "rank": 1, "steps": 3, "duration_s": 0.2, "received_bytes": 900}])
    assert got == {"bytes_per_step": 500, "held_peak_bytes": 2000, "replayed_stage_steps": 3, "replay_s": 0.2,
                   "received_bytes": 900}
    assert _stage_log([{"kind": "step_end", "rank": 0}]) is None
