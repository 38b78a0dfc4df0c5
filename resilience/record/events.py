"""The run's event log: one JSON object per line in ``events.jsonl``, shared by the supervisor and every rank.

Every metric in ``result.json`` is derived from this file (see ``resilience.record.metrics``), so the log is the ground
truth of a run. Each event is appended with a single ``os.write`` on an ``O_APPEND`` descriptor: on a local file
system concurrent appends from several processes never interleave within a line, and a process killed with
SIGKILL loses at most the event it had not yet written.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Iterator

from resilience.record import catalogue

EVENTS_FILE = "events.jsonl"


class EventLog:
    """Appends events for one process (a rank, or the supervisor with ``rank=None``)."""

    def __init__(self, run_dir: str | Path, rank: int | None, attempt: int) -> None:
        self.path = Path(run_dir) / EVENTS_FILE
        self.rank = rank
        self.attempt = attempt
        self.step = 0
        self._host = socket.gethostname()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def emit(self, kind: str, *, step: int | None = None, fsync: bool = False, **fields: Any) -> dict[str, Any]:
        """Append one event; with ``fsync=True`` it is on disk before this returns (for records a crash must not lose).
        ``ValueError`` for a kind not in the event catalogue or without its required fields (``record.catalogue``)."""
        catalogue.check(kind, fields)
        event = {
            "t_wall": time.time(),
            "t_mono": time.monotonic(),
            "rank": self.rank,
            "attempt": self.attempt,
            "step": self.step if step is None else step,
            "kind": kind,
            "host": self._host,
            **fields,
        }
        os.write(self._fd, (json.dumps(event, sort_keys=True) + "\n").encode())
        if fsync:
            os.fsync(self._fd)
        return event

    def sync(self) -> None:
        """Everything emitted so far on disk (what ``fsync=True`` does, later: after a time-critical action)."""
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class EventTail:
    """The event log's lines appended since the last read (the supervisor follows the ranks' records)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset = path, 0

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        whole = data.rfind(b"\n") + 1  # a line still being written is read next time
        self.offset += whole
        out = []
        for line in data[:whole].splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:  # torn by a process killed mid-write (the module docstring)
                continue
        return out


def read_events(run_dir: str | Path) -> list[dict[str, Any]]:
    """All events of a run in file order; a torn last line (a process killed mid-write) is skipped."""
    path = Path(run_dir) / EVENTS_FILE
    if not path.exists():
        return []
    return list(_parse(path.read_text().splitlines()))


def _parse(lines: list[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            continue
