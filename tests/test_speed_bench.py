"""The speed benchmark's table: a verdict from each figure against its goal, and the cell breakdown's phases."""

from __future__ import annotations

import json

from resilience.bench import speed
from resilience.bench.cell import PHASES, phases


def test_render_gives_each_row_its_verdict_and_counts_them():
    rows = [speed.Row("cell wall / training", "2.40x", "<= 2x", False, "bench.cell"),
            speed.Row("fingerprint, gpt_tiny", "+0.50%", "<= 2% of step", True),
            speed.unmeasured("default matrix wall time", "<= 15 min", "not measured in this run")]
    text = speed.render(rows, "speed benchmark", ["load line"])
    lines = text.splitlines()
    assert "| cell wall / training | 2.40x | <= 2x | MISSED | bench.cell |" in lines
    assert "| fingerprint, gpt_tiny | +0.50% | <= 2% of step | MET |  |" in lines
    assert "| default matrix wall time | - | <= 15 min | NOT MEASURED | not measured in this run |" in lines
    assert "1 MET, 1 MISSED, 1 NOT MEASURED" in lines
    assert lines[0] == "speed benchmark" and lines[-1] == "load line"


def test_a_failing_section_is_a_row_that_says_why(tmp_path, monkeypatch):
    def broken(out, quick):
        raise RuntimeError("no disk")
    monkeypatch.setitem(speed.SECTIONS, "sync_write", broken)
    (row,) = speed.measure("sync_write", tmp_path, quick=True)
    assert row.verdict == speed.UNMEASURED and "RuntimeError: no disk" in row.note and row.goal == ">= 70%"


def test_matrix_row_from_the_cells_done_records(tmp_path):
    (row,) = speed.matrix_row(tmp_path)
    assert row.verdict == speed.UNMEASURED and "snakemake" in row.note
    for i, (started, elapsed) in enumerate([(1000.0, 300.0), (1200.0, 700.0)]):
        (tmp_path / "runs" / f"c{i}").mkdir(parents=True)
        (tmp_path / "runs" / f"c{i}" / "done.json").write_text(json.dumps({"started": started, "elapsed_s": elapsed}))
    (row,) = speed.matrix_row(tmp_path)
    assert (row.value, row.verdict) == ("15.0 min", speed.MET)  # 1000 s .. 1900 s
    assert str(tmp_path) not in row.note  # docs quote the note: no path of this host in them


def test_cell_phases_partition_the_wall_time():
    ev = lambda kind, t, rank=None: {"kind": kind, "t_wall": t, "rank": rank}  # noqa: E731
    events = [ev("launch", 11.0), ev("run_start", 13.0, 0), ev("run_start", 13.5, 1), ev("run_end", 16.0, 0),
              ev("run_end", 16.2, 1), ev("supervisor_end", 16.5)]
    got = phases(events, started=10.0, ended=17.0, result_written=16.6)
    assert list(got) == list(PHASES)
    assert [round(v, 3) for v in got.values()] == [1.0, 2.0, 3.2, 0.3, 0.1, 0.4]
    assert abs(sum(got.values()) - 7.0) < 1e-9


def test_a_note_cannot_break_the_markdown_row():
    text = speed.render([speed.unmeasured("replica", "<= 1.5x", "failed: a | b\n  c")], "h", [])
    assert "| replica | - | <= 1.5x | NOT MEASURED | failed: a \\| b c |" in text.splitlines()
