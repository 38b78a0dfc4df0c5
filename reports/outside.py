"""Checks the pipeline does not run itself but the report shows: the crash-consistency table of ckpt-chaos (an
independent tool: ``python -m resilience.bench.chaos`` writes ``results/chaos/chaos.md``; docs/resume.md). Read as
the bench wrote it, with the file's time; where it has not been run, the section says how to run it.
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


def chaos_section(path: Path | None) -> Markup:
    frame = markdown_table(path.read_text()) if path and path.is_file() else pd.DataFrame()
    if frame.empty:
        body = f"<p>Not run for this report. To run it: <code>{esc(CHAOS_HOW)}</code>.</p>"
    else:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(path.stat().st_mtime))
        body = (f"<p>{esc(path)} (written {when}); {esc(CHAOS_HOW)}.</p>"
                + str(table(frame, [(c, c) for c in frame.columns], text=list(frame.columns))))
    return section("chaos", CHAOS_TITLE, body)
