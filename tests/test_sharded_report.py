"""The report's sharded rows and the projection's per-shard fit, from synthetic summaries (no runs)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from reports import sharded, stats
from resilience.projection.cost_model import ComponentCost, StrategyCosts
from resilience.projection.measured import fit_strategies
from resilience.projection.sharded import per_shard_fit

GB = 1e9
CKPT = 0.132 * GB  # gpt_small's checkpoint


def _row(cell, parallel, strategy, fault, state="ok", recovery="restart", **fields):
    shards = {"fsdp": 4, "hsdp": 2}[parallel]
    ref = f"ref-{parallel}"
    row = {"cell": cell, "state": state, "is_reference": cell == ref, "reference_cell": ref,
           "cell.parallel": parallel, "cell.strategy": strategy, "cell.fault_label": fault, "cell.recovery": recovery}
    if state != "not run":
        row.update({"strategy": strategy, "parallel.name": parallel, "parallel.shards_per_replica": shards, "ckpt_bytes": CKPT,
                    "validity.verdict": "valid", "final_state_sha256": f"hash-{parallel}", **fields})
    return row


def _events(run_dir, rates: dict[int, tuple[int, float]]):
    """A run's events.jsonl: per attempt, its world size and 5 steps on rank 0 at the given steps per second."""
    run_dir.mkdir(parents=True)
    events = []
    for attempt, (world, rate) in rates.items():
        events.append({"kind": "run_start", "rank": 0, "attempt": attempt, "world_size": world, "t_mono": 0.0})
        events += [{"kind": "step_end", "rank": 0, "attempt": attempt, "t_mono": 100.0 * attempt + i / rate}
                   for i in range(5)]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return str(run_dir)


def _summary(tmp_path=None) -> pd.DataFrame:
    rows = [_row("ref-fsdp", "fsdp", "none", "none", final_loss=1.70),
            _row("ref-hsdp", "hsdp", "none", "none", final_loss=1.71)]
    for i, stall in enumerate((0.50, 0.60, 0.55)):  # three repeats of one fsdp kill cell
        rows.append(_row(f"fsdp-kill-{i}", "fsdp", "sync", "kill", ckpt_stall_s=stall, ckpt_durable_s=stall,
                         recovery_load_s=0.7, recovery_time_s=9.0, matches_reference=True, final_loss=1.70))
    rows.append(_row("hsdp-kill", "hsdp", "sync", "kill", ckpt_stall_s=0.9, ckpt_durable_s=0.9, recovery_load_s=1.1,
                     recovery_time_s=10.0, matches_reference=True, final_loss=1.71))
    run_dir = _events(tmp_path / "shrink", {0: (4, 0.5), 1: (2, 0.8)}) if tmp_path else None
    rows.append(_row("fsdp-shrink", "fsdp", "sync", "node_loss_shrink", recovery="shrink", ckpt_stall_s=0.4,
                     recovery_load_s=0.6, recovery_time_s=8.0, matches_reference=False, final_loss=1.79,
                     run_dir=run_dir))
    rows.append(_row("hsdp-shrink", "hsdp", "dcp_async", "node_loss_shrink", state="invalid", recovery="shrink"))
    rows.append(_row("hsdp-dcp-kill", "hsdp", "dcp_async", "kill", state="not run"))
    return pd.DataFrame(rows)


def test_sharded_rows_render_with_intervals_the_shrink_loss_and_unmeasured_rows(tmp_path):
    table = sharded.sharded_table(_summary(tmp_path)).set_index(["parallel", "strategy", "fault"])
    assert len(table) == 5  # the fault-free references (strategy none) have no row
    kill = table.loc[("fsdp", "sync", "kill")]
    assert kill["shards"] == "4" and kill["save_s"] == pytest.approx(0.55) and kill["save_s_n"] == 3
    assert kill["bit_exact"] == "yes" and pd.isna(kill["loss_delta"])
    assert table.loc[("hsdp", "sync", "kill"), "shards"] == "2"
    shrink = table.loc[("fsdp", "sync", "node_loss_shrink")]
    assert shrink["bit_exact"].startswith("not by design") and shrink["loss_delta"] == pytest.approx(0.09)
    assert shrink["throughput"] == "0.50 -> 0.80 (4 -> 2 ranks; n=1)"  # the reduced size's, from the events
    assert table.loc[("hsdp", "dcp_async", "kill"), "note"] == "not measured (not run)"
    assert table.loc[("hsdp", "dcp_async", "node_loss_shrink"), "note"] == "not measured (error)"

    html = sharded.sharded_note(_summary())
    assert stats.interval_text(3, 0.5, 0.6, exact=False) in html  # n and range under the median
    assert "global batch changes" in html and "not measured (not run)" in html
    assert "<td class=\"text\">save</td>" in html  # the per-shard fit's table
    fig, data = sharded.sharded(_summary())
    assert len(data) == 5 and fig.axes[0].get_yticklabels()
    ddp = _summary().assign(**{"cell.parallel": None})  # a matrix without sharded cells: no rows, no error
    assert sharded.sharded_table(ddp).empty and sharded.sharded_note(ddp) == ""
    assert sharded.sharded_table(pd.DataFrame()).empty


def test_the_per_shard_fit_recovers_the_line_and_is_the_projections():
    a, b = 0.2, 2.0  # seconds = a + b * GB per shard, on the shard counts the sharded matrix measures
    rows = []
    for parallel, shards in (("fsdp", 4), ("hsdp", 2), ("fsdp", 8)):
        seconds = a + b * CKPT / shards / GB
        rows += [{"strategy": "sync", "cell.recovery": "restart", "parallel.name": parallel,
                  "parallel.shards_per_replica": shards, "world_size": 4, "ckpt_bytes": CKPT,
                  "ckpt_stall_s": seconds, "ckpt_durable_s": seconds, "recovery_breakdown_s.load": seconds,
                  "recovery_breakdown_s.restart": 3.0}] * 2
    rows.append({**rows[0], "cell.recovery": "shrink", "ckpt_stall_s": 99.0})  # mixed shard counts: left out
    rows.append({**rows[0], "parallel.name": "ddp", "parallel.shards_per_replica": 1, "ckpt_stall_s": 99.0,
                 "strategy": "async"})  # not sharded: not in the per-shard fit
    frame = pd.DataFrame(rows)
    fit = per_shard_fit(frame).set_index(["strategy", "component"])
    assert list(fit.index.get_level_values(0).unique()) == ["sync"]
    save = fit.loc[("sync", "save")]
    assert save["n"] == 6 and save["shard_counts"] == "2, 4, 8"
    assert save["fixed_s"] == pytest.approx(a) and save["s_per_GB"] == pytest.approx(b)
    assert fit.loc[("sync", "load"), "GBps_per_shard"] == pytest.approx(1 / b)
    restart = ComponentCost(180.0)  # the scenario's: a restart is never fitted (one cost basis at scale)
    costs = fit_strategies(frame, {"sync": StrategyCosts("sync", restart, restart, restart, restart)})["sync"]
    assert costs.restart == restart  # the shrunk row is left out here too
    # with the shard count as writers the strategy's line is the per-shard one: at 1,000 writers of a 1 TB
    # checkpoint each writes 1 GB
    assert costs.stall.seconds(1000 * GB, 1000, None) == pytest.approx(a + b)
    assert np.isclose(costs.stall.fixed_s, a) and np.isclose(costs.load.fixed_s, a)
