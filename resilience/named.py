"""A role's name is its option's name: written once, as the YAML file's and the module's name."""

from __future__ import annotations


class Named:
    """``conf/strategy/sync.yaml`` builds a class from ``resilience/strategies/sync.py``: the name is ``sync``.
    A module whose name cannot be the option's (a Python keyword, ``async``) sets ``option``."""

    option: str | None = None

    @property
    def name(self) -> str:
        return self.option or type(self).__module__.rpartition(".")[2]
