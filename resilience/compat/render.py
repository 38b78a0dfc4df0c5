"""``docs/compatibility.md``: the table, what each rule refuses among the options in conf/, what each option declares."""

from __future__ import annotations

import itertools
from dataclasses import fields
from typing import Any

from resilience.compat.combination import combinations, defaults, RUN
from resilience.compat.options import GROUPS, listing, Option, options
from resilience.compat.rules import Rule, RULES

ANY = None  # in a line of ``refused``: a choice that does not matter (every value of it is refused)


def refused(r: Rule) -> str:
    """What ``r`` refuses among the options in conf/ (the rest at the defaults), as few lines as cover it:
    ``fault=slow_disk: strategy=a or strategy=b``, a choice that does not matter left out; empty where it refuses
    none of them."""
    keys = [k for k in r.reads if k in GROUPS or k in RUN]
    values = [[o.option for o in options(k).values()] if k in GROUPS else list(RUN[k]) for k in keys]
    rows = [tuple(v.option if isinstance(v, Option) else v for v in picked.values())
            for picked, c in combinations(r.reads) if r.when(c)]
    # each refused row widened to the most choices that do not matter (every value of them refused too)
    wider = sorted((set(w) for n in range(len(keys), -1, -1) for w in itertools.combinations(range(len(keys)), n)),
                   key=len, reverse=True)
    lines: list[tuple[Any, ...]] = []
    known = set(rows)
    for row in rows:
        line = next(tuple(ANY if i in w else (v,) for i, v in enumerate(row)) for w in wider
                    if all(x in known for x in itertools.product(*[values[i] if i in w else [v]
                                                                  for i, v in enumerate(row)])))
        if line not in lines:
            lines.append(line)
    for i in reversed(range(len(keys))):  # lines alike but for one choice become one, last choice first
        merged: dict[tuple[Any, ...], list[Any]] = {}
        for line in lines:
            rest = line[:i] + (line[i] is ANY,) + line[i + 1:]
            merged.setdefault(rest, []).extend(line[i] if line[i] is not ANY else [])
        lines = [rest[:i] + (tuple(vs) if vs else ANY,) + rest[i + 1:] for rest, vs in merged.items()]
    said = []
    for line in lines:
        parts = [_choices(k, vs) for k, vs in zip(keys, line) if vs is not ANY]
        said.append(f"{', '.join(parts[:-1])}: {parts[-1]}" if len(parts) > 1 else "".join(parts))
    return "; ".join(said)


def _choices(key: str, values: tuple[Any, ...]) -> str:
    if key in GROUPS:
        return listing(key, [options(key)[v] for v in values], options(key).values())
    return " or ".join(f"{key}={v}" for v in values)


def render() -> str:
    """``docs/compatibility.md``: the table, what each rule refuses among the options, what each option declares."""
    d = defaults()
    lines = ["# Which roles go together", "",
             "<!-- Generated from the table in resilience/compat/rules.py by `python -m resilience.compat > "
             "docs/compatibility.md`; tests/test_compat.py checks that it is up to date. -->", "",
             "The command refuses a combination of roles that cannot run together before anything starts, in one "
             "line naming the settings and what is allowed (exit 2). Each rule below reads only what the roles "
             "declare (`caps`, `resilience/caps.py`); the rules apply in this order, the first refusal wins. "
             "The last column is what each rule refuses among the options in `conf/`, the other roles at their "
             f"defaults ({', '.join(d.set(g) for g in GROUPS if g != 'detector')}, "
             f"world_size={d.world_size}, supervisor.launcher={d.launcher}); some rules refuse only settings "
             "other than the options' own (`-`).", "",
             "| rule | reads | refuses | among the options |", "|---|---|---|---|"]
    for r in RULES:
        lines.append(f"| `{r.name}` | {', '.join(r.reads)} | {r.doc} | {refused(r) or '-'} |")
    lines += ["", "## What each option declares", "",
              "The capabilities that differ from their record's defaults, under the option's settings.", ""]
    for group in GROUPS:
        lines += [f"### {group}", "", "| option | declares |", "|---|---|"]
        for o in options(group).values():
            mine, plain = vars(o.caps), vars(type(o.caps)())
            declared = [f.name if mine[f.name] is True else f"{f.name}={mine[f.name]}" for f in fields(o.caps)
                        if f.compare and mine[f.name] != plain[f.name]]
            lines.append(f"| {o.option} | {', '.join(declared) or '-'} |")
        lines.append("")
    return "\n".join(lines)
