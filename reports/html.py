"""Small HTML building blocks for the one-file report: escaped text, tables, embedded PNG figures, the style sheet.

Everything is inline (images as base64 ``data:`` URIs, CSS in a ``<style>`` element): the file opens offline and
never refers to another file or to the network.
"""

from __future__ import annotations

import base64
import html
import io
import math
from typing import Any, Iterable

import pandas as pd
from matplotlib.figure import Figure

from reports import stats

CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 0; color: #222;
       background: #fafafa; }
main { max-width: 1180px; margin: 0 auto; padding: 1.2em 2em 4em; background: #fff; }
h1 { margin-bottom: 0.2em; } h2 { border-bottom: 2px solid #ddd; padding-bottom: 0.2em; margin-top: 2.2em; }
.meta, .caption, .note { color: #555; font-size: 0.92em; }
.caption { max-width: 70em; margin: 0.4em 0 1.2em; }
.projection { border-left: 6px solid #b58900; padding-left: 1em; background: #fffbea; }
.badge { display: inline-block; padding: 0.05em 0.5em; border-radius: 0.8em; font-size: 0.85em; }
.state-ok { background: #dff0d8; } .state-unrecovered { background: #fcf8e3; }
.state-failed, .state-invalid { background: #f2dede; } .state-not_run { background: #e8e8e8; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 0.88em; }
th, td { border: 1px solid #ddd; padding: 0.3em 0.55em; text-align: right; vertical-align: top; }
th { background: #f3f3f3; } td.text, th.text { text-align: left; }
td .ratio { display: block; color: #777; font-size: 0.85em; }
figure { margin: 0.5em 0 0; } figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
pre { background: #f6f6f6; padding: 0.6em; overflow-x: auto; font-size: 0.8em; max-height: 22em; }
nav ol { columns: 2; } dt { font-weight: 600; margin-top: 0.5em; } dd { margin-left: 1.5em; }
details summary { cursor: pointer; } .scroll { overflow-x: auto; }
"""


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


def figure(png: bytes, alt: str, caption: str, data_csv: str) -> str:
    """An embedded PNG with its caption and the name of the CSV that holds its data."""
    b64 = base64.b64encode(png).decode()
    return (f'<figure><img alt="{esc(alt)}" src="data:image/png;base64,{b64}">'
            f'<figcaption class="caption">{esc(caption)} <em>Data: {esc(data_csv)}.</em></figcaption></figure>')


def table(frame: pd.DataFrame, columns: Iterable[tuple[str, str]], text: Iterable[str] = (),
          ratios: dict[str, str] | None = None, intervals: Iterable[str] = ()) -> str:
    """An HTML table of ``frame``'s ``columns`` [(column, header)]; ``ratios`` maps a column to its ratio column;
    under each of the ``intervals`` columns, its n and 95% interval from ``<column>_n/_low/_high/_exact``, and
    under a ratio with a ``<ratio>_verdict`` column, the ratio's interval or "no measurable difference"."""
    columns, text, ratios, intervals = list(columns), set(text), ratios or {}, set(intervals)
    head = "".join(f'<th class="{"text" if c in text else ""}">{esc(h)}</th>' for c, h in columns)
    body = []
    for _, row in frame.iterrows():
        cells = []
        for c, _ in columns:
            value = row.get(c)
            inner = esc(fmt(value))
            if c in intervals and not missing(value):
                inner += f'<span class="ratio">{esc(_interval(row, c))}</span>'
            if c in ratios and not missing(row.get(ratios[c])):
                inner += f'<span class="ratio">{esc(_ratio(row, ratios[c]))}</span>'
            if c == "state" and not missing(value):
                inner = badge(value, inner)
            cells.append(f'<td class="{"text" if c in text else ""}">{inner}</td>')
        body.append(f"<tr>{''.join(cells)}</tr>")
    return (f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'
            f"</div>")


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
                            _known(row.get(f"{r}_verdict")))


def badge(state: Any, inner: str | None = None) -> str:
    """A cell state as a coloured badge (CSS class ``state-<state>``, spaces as ``_``)."""
    return f'<span class="badge state-{esc(str(state).replace(" ", "_"))}">{inner or esc(state)}</span>'


def section(anchor: str, title: str, body: str, css_class: str = "") -> str:
    cls = f' class="{css_class}"' if css_class else ""
    return f'<section id="{esc(anchor)}"{cls}><h2>{esc(title)}</h2>{body}</section>'


def page(title: str, body: str) -> str:
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>'
            f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{CSS}</style></head>'
            f"<body><main>{body}</main></body></html>\n")
