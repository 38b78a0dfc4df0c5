"""``resilience-bench --help``: the groups this command composes, their options, and the main settings.

Hydra's own help lists every directory of ``conf/`` as a group of the command (``matrix`` and ``scenario`` belong
to the pipeline and the projection) and dumps the whole composed configuration. This page is built from the same
files, so it cannot drift from them: the groups of ``config.yaml``'s defaults list with the options found on disk,
and the settings block of ``config.yaml`` as written, comments included.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import yaml

HELP_FLAGS = ("-h", "--help")
_WIDTH = 116

_USAGE = """\
resilience-bench: train on several ranks, inject a fault, detect it, recover, and check the recovered state bit
for bit against the fault-free run; writes result.json in the run directory.

Usage:  resilience-bench [group=option ...] [key=value ...]          (the same as: python -m resilience ...)
        resilience-bench -m strategy=sync,async fault=none,kill         (a sweep: one job per combination)
Example: resilience-bench strategy=async fault=kill fault.rank=1 fault.at_step=13 steps=30
"""

_MORE = """\
More:   --cfg job            print the composed configuration of a command line, run nothing
        --hydra-help         Hydra's own flags
        completion:          eval "$(resilience-bench -sc install=bash)"
        the benchmark matrix and its report: snakemake (see docs/pipeline.md)
"""


def help_text(conf_dir: Path, config_name: str = "config") -> str:
    """The page printed for ``--help``."""
    main_file = conf_dir / f"{config_name}.yaml"
    text = main_file.read_text()
    defaults = yaml.safe_load(text)["defaults"]
    lines = [_USAGE, "Groups (group=option; the default first):"]
    for entry in defaults:
        if not isinstance(entry, dict):
            continue
        ((group, default),) = entry.items()
        options = sorted(p.stem for p in (conf_dir / group).glob("*.yaml"))
        chosen = ",".join(default) if isinstance(default, list) else str(default)
        note = "  (a list: detector=[heartbeat,process_exit])" if isinstance(default, list) else ""
        lines.append(f"  {group:<10} [{chosen}]{note}")
        lines += textwrap.wrap(", ".join(options), width=_WIDTH, initial_indent=" " * 13,
                               subsequent_indent=" " * 13)
    lines += ["", "Settings (key=value; e.g. checkpoint.every=10), with their defaults:", _settings_block(text), "",
              _MORE]
    return "\n".join(lines)


def _settings_block(text: str) -> str:
    """``config.yaml`` from its first setting after the defaults list up to the ``hydra:`` node, indented."""
    rows = text.splitlines()
    start = next(i for i, row in enumerate(rows) if row and not row[0].isspace() and not row.startswith(("#", "-"))
                 and not row.startswith("defaults"))
    end = next((i for i, row in enumerate(rows) if row.startswith("hydra:")), len(rows))
    return "\n".join(f"  {row}".rstrip() for row in rows[start:end]).rstrip()
