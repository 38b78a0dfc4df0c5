"""The exactly-once ledger: which sample ids each rank trained on at each committed optimizer step.

Each rank process appends to its own file per attempt, ``ledger/rank{rank}.attempt{attempt}.bin``: records of a
fixed little-endian header (step, n: int64) followed by n int64 ids. A record is written in one call and flushed,
so a killed rank leaves at most one torn record, at the end, which the reader drops. A step that was trained
again after a rollback counts once, as its last record (latest attempt, then latest in the file): the update
it committed is the one that survived.
"""

from __future__ import annotations

import os
import re
import struct
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from resilience.record.fsio import fsync_dir
from resilience.settings.checks import require_int

HEADER = struct.Struct("<qq")  # step, number of ids
ID = np.dtype("<i8")
_NAME = re.compile(r"rank(\d+)\.attempt(\d+)\.bin")

Ledger = dict[int, dict[int, list[int]]]  # rank -> step -> sample ids


def ledger_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "ledger"


class LedgerWriter:
    """Appends this rank's records of one attempt; ``close`` makes them durable."""

    def __init__(self, run_dir: str | Path, rank: int, attempt: int) -> None:
        require_int("rank", rank, 0)
        require_int("attempt", attempt, 0)
        folder = ledger_dir(run_dir)
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"rank{rank}.attempt{attempt}.bin"
        self._file = open(self.path, "ab")
        # the same attempt opened again after a kill: its torn record goes, or every record after it would misread
        whole = _records(self.path)[1]
        if self._file.tell() > whole:
            self._file.truncate(whole)

    def record(self, step: int, ids: torch.Tensor) -> None:
        """The ids of every sample (all micro-batches) trained on at committed optimizer step ``step``."""
        require_int("step", step, 0)
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype != torch.int64:
            shown = f"{ids.dtype} of shape {tuple(ids.shape)}" if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise ValueError(f"ledger ids: must be a 1-D int64 tensor, got {shown}")
        payload = ids.detach().cpu().numpy().astype(ID, copy=False).tobytes()
        self._file.write(HEADER.pack(step, ids.numel()) + payload)  # one write: a kill tears at most this record
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            fsync_dir(self.path.parent)  # the file's entry too: a new attempt's file survives a crash of the host

    def __enter__(self) -> LedgerWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _records(path: Path) -> tuple[list[tuple[int, list[int]]], int]:
    """The whole records of one file, in order, and the bytes they fill; a torn trailing record is dropped."""
    data, pos, out = path.read_bytes(), 0, []
    while pos + HEADER.size <= len(data):
        step, n = HEADER.unpack_from(data, pos)
        end = pos + HEADER.size + n * ID.itemsize
        if n < 0 or end > len(data):
            break
        out.append((step, np.frombuffer(data, dtype=ID, count=n, offset=pos + HEADER.size).tolist()))
        pos = end
    return out, pos


def read_ledger(run_dir: str | Path) -> Ledger:
    """{rank: {step: ids}} of a run, the last record of each step counting."""
    folder = ledger_dir(run_dir)
    if not folder.is_dir():
        raise ValueError(f"{folder}: no ledger here (a run with a ledger writes ledger/rank*.attempt*.bin)")
    files = []
    for path in folder.iterdir():
        if match := _NAME.fullmatch(path.name):
            files.append((int(match[2]), int(match[1]), path))
    ledger: Ledger = {}
    for _, rank, path in sorted(files):  # attempts in order: a later attempt overwrites the steps it replayed
        steps = ledger.setdefault(rank, {})
        for step, ids in _records(path)[0]:
            steps[step] = ids
    return ledger


def _as_ledger(run: Ledger | str | Path) -> Ledger:
    return run if isinstance(run, dict) else read_ledger(run)


def compare_ledgers(run: Ledger | str | Path, reference: Ledger | str | Path) -> dict[str, Any]:
    """Whether ``run`` (a ledger or a run folder) trained on exactly the samples of ``reference``, step by step.

    ``skipped``: sample ids that the reference trained on more often than the run (counted over the whole run,
    with multiplicity: an id of every epoch counts once per epoch); ``repeated``: the other way round.
    """
    run, reference = _as_ledger(run), _as_ledger(reference)
    keys = {(rank, step) for led in (run, reference) for rank, steps in led.items() for step in steps}
    differing = sorted((step, rank) for rank, step in keys
                       if run.get(rank, {}).get(step) != reference.get(rank, {}).get(step))
    trained, expected = _counts(run), _counts(reference)
    return {
        "exactly_once": not differing,
        "first_diff_step": differing[0][0] if differing else None,
        "first_diff_rank": differing[0][1] if differing else None,
        "skipped": sum((expected - trained).values()),
        "repeated": sum((trained - expected).values()),
        "steps_checked": sum(len(steps) for steps in reference.values()),
        "missing_steps": sum(1 for r, s in keys if s not in run.get(r, {})),
        "extra_steps": sum(1 for r, s in keys if s not in reference.get(r, {})),
    }


def _counts(ledger: Ledger) -> Counter[int]:
    return Counter(i for steps in ledger.values() for ids in steps.values() for i in ids)
