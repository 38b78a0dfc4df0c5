"""``python -m reports SUMMARY_CSV --out results/report/index.html [...]``: render the report from the summary.

The other inputs are optional, so that a report can be rendered from any summary.csv: ``--matrix`` (the matrix it
came from: the header, and the cells it asks for that the summary lacks, counted as ``not run``), ``--limits`` and
``--environment`` (the probe rule's snapshot, results/probe/<snapshot>/; absent: "not probed"), ``--projection``
(the projection's status JSON; absent: the section says it was not run).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

from reports.aggregate import with_matrix_cells
from reports.matrix import MatrixError, load_matrix
from reports.render import render


def _json(path: Path | None) -> dict:
    return json.loads(path.read_text()) if path and path.exists() else {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reports", description=__doc__.splitlines()[0])
    parser.add_argument("summary", type=Path, help="summary.csv written by python -m reports.aggregate")
    parser.add_argument("--out", type=Path, required=True, help="the index.html to write (figures go beside it)")
    parser.add_argument("--matrix", help="matrix name or YAML path (header only)")
    parser.add_argument("--limits", type=Path)
    parser.add_argument("--environment", type=Path)
    parser.add_argument("--projection", type=Path, help="projection_status.json of python -m reports.project")
    parser.add_argument("--chaos", type=Path, help="chaos.md of python -m resilience.bench.chaos (absent: the "
                                                   "section says how to run it)")
    parser.add_argument("--trace", type=Path, help="trace.md of make trace (absent: the section says how to run it)")
    args = parser.parse_args(argv)
    info = {"name": args.matrix or "unknown", "source": args.matrix or "-", "description": ""}
    summary = pd.read_csv(args.summary) if args.summary.stat().st_size > 1 else pd.DataFrame()
    if args.matrix:
        try:
            m = load_matrix(args.matrix)
        except MatrixError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        info = {"name": m.name, "source": m.source, "description": m.description}
        summary = with_matrix_cells(summary, m)  # counted against what the matrix asks for, not what ran
    limits = _json(args.limits) or {"probed": False, "reason": "no limits file"}
    out = render(summary, args.out, info, limits, _json(args.environment), args.projection, args.chaos, args.trace)
    print(f"report: {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
