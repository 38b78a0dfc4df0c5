"""``python -m resilience.trace``: a recovered run's events as a Trace Event Format file that Perfetto opens.

No trace processor installs here without downloading its binary, so the file is checked against a JSON schema of
the format's events (the Trace Event Format document: ``ph``, ``ts`` in microseconds, ``dur`` of complete events,
``s`` of instants, ``id`` of async events, metadata names) plus the rule Perfetto's JSON importer enforces on
a track: complete events nest, never overlap partly.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import jsonschema  # a dependency of Snakemake
import pytest

from resilience.trace import RECOVERY_TID, main

FIXTURES = Path(__file__).parent / "fixtures" / "runs"
RECOVERED = FIXTURES / "gpt_tiny-sync-kill.phase=before_forward.at_step=7.rank=1-process_exit-every4-ws2-steps12-seed0"

_COMMON = {"pid": {"type": "integer"}, "tid": {"type": "integer"}, "name": {"type": "string"},
           "cat": {"type": "string"}, "args": {"type": "object"}}
_TS = {"type": "number", "minimum": 0}
SCHEMA = {
    "type": "object",
    "required": ["traceEvents"],
    "properties": {
        "displayTimeUnit": {"enum": ["ms", "ns"]},
        "traceEvents": {"type": "array", "minItems": 1, "items": {"oneOf": [
            {"type": "object", "required": ["ph", "name", "pid", "tid", "ts", "dur"],
             "properties": {**_COMMON, "ph": {"const": "X"}, "ts": _TS, "dur": {"type": "number", "minimum": 0}}},
            {"type": "object", "required": ["ph", "name", "pid", "tid", "ts", "s"],
             "properties": {**_COMMON, "ph": {"const": "i"}, "ts": _TS, "s": {"enum": ["g", "p", "t"]}}},
            {"type": "object", "required": ["ph", "name", "cat", "id", "pid", "tid", "ts"],
             "properties": {**_COMMON, "ph": {"enum": ["b", "e"]}, "ts": _TS, "id": {"type": ["integer", "string"]}}},
            {"type": "object", "required": ["ph", "name", "pid", "args"],
             "properties": {**_COMMON, "ph": {"const": "M"},
                            "name": {"enum": ["process_name", "thread_name", "thread_sort_index"]}}},
        ]}},
    },
}


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("trace") / "trace.json"
    assert main([str(RECOVERED), "--out", str(out)]) == 0
    return json.loads(out.read_text())



@pytest.mark.parametrize("run", sorted(p.name for p in FIXTURES.iterdir() if (p / "events.jsonl").exists()))
def test_every_fixture_run_gives_valid_trace_event_format(run, tmp_path):
    out = tmp_path / "trace.json"
    assert main([str(FIXTURES / run), "--out", str(out)]) == 0
    check_format(json.loads(out.read_text()))


def check_format(trace: dict) -> None:
    jsonschema.validate(trace, SCHEMA)
    by_track = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            by_track[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    for track, slices in by_track.items():
        open_ends: list[tuple[float, str]] = []
        for start, end, name in sorted(slices, key=lambda s: (s[0], -s[1])):
            while open_ends and open_ends[-1][0] <= start:
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1][0], f"{track}: {name} overlaps {open_ends[-1][1]} partly"
            open_ends.append((end, name))
    begun = defaultdict(int)
    for e in trace["traceEvents"]:
        if e["ph"] in "be":
            begun[(e["cat"], e["id"])] += 1 if e["ph"] == "b" else -1
    assert set(begun.values()) <= {0}, "every async slice ends"


def test_ranks_are_tracks_with_steps_saves_faults_detections_and_recovery(trace):
    check_format(trace)
    events = trace["traceEvents"]
    tracks = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert tracks == {"supervisor", "rank 0", "rank 1", "recovery"}
    lines = [json.loads(s) for s in (RECOVERED / "events.jsonl").read_text().splitlines()]
    steps = [e for e in events if e.get("cat") in ("step", "lost step")]
    assert len(steps) == sum(e["kind"] == "step_end" for e in lines)
    assert any(e["cat"] == "lost step" for e in steps)  # the killed rank's work after the checkpoint, redone
    assert [e["name"] for e in events if e.get("cat") == "fault"] == ["fault_injected"]
    assert [e["name"] for e in events if e.get("cat") == "detection"] == ["fault_detected"]
    assert any(e["name"].startswith("checkpoint stall") for e in events)
    assert any(e["ph"] == "b" and e["name"].startswith("until durable") for e in events)
    # The recovery track's phases are the breakdown result.json reports, to the microsecond.
    phases = {e["name"]: e["dur"] / 1e6 for e in events if e.get("tid") == RECOVERY_TID and e["ph"] == "X"}
    breakdown = json.loads((RECOVERED / "result.json").read_text())["recovery_breakdown_s"]
    assert phases.keys() == breakdown.keys()
    for phase, seconds in breakdown.items():
        assert phases[phase] == pytest.approx(seconds, abs=2e-6), phase


def test_a_directory_without_events_is_one_line_and_exit_2(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path}: no events.jsonl (or an empty one)"
