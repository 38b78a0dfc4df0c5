"""The table of which roles go together (resilience/compat/): every rule holds over every combination of the
options in conf/ that it reads, its hints name only what the table allows, and docs/compatibility.md is the table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from resilience import compat

DOC = Path(__file__).resolve().parent.parent / "docs" / "compatibility.md"
SETTING = re.compile(r"(\w+)=(\w+)")


@pytest.mark.parametrize("rule", compat.RULES, ids=lambda r: r.name)
def test_every_rule_holds_over_the_options_it_reads(rule):
    """A refusal is one line that starts with the setting it refuses; each option it offers instead ("use
    strategy=...") is one that the whole table allows in that place."""
    for _, c in compat.combinations(rule.reads):
        if not rule.when(c):
            continue
        line = rule.says(c)
        assert "\n" not in line and re.match(r"[\w.]+=\S*: ", line), line
        offered = line.rpartition("; use ")[2] if "; use " in line else ""
        for group, name in SETTING.findall(offered):
            if group in compat.GROUPS:
                fine = [o for o in compat.options(group).values()
                        if o.name == name and compat.refusal(c.choosing(o)) is None]
                assert fine, f"{line}: offers {group}={name}, which the table refuses here too"


def test_the_documentation_is_the_table():
    assert DOC.read_text() == compat.render() + "\n", \
        "docs/compatibility.md is out of date: python -m resilience.compat > docs/compatibility.md"
