"""``python -m reports.aggregate MATRIX SUMMARY_CSV DONE_JSON...``: one row per cell, in the matrix's order.

A row holds the cell's name and parameters (``cell.*``), how its job ended (``state``, ``exit_code``, ``error``,
``error_detail``, ``elapsed_s``, ``run_dir``, ``host`` and ``started``: where and when (UTC, ISO 8601) the job ran,
and ``probe``: the limits snapshot it ran under), every field of its
``result.json`` flattened with dotted names (``recovery_breakdown_s.load``; absent for cells without a result),
``parallel``: how the model was spread ("fsdp 4", "hsdp 2x2": result.json's ``parallel`` name and mesh shape;
``parallel.shards_per_replica`` is a column too), and ``matches_reference``: whether its final state equals, bit
for bit, that of the fault-free reference run of its
(workload, world_size, steps, seed) — empty when either run has no final state; for a run of the real loop
(``train=real``), ``state_parts.<part>.*`` and ``ledger.*``: each part of the job's state and the samples trained
on, against the same reference run (docs/job_state.md). A cell of the matrix without a
done.json keeps its row, in state ``not run`` (so that counts are of what the matrix asked for). SUMMARY_CSV is
written atomically, and a Parquet copy beside it (SUMMARY_CSV with the suffix .parquet).
"""

from __future__ import annotations

import io
import json
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable

import pandas as pd

from reports.matrix import Cell, Matrix, MatrixError, load_matrix
from resilience.record.fsio import atomic_write_bytes
from resilience.record.job_state import ledger, state_parts
from resilience.record.reference import not_by_design

JOB_FIELDS = ("state", "exit_code", "error", "error_detail", "elapsed_s", "host", "started", "probe")
NOT_RUN = "not run"  # the state of a matrix cell that has no done.json


def flatten(obj: dict[str, Any]) -> dict[str, Any]:
    """``{"a": {"b": 1}, "c": [1, 2]}`` -> ``{"a.b": 1, "c": "[1, 2]"}`` (pandas' json_normalize; lists as JSON
    text: one value per cell)."""
    row = pd.json_normalize(obj, sep=".").iloc[0].to_dict() if obj else {}
    return {key: json.dumps(value) if isinstance(value, list) else value for key, value in row.items()}


def summarize(matrix: Matrix, done_files: Iterable[str | Path]) -> pd.DataFrame:
    """One row per cell of ``matrix``, in its order: those with a done.json given, the others ``not run``.

    A done.json of a cell that is not in the matrix is an error.
    """
    by_cell: dict[str, Path] = {}
    for path in map(Path, done_files):
        done = json.loads(path.read_text())
        matrix.cell(done["cell"])  # a done.json of a cell that is not in this matrix is a pipeline bug
        by_cell[done["cell"]] = path
    rows = []
    for cell in matrix.cells:
        if cell.name not in by_cell:
            rows.append(not_run_row(cell))
            continue
        path = by_cell[cell.name]
        done = json.loads(path.read_text())
        job = {k: done.get(k) for k in JOB_FIELDS}
        if isinstance(job["started"], (int, float)):  # done.json: seconds since the epoch
            job["started"] = datetime.fromtimestamp(job["started"], timezone.utc).isoformat(timespec="seconds")
        row: dict[str, Any] = {**_cell_fields(cell), **job,
                               "run_dir": str(path.parent),
                               "command": " ".join(["python -m resilience", *done.get("overrides", [])])}
        result_path = path.parent / "result.json"
        if result_path.exists():
            result = json.loads(result_path.read_text())
            reference = by_cell.get(cell.reference)
            if not cell.is_reference and reference is not None:
                result.update(job_state(path.parent, reference.parent, result))
            row.update(flatten(result))
        rows.append(row)
    frame = pd.DataFrame(rows)
    if frame.empty:
        return frame
    if "final_state_sha256" not in frame:
        frame["final_state_sha256"] = None
    sha = {r.cell: r.final_state_sha256 for r in frame.itertuples() if isinstance(r.final_state_sha256, str)}
    frame.insert(frame.columns.get_loc("reference_cell") + 1, "matches_reference", [
        (own == sha[ref]) if isinstance(own, str) and ref in sha else None
        for own, ref in zip(frame["final_state_sha256"], frame["reference_cell"])
    ])
    frame["matches_reference"] = frame["matches_reference"].astype("object")
    frame["parallel"] = [parallel_label(r) for _, r in frame.iterrows()]
    return frame


def job_state(run_dir: Path, reference_dir: Path, result: dict[str, Any] | None = None) -> dict[str, Any]:
    """``state_parts`` and ``ledger`` of a run of the real loop against its reference cell's run: the pipeline's own
    verdict, as ``matches_reference`` is (its cells run with ``reference.check=none``, so result.json has none; a
    run compared with another reference by its command gets this one instead, the one every column of the row is
    judged by). Empty for a run that hashed no parts (the replayable loop), one that cannot end on the reference's
    state by design (result.json's own reference verdict skips it too), or one whose reference has not run."""
    if result is None:
        result = json.loads((run_dir / "result.json").read_text())
    if not (reference_dir / "result.json").exists() or not_by_design(result) is not None:
        return {}
    parts = state_parts(run_dir, reference_dir)
    if parts is None:
        return {}
    both_ledgers = (run_dir / "ledger").is_dir() and (reference_dir / "ledger").is_dir()
    return {"state_parts": parts, "ledger": ledger(run_dir, reference_dir) if both_ledgers else None}


def parallel_label(row: pd.Series) -> str:
    """How the run spread the model: "fsdp 4", "hsdp 2x2" (result.json's name and mesh shape); a cell without a
    result, or one from before result.json recorded it, names its ``parallel`` axis (default ``ddp``)."""
    name, mesh = row.get("parallel.name"), row.get("parallel.mesh")
    if isinstance(name, str) and isinstance(mesh, str):
        return f"{name} {'x'.join(str(n) for n in json.loads(mesh))}"
    axis = row.get("cell.parallel")
    return axis if isinstance(axis, str) else "ddp"


def _cell_fields(cell: Cell) -> dict[str, Any]:
    return {"cell": cell.name, "is_reference": cell.is_reference, "reference_cell": cell.reference, **cell.columns()}


def not_run_row(cell: Cell) -> dict[str, Any]:
    """The row of a cell the matrix asks for that has not run (no done.json): its parameters, state ``not run``."""
    return {**_cell_fields(cell), "state": NOT_RUN, "run_dir": None,
            "command": " ".join(["python -m resilience", *cell.overrides])}


def with_matrix_cells(frame: pd.DataFrame, matrix: Matrix) -> pd.DataFrame:
    """``frame`` plus a ``not run`` row for every cell of ``matrix`` it lacks (a summary older than its matrix)."""
    have = set(frame["cell"]) if "cell" in frame else set()
    missing = [not_run_row(c) for c in matrix.cells if c.name not in have]
    return pd.concat([frame, pd.DataFrame(missing)], ignore_index=True) if missing else frame


def parquet_types(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with each column that mixes numbers and words as words (``checkpoint.every``: 4 or auto), which
    Parquet's one type per column needs; the readers take such a column with ``tables.col`` (numbers or NaN)."""
    def mixed(values: pd.Series) -> bool:
        return len({isinstance(v, str) for v in values.dropna() if isinstance(v, (str, int, float))
                    and not isinstance(v, bool)}) > 1

    return frame.assign(**{c: frame[c].map(lambda v: v if pd.isna(v) else str(v), na_action="ignore")
                           for c in frame.columns if frame[c].dtype == object and mixed(frame[c])})


def write(frame: pd.DataFrame, csv_path: Path) -> list[Path]:
    """Write the CSV and its Parquet copy (pyarrow, a project dependency) atomically; returns the paths written."""
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(csv_path, frame.to_csv(index=False).encode())
    written = [csv_path]
    buf = io.BytesIO()
    parquet_types(frame).to_parquet(buf, index=False)
    parquet = csv_path.with_suffix(".parquet")
    atomic_write_bytes(parquet, buf.getvalue())
    return written + [parquet]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        print("usage: python -m reports.aggregate MATRIX SUMMARY_CSV DONE_JSON...", file=sys.stderr)
        return 2
    try:
        matrix = load_matrix(args[0])
        frame = summarize(matrix, args[2:])
    except MatrixError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    paths = write(frame, Path(args[1]))
    states = frame["state"].value_counts().to_dict() if not frame.empty else {}
    print(f"{len(frame)} cells of matrix {matrix.name}: {states}; wrote {', '.join(map(str, paths))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
