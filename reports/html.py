"""Small HTML building blocks for the one-file report, each a Jinja2 template in ``reports/templates/`` (page,
section, table, figure, badge; the style sheet ``style.css``): escaped text, tables, embedded PNG figures.

Everything is inline (images as base64 ``data:`` URIs, CSS in a ``<style>`` element): the file opens offline and
never refers to another file or to the network. Every function returns ``Markup``: HTML that the templates embed
as is, while any plain string is escaped.
"""

from __future__ import annotations

import base64
import html
import io
import math
from pathlib import Path
from typing import Any, Iterable

import jinja2
import pandas as pd
from markupsafe import Markup
from matplotlib.figure import Figure

from reports import stats

TEMPLATES = Path(__file__).resolve().parent / "templates"
# One environment for every template; autoescape: any value put in is text unless it is already Markup (HTML that
# a building block below or a report section made).
_ENV = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=True, trim_blocks=False,
                          undefined=jinja2.StrictUndefined)


def render_template(name: str, **context: Any) -> Markup:
    """``reports/templates/<name>`` with ``context``; strings given as ``Markup`` go in unescaped."""
    return Markup(_ENV.get_template(name).render(**context))

def esc(value: Any) -> str:
    return html.escape("" if value is None else str(value))


def missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value)) or value is pd.NA


def fmt(value: Any, digits: int = 3) -> str:
    """A number with ``digits`` significant digits; "-" for missing values; text as is."""
    if missing(value):
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, float)):
        if float(value).is_integer() and abs(value) < 1e6:
            return f"{int(value)}"
        return f"{value:.{digits}g}" if abs(value) < 10 ** digits else f"{value:,.0f}"
    return str(value)


def png_bytes(fig: Figure, dpi: int = 110) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    return buf.getvalue()


def figure(png: bytes, alt: str, caption: str, data_csv: str) -> Markup:
    """An embedded PNG with its caption and the name of the CSV that holds its data."""
    return render_template("figure.html.j2", alt=alt, b64=base64.b64encode(png).decode(), caption=caption,
                           data_csv=data_csv)


def table(frame: pd.DataFrame, columns: Iterable[tuple[str, str]], text: Iterable[str] = (),
          ratios: dict[str, str] | None = None, intervals: Iterable[str] = ()) -> Markup:
    """An HTML table of ``frame``'s ``columns`` [(column, header)]; ``ratios`` maps a column to its ratio column;
    under each of the ``intervals`` columns, its n and 95% interval from ``<column>_n/_low/_high/_exact``, and
    under a ratio with a ``<ratio>_verdict`` column, the ratio's interval or "no measurable difference"."""
    columns, text, ratios, intervals = list(columns), set(text), ratios or {}, set(intervals)
    rows = []
    for _, row in frame.iterrows():
        cells = []
        for c, _ in columns:
            value = row.get(c)
            subs = []
            if c in intervals and not missing(value):
                subs.append(_interval(row, c))
            if c in ratios and not missing(row.get(ratios[c])):
                subs.append(_ratio(row, ratios[c]))
            state = str(value).replace(" ", "_") if c == "state" and not missing(value) else None
            cells.append({"text": fmt(value), "subs": subs, "badge": state, "is_text": c in text})
        rows.append(cells)
    return render_template("table.html.j2", heads=[(h, c in text) for c, h in columns], rows=rows)


def _known(value: Any) -> Any:
    return None if missing(value) else value


def _interval(row: pd.Series, c: str) -> str:
    n = row.get(f"{c}_n")
    return stats.interval_text(0 if missing(n) else int(n), _known(row.get(f"{c}_low")),
                               _known(row.get(f"{c}_high")), row.get(f"{c}_exact") in (True, "True"))


def _ratio(row: pd.Series, r: str) -> str:
    if f"{r}_verdict" not in row:
        return f"x{row[r]:.2f} vs sync"
    return stats.ratio_text(row[r], _known(row.get(f"{r}_low")), _known(row.get(f"{r}_high")),
                            _known(row.get(f"{r}_verdict")), _known(row.get(f"{r}_level")))


def badge(state: Any, inner: str | None = None) -> Markup:
    """A cell state as a coloured badge (CSS class ``state-<state>``, spaces as ``_``); ``inner`` is text unless
    it is Markup."""
    return render_template("badge.html.j2", state=str(state).replace(" ", "_"),
                           inner=str(state) if inner is None else inner)


def section(anchor: str, title: str, body: str, css_class: str = "") -> Markup:
    """A report section; ``body`` is HTML (the section functions build it)."""
    return render_template("section.html.j2", anchor=anchor, title=title, body=Markup(body), css_class=css_class)


def page(title: str, body: str) -> Markup:
    return render_template("page.html.j2", title=title, body=Markup(body)) + "\n"
