"""Which roles go together: one table of rules over what the roles declare (``caps``, ``resilience.caps``).

A rule is a row: a condition on one ``Combination`` (each role's option name and capabilities, and the run's
settings) and the refusal it says, one line naming the settings and what is allowed. ``build_roles`` runs the
table before anything starts: the first refusal is a ``ValueError`` (exit 2 from the command line). A plug-in's
module appends rows of its own to ``RULES``, so that it brings them with it. A hint in a refusal ("use
strategy=...") is computed from the table: the options in ``conf/`` that it allows in the refused one's place. The
report's notes and ``docs/compatibility.md`` (``python -m resilience.compat``) are rendered from it too.

The rooms, each beneath the next: ``options`` (the options of conf/ and how a refusal names them),
``combination`` (what the rules see of a run), ``rules`` (the rows; ``pipeline``: pipeline parallelism's),
``render`` (the documentation). ``refusal`` and ``check`` live here: they read ``RULES`` as this package holds it
when they are asked, a plug-in's rows too.
"""

from __future__ import annotations

from resilience.compat.combination import Combination, combinations, defaults, judged_by, RUN
from resilience.compat.options import CONF_DIR, GROUPS, listing, Option, options
from resilience.compat.pipeline import PIPELINE_RULES
from resilience.compat.render import refused, render
from resilience.compat.rules import Rule, RULES

__all__ = ["CONF_DIR", "GROUPS", "RUN", "RULES", "Combination", "Option", "Rule", "check", "combinations",
           "defaults", "listing", "options", "refusal", "refused", "render"]


def refusal(c: Combination) -> str | None:
    """The first refusal of ``c`` in the table's order, or None: the roles go together."""
    return next((line for r in RULES if (line := r.check(c)) is not None), None)


def check(c: Combination) -> None:
    """Raise ``ValueError`` with the one-line refusal when the roles of ``c`` do not go together."""
    line = refusal(c)
    if line is not None:
        raise ValueError(line)


RULES.extend(PIPELINE_RULES)  # pipeline parallelism's rows (resilience/compat/pipeline.py), after the general ones
judged_by(refusal)  # a hint's alternatives are judged by the same table
