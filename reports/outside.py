"""Checks the pipeline does not run itself but the report shows, each a table a bench wrote, read as written with
the file's time (where it has not been run, the section says how to run it): the crash-consistency table of
ckpt-chaos (an independent tool: ``python -m resilience.bench.chaos`` writes ``results/chaos/chaos.md``;
docs/resume.md) and the projection against a measured failure trace (``make trace`` writes
``results/trace/trace.md``; docs/projection.md).
"""

from __future__ import annotations

import time
from pathlib import Path

import pandas as pd
from markupsafe import Markup

from reports.html import esc, section, table

CHAOS_TITLE = "Crash consistency, checked by an outside tool (ckpt-chaos)"
CHAOS_HOW = ("python -m resilience.bench.chaos (pip install -c workflow/envs/constraints.txt -e '.[chaos]'): "
             "ckpt-chaos crashes the ranks at the file boundaries of their saves (modes before, torn, term), "
             "resumes with resume=, and classifies each outcome; docs/resume.md has the method and the findings")


def markdown_table(text: str) -> pd.DataFrame:
    """The first Markdown pipe table of ``text`` as a frame (every cell a string)."""
    rows = [line.strip().strip("|").split("|") for line in text.splitlines() if line.strip().startswith("|")]
    rows = [[c.strip() for c in r] for r in rows if not all(set(c.strip()) <= set("-: ") for c in r)]
    if len(rows) < 2:
        return pd.DataFrame()
    width = len(rows[0])
    return pd.DataFrame([(r + [""] * width)[:width] for r in rows[1:]], columns=rows[0])


TRACE_TITLE = "The projection against a measured failure trace (model output beside a measurement)"
TRACE_HOW = ("make trace (python -m resilience.bench.trace): each compared technique trains under a seeded failure "
             "trace whose failures arrive in wall time, recoveries included, as at scale; the projection's closed "
             "form, with costs fitted on other runs, beside what it measured (with --clock steps: failures planned by "
             "step, and the step-clock predictions); docs/projection.md, \"The failure trace\"")


def chaos_section(path: Path | None) -> Markup:
    return _bench_section("chaos", CHAOS_TITLE, CHAOS_HOW, path)


def trace_section(path: Path | None) -> Markup:
    return _bench_section("trace", TRACE_TITLE, TRACE_HOW, path)


def _bench_section(anchor: str, title: str, how: str, path: Path | None) -> Markup:
    frame = markdown_table(path.read_text()) if path and path.is_file() else pd.DataFrame()
    if frame.empty:
        body = f"<p>Not run for this report. To run it: <code>{esc(how)}</code>.</p>"
    else:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(path.stat().st_mtime))
        body = (f"<p>{esc(path)} (written {when}); {esc(how)}.</p>"
                + str(table(frame, [(c, c) for c in frame.columns], text=list(frame.columns))))
    return section(anchor, title, body)
