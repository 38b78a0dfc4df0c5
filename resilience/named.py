"""A role's name is its option's name: written once, as the YAML file's and the module's name."""

from __future__ import annotations

from pathlib import Path

import yaml


class Named:
    """``conf/strategy/sync.yaml`` builds a class from ``resilience/strategies/sync.py``: the name is ``sync``.
    A module whose name cannot be the option's (a Python keyword, ``async``) sets ``option``."""

    option: str | None = None

    @property
    def name(self) -> str:
        return self.option or type(self).__module__.rpartition(".")[2]


def base_option(group_dir: Path, option: str) -> str:
    """The option that ``option`` is a variant of, or ``option`` itself. A variant is a YAML whose defaults list
    names another option of its group (``dcp_async_staged``: ``dcp_async`` with other settings): the same class,
    a row of its own in the report."""
    path = Path(group_dir) / f"{option}.yaml"
    spec = yaml.safe_load(path.read_text()) if path.is_file() else None
    bases = [d for d in (spec or {}).get("defaults", []) if isinstance(d, str) and d != "_self_"]
    return base_option(group_dir, bases[0]) if bases else option
